// toolgym trace viewer: plain JS, no dependencies. Talks to the JSON API of `toolgym view`
// (configs/cli/viewer/server.py). Lists are paged by the server, so a large recording draws its
// first page at once; one episode is fetched when it is picked.
"use strict";

const state = {
  rec: 0, offset: 0, limit: 100, sort: "i", desc: false, filters: {},
  shade: "mask", selected: null, cmpOffset: 0, recordings: [], charts: null,
};
const $ = (id) => document.getElementById(id);

function showError(text) {
  const box = $("error");
  box.hidden = false;
  box.textContent = text;
}

async function api(route, params) {
  const query = new URLSearchParams(params || {}).toString();
  const response = await fetch(`/api/${route}${query ? "?" + query : ""}`);
  let body;
  try { body = await response.json(); } catch (e) { throw new Error(`${route}: HTTP ${response.status}`); }
  if (!response.ok) throw new Error(body.error || `${route}: HTTP ${response.status}`);
  return body;
}

const fmt = (x, digits = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
const signed = (x, digits = 3) => (x === null || x === undefined ? "–" : (x >= 0 ? "+" : "") + Number(x).toFixed(digits));
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child);
  return node;
}
function objText(obj, sign = true) {
  const keys = Object.keys(obj || {});
  const show = (v) => (typeof v === "number" ? (sign ? signed(v) : Number(v.toPrecision(4))) : v);
  return keys.length ? keys.map((k) => `${k} ${show(obj[k])}`).join(", ") : "–";
}

// ---- recordings and problems --------------------------------------------------------------

async function init() {
  try {
    const info = await api("recordings");
    state.recordings = info.recordings;
    state.charts = info;
    $("title").textContent = info.title;
    for (const sel of [$("recording-select"), $("compare-a"), $("compare-b")]) {
      sel.replaceChildren(...info.recordings.map((r) => el("option", { value: r.id, text: r.label })));
    }
    // B: the last eval of a run (eval_step_*), else the last recording; A: the first.
    const evals = info.recordings.filter((r) => r.label.startsWith("eval_"));
    const last = evals.length ? evals[evals.length - 1].id : info.recordings.length - 1;
    $("compare-b").value = String(last);
    $("recording-select").value = "0";
    await openRecording(0);
  } catch (e) {
    showError(`The viewer could not load: ${e.message}`);
    $("status").textContent = "";
  }
}

async function openRecording(rid) {
  state.rec = rid; state.offset = 0; state.selected = null; state.filters = {};
  $("status").textContent = "Reading the recording…";
  const [summary] = await Promise.all([api("recording", { r: rid }), loadPage()]);
  showSummary(summary);
}

function showSummary(s) {
  const h = s.header;
  const head = h ? `${h.env_id} ${JSON.stringify(h.env_kwargs)} · policy ${h.policy_id || "?"} · created ${h.created || "?"} · schema v${h.schema_version}` : "no readable header";
  $("status").textContent = `${s.label}: ${s.episodes} episodes · ${head}` + (s.skipped ? ` · ${s.skipped} ${s.skipped === 1 ? "line" : "lines"} skipped` : "");
  const box = $("problems");
  box.hidden = !s.problems.length;
  box.replaceChildren(
    el("b", { text: s.episodes ? "Read what could be read; skipped:" : "No episode could be read:" }),
    el("ul", {}, ...s.problems.map((p) => el("li", { text: p }))),
  );
  const f = s.facets;
  const options = (id, values) => {
    $(id).replaceChildren(el("option", { value: "", text: "all" }), ...values.map((v) => el("option", { value: v, text: v === "" ? "(none)" : v })));
  };
  options("filter-env", f.env); options("filter-stop", f.stop); options("filter-failure", f.failure);
  options("filter-version", f.version.map(String));
  for (const id of ["filter-seed", "filter-rmin", "filter-rmax"]) $(id).value = "";
  $("filter-rmin").placeholder = fmt(f.reward_min, 2);
  $("filter-rmax").placeholder = fmt(f.reward_max, 2);
}

// ---- the episode list ---------------------------------------------------------------------

async function loadPage() {
  const params = { r: state.rec, offset: state.offset, limit: state.limit, sort: state.sort, desc: state.desc ? 1 : 0 };
  for (const [k, v] of Object.entries(state.filters)) if (v !== "") params[k] = v;
  const page = await api("episodes", params);
  const body = $("episode-table").tBodies[0];
  body.replaceChildren(...page.rows.map((r) => {
    const tr = el("tr", { "data-i": r.i, "data-seed": r.seed },
      el("td", { text: r.i }), el("td", { text: r.seed }), el("td", { text: r.group }),
      el("td", { text: r.stop }), el("td", { text: r.failure }), el("td", { text: fmt(r.reward) }),
      el("td", { text: signed(r.adv, 2) }), el("td", { text: r.turns }), el("td", { text: r.tokens }),
      el("td", { text: r.version }));
    if (r.i === state.selected) tr.classList.add("selected");
    return tr;
  }));
  const end = Math.min(page.offset + page.rows.length, page.total);
  $("list-count").textContent = page.total
    ? `${page.offset + 1}–${end} of ${page.total}` + (page.total !== page.all ? ` (filtered from ${page.all})` : "")
    : `no episodes match (of ${page.all})`;
  $("pager-prev").disabled = page.offset === 0;
  $("pager-next").disabled = end >= page.total;
  for (const th of document.querySelectorAll("#episode-table th[data-sort]")) {
    th.classList.toggle("sorted", th.dataset.sort === state.sort);
    th.classList.toggle("desc", th.dataset.sort === state.sort && state.desc);
  }
  if (window.__firstRender === undefined && page.rows.length) window.__firstRender = performance.now();
  document.body.dataset.listVersion = String(Number(document.body.dataset.listVersion || 0) + 1);
}

function wireList() {
  for (const input of document.querySelectorAll("#filters [data-param]")) {
    input.addEventListener("change", () => {
      state.filters[input.dataset.param] = input.value; state.offset = 0;
      loadPage().catch((e) => showError(e.message));
    });
  }
  $("filter-clear").addEventListener("click", () => {
    state.filters = {}; state.offset = 0;
    for (const input of document.querySelectorAll("#filters [data-param]")) input.value = "";
    loadPage().catch((e) => showError(e.message));
  });
  $("pager-prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - state.limit); loadPage().catch((e) => showError(e.message)); });
  $("pager-next").addEventListener("click", () => { state.offset += state.limit; loadPage().catch((e) => showError(e.message)); });
  for (const th of document.querySelectorAll("#episode-table th[data-sort]")) {
    th.addEventListener("click", () => {
      state.desc = state.sort === th.dataset.sort ? !state.desc : th.dataset.sort !== "i";
      state.sort = th.dataset.sort; state.offset = 0;
      loadPage().catch((e) => showError(e.message));
    });
  }
  $("episode-table").tBodies[0].addEventListener("click", (event) => {
    const tr = event.target.closest("tr");
    if (!tr) return;
    for (const other of tr.parentNode.children) other.classList.remove("selected");
    tr.classList.add("selected");
    state.selected = Number(tr.dataset.i);
    showEpisode(state.rec, state.selected, $("episode-detail")).catch((e) => showError(e.message));
  });
  $("recording-select").addEventListener("change", (e) => openRecording(Number(e.target.value)).catch((err) => showError(err.message)));
}

// ---- one episode, token by token ----------------------------------------------------------

const episodes = new WeakMap(); // transcript element -> episode data (for the tooltip)

async function showEpisode(rid, i, target) {
  target.replaceChildren(el("p", { class: "hint", text: "Loading…" }));
  const ep = await api("episode", { r: rid, i });
  const meta = el("div", { class: "meta" });
  meta.append(
    el("div", {}, el("b", { text: `episode ${ep.i}` }), ` (line ${ep.line}) · ${ep.env} ${ep.kwargs} · task seed ${ep.seed} · group ${ep.group} · sample ${ep.sample} · policy v${ep.version}`),
    el("div", {}, `stop ${ep.stop} · failure mode ${ep.failure || "–"} · reward `, el("b", { text: signed(ep.reward) }),
      ` (${objText(ep.components)}) · advantage ${signed(ep.adv, 3)}${ep.trained ? "" : " (not trained on)"} · ${ep.turns} turns · ${ep.tokens} sampled tokens`),
    el("div", {}, `env metrics: ${objText(ep.metrics, false)}`),
  );
  if (ep.error) meta.append(el("div", { class: "worse", text: `error: ${ep.error}` }));
  if (ep.notice) meta.append(el("div", { class: "hint", text: ep.notice }));
  const transcript = el("div", { class: "transcript", "data-episode": ep.i });
  episodes.set(transcript, ep);
  drawTranscript(transcript, ep);
  target.replaceChildren(meta, shadeSwitch(), legend(), transcript);
  applyShade(transcript, ep);
}

let shadeGroups = 0;
function shadeSwitch() {
  const box = el("div", { class: "shade" }, "shade by:");
  const group = `shade-${(shadeGroups += 1)}`; // one radio group per transcript
  for (const [mode, label] of [["mask", "loss mask"], ["logprob", "sampler logprob"], ["adv", "advantage"]]) {
    const input = el("input", { type: "radio", name: group, value: mode, class: `shade-${mode}` });
    input.checked = state.shade === mode;
    input.addEventListener("change", () => {
      state.shade = mode;
      for (const radio of document.querySelectorAll(`.shade-${mode}`)) radio.checked = true;
      for (const t of document.querySelectorAll(".transcript")) applyShade(t, episodes.get(t));
      for (const l of document.querySelectorAll(".legend")) l.replaceWith(legend());
    });
    box.append(el("label", {}, input, ` ${label}`));
  }
  return box;
}

function legend() {
  const box = el("div", { class: "legend" });
  const span = (text, color) => { const s = el("span", { text }); s.style.background = color; return s; };
  if (state.shade === "mask") box.append(span("sampled: trained on (mask 1)", maskColor(1)), span("prompt / env: not trained (mask 0)", "#f1f1f1"));
  if (state.shade === "logprob") box.append(span("p = 0.05", probColor(0.05)), span("p = 0.5", probColor(0.5)), span("p = 1", probColor(1)), " (sampled tokens; prompt unshaded)");
  if (state.shade === "adv") box.append(span("advantage < 0", advColor(-1, 1)), span("= 0", advColor(0, 1)), span("> 0", advColor(1, 1)));
  return box;
}

const maskColor = (m) => (m ? "rgba(46, 160, 67, 0.30)" : "");
const probColor = (p) => `hsl(${Math.round(120 * p)}, 75%, 80%)`;
function advColor(a, scale) {
  if (!a) return "rgba(160, 160, 160, 0.25)";
  const alpha = 0.15 + 0.55 * Math.min(1, Math.abs(a) / (scale || 1));
  return a > 0 ? `rgba(46, 110, 220, ${alpha})` : `rgba(220, 60, 40, ${alpha})`;
}

function drawTranscript(box, ep) {
  const t = ep.stream;
  const frag = document.createDocumentFragment();
  if (ep.system_prompt && !t.text) frag.append(el("span", { class: "tok m0", text: `[system] ${ep.system_prompt}\n` }));
  const note = (k) => {
    const turn = ep.turn_list[k];
    const parts = [`turn ${k}: reward ${signed(turn.reward)}`];
    if (Object.keys(turn.components).length) parts.push(`components ${objText(turn.components)}`);
    if (Object.keys(turn.metrics).length) parts.push(`metrics ${objText(turn.metrics, false)}`);
    if (turn.error) parts.push(`env raised: ${turn.error}`);
    if (turn.finish !== "stop") parts.push(`finish: ${turn.finish}`);
    return el("span", { class: "turn-note", "data-turn": k, text: `[${parts.join(" · ")}]` });
  };
  if (t.text) {
    for (let k = 0; k < t.id.length; k++) {
      const text = t.text[k];
      if (k > 0 && t.turn[k] !== t.turn[k - 1] && ep.turn_list[t.turn[k]].sequence_start) {
        frag.append(el("span", { class: "turn-note", text: "[a new training sequence: the chat template re-rendered the history]" }));
      }
      const span = el("span", { class: `tok m${t.mask[k]}`, "data-k": k, text });
      if (/^<\|.*\|>$/.test(text)) span.classList.add("special");
      frag.append(span);
      if (k === t.id.length - 1 || t.turn[k + 1] !== t.turn[k]) frag.append(note(t.turn[k]));
    }
  } else { // no token text (another tokenizer): each turn's text as two spans
    ep.turn_list.forEach((turn, k) => {
      frag.append(el("span", { class: "tok m0", text: turn.observation + "\n" }));
      frag.append(el("span", { class: "tok m1", "data-turn-action": k, text: turn.action }));
      frag.append(note(k));
    });
  }
  if (ep.final_observation) frag.append(el("span", { class: "final-note", text: `[env's last reply, not shown to the model: ${ep.final_observation}]` }));
  box.replaceChildren(frag);
}

function applyShade(box, ep) {
  const t = ep.stream;
  const scale = Math.max(1e-9, ...t.adv.map(Math.abs));
  for (const span of box.querySelectorAll(".tok")) {
    const k = span.dataset.k === undefined ? null : Number(span.dataset.k);
    const sampled = span.classList.contains("m1");
    let color = "";
    if (state.shade === "mask") color = maskColor(sampled ? 1 : 0);
    else if (sampled && k !== null && state.shade === "logprob" && t.logprob[k] !== null) color = probColor(Math.exp(t.logprob[k]));
    else if (sampled && k !== null && state.shade === "adv") color = advColor(t.adv[k], scale);
    else if (sampled && k === null && state.shade === "adv") color = advColor(ep.adv, Math.abs(ep.adv) || 1);
    span.style.background = color;
  }
  box.dataset.shade = state.shade;
}

function wireTooltip() {
  const tip = $("tooltip");
  document.addEventListener("mouseover", (event) => {
    const span = event.target.closest && event.target.closest(".tok[data-k]");
    if (!span) { tip.hidden = true; return; }
    const ep = episodes.get(span.closest(".transcript"));
    if (!ep) return;
    const t = ep.stream, k = Number(span.dataset.k);
    const lp = t.logprob[k];
    tip.textContent = [
      `token ${k}: id ${t.id[k]} ${JSON.stringify(t.text ? t.text[k] : "")}`,
      `loss mask ${t.mask[k]} · turn ${t.turn[k]}` + (t.pv[k] === null ? "" : ` · policy v${t.pv[k]}`),
      t.mask[k] ? `sampler logprob ${fmt(lp, 4)} (p ${lp === null ? "–" : fmt(Math.exp(lp), 3)}) · advantage ${signed(t.adv[k], 4)}` : "prompt / env token: not trained on",
    ].join("\n");
    tip.hidden = false;
  });
  document.addEventListener("mousemove", (event) => {
    tip.style.left = `${event.clientX + 14}px`;
    tip.style.top = `${event.clientY + 14}px`;
  });
}

// ---- comparison ---------------------------------------------------------------------------

async function loadCompare() {
  const a = $("compare-a").value, b = $("compare-b").value;
  const page = await api("compare", { a, b, changed: $("compare-changed").checked ? 1 : 0, offset: state.cmpOffset, limit: 100 });
  const delta = page.mean_a !== null && page.mean_b !== null ? page.mean_b - page.mean_a : null;
  $("compare-summary").textContent = `${page.a} vs ${page.b}: ${page.common} (task seed, sample) pairs in both (mean reward A ${fmt(page.mean_a)}, B ${fmt(page.mean_b)}, B − A ${signed(delta)}) · only in A ${page.only_a} · only in B ${page.only_b} · rows ${page.total ? page.offset + 1 : 0}–${page.offset + page.rows.length} of ${page.total}`;
  $("compare-table").tBodies[0].replaceChildren(...page.rows.map((row) => {
    const d = row.a && row.b && row.a.reward !== null && row.b.reward !== null ? row.b.reward - row.a.reward : null;
    const cls = d === null || d === 0 ? "" : d > 0 ? "better" : "worse";
    const tr = el("tr", { "data-seed": row.seed, "data-sample": row.sample, "data-a": row.a ? row.a.i : "", "data-b": row.b ? row.b.i : "" },
      el("td", { text: row.seed }), el("td", { text: row.sample }),
      el("td", { text: row.a ? fmt(row.a.reward) : "–" }), el("td", { text: row.a ? row.a.stop : "(none)" }),
      el("td", { text: row.b ? fmt(row.b.reward) : "–" }), el("td", { text: row.b ? row.b.stop : "(none)" }),
      el("td", { class: cls, text: signed(d) }));
    return tr;
  }));
  $("compare-prev").disabled = page.offset === 0;
  $("compare-next").disabled = page.offset + page.rows.length >= page.total;
}

function wireCompare() {
  for (const id of ["compare-a", "compare-b", "compare-changed"]) {
    $(id).addEventListener("change", () => { state.cmpOffset = 0; loadCompare().catch((e) => showError(e.message)); });
  }
  $("compare-prev").addEventListener("click", () => { state.cmpOffset = Math.max(0, state.cmpOffset - 100); loadCompare().catch((e) => showError(e.message)); });
  $("compare-next").addEventListener("click", () => { state.cmpOffset += 100; loadCompare().catch((e) => showError(e.message)); });
  $("compare-table").tBodies[0].addEventListener("click", (event) => {
    const tr = event.target.closest("tr");
    if (!tr) return;
    for (const other of tr.parentNode.children) other.classList.remove("selected");
    tr.classList.add("selected");
    const sides = [["a", $("compare-a")], ["b", $("compare-b")]].map(([side, select]) => {
      const box = el("div", { class: `side-${side}` });
      const i = tr.dataset[side];
      const label = select.options[select.selectedIndex].text;
      if (i === "") box.append(el("p", { class: "hint", text: `${label}: no episode for task seed ${tr.dataset.seed}` }));
      else showEpisode(Number(select.value), Number(i), box).then(() => box.prepend(el("h3", { text: `${side.toUpperCase()}: ${label}` }))).catch((e) => showError(e.message));
      return box;
    });
    $("compare-detail").replaceChildren(...sides);
  });
}

// ---- charts -------------------------------------------------------------------------------

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const TITLES = { reward: "reward", accuracy: "accuracy", turns: "turns per episode", tokens: "sampled tokens per episode" };

function drawCharts() {
  const info = state.charts;
  $("charts-note").textContent = info.charts_kind === "run"
    ? "From the run's metrics.jsonl: train batches as lines, held-out evals as markers, against step."
    : "No run metrics given: each recording's mean per policy version.";
  const box = $("charts");
  box.replaceChildren();
  for (const [name, series] of Object.entries(info.charts)) box.append(chart(TITLES[name] || name, series, info.charts_kind === "run" ? "step" : "policy version"));
}

function chart(title, series, xlabel) {
  const W = 380, H = 220, L = 48, R = 10, T = 10, B = 34;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  const add = (tag, attrs, text) => {
    const node = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
    return node;
  };
  const points = series.flatMap((s) => s.points.filter((p) => p[1] !== null));
  const wrap = el("div", { class: "chart", "data-chart": title }, el("h3", { text: title }));
  if (!points.length) { wrap.append(el("p", { class: "hint", text: "not logged" })); return wrap; }
  let [x0, x1] = [Math.min(...points.map((p) => p[0])), Math.max(...points.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...points.map((p) => p[1])), Math.max(...points.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  add("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999" });
  add("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#999" });
  for (const y of [y0, (y0 + y1) / 2, y1]) add("text", { x: L - 4, y: py(y) + 4, "text-anchor": "end", "font-size": 10 }, Number(y.toPrecision(3)));
  for (const x of [x0, x1]) add("text", { x: px(x), y: H - B + 14, "text-anchor": "middle", "font-size": 10 }, Number(x.toPrecision(4)));
  add("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", "font-size": 10 }, xlabel);
  series.forEach((s, n) => {
    const color = COLORS[n % COLORS.length];
    const pts = s.points.filter((p) => p[1] !== null);
    if (s.name === "eval" || pts.length < 2) {
      for (const p of pts) add("circle", { cx: px(p[0]), cy: py(p[1]), r: 3, fill: color });
    }
    if (s.name !== "eval" && pts.length >= 2) add("polyline", { fill: "none", stroke: color, "stroke-width": 1.5, points: pts.map((p) => `${px(p[0])},${py(p[1])}`).join(" ") });
    add("text", { x: L + 6, y: T + 12 + 12 * n, fill: color, "font-size": 10 }, s.name);
  });
  wrap.append(svg);
  return wrap;
}

// ---- tabs ---------------------------------------------------------------------------------

function wireTabs() {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => {
      for (const other of document.querySelectorAll(".tab")) other.classList.toggle("active", other === tab);
      for (const pane of document.querySelectorAll(".pane")) pane.hidden = pane.id !== `pane-${tab.dataset.tab}`;
      if (tab.dataset.tab === "compare") loadCompare().catch((e) => showError(e.message));
      if (tab.dataset.tab === "charts") drawCharts();
    });
  }
}

wireTabs(); wireList(); wireCompare(); wireTooltip();
init();
