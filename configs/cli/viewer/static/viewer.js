// toolgym trace viewer: plain JS, no dependencies. Talks to the JSON API of `toolgym view`
// (configs/cli/viewer/server.py). Lists are paged by the server, so a large recording draws its
// first page at once; one episode is fetched when it is picked.
"use strict";

const state = {
  rec: 0, offset: 0, limit: 100, total: 0, sort: "i", desc: false, filters: {},
  shade: "mask", selected: null, cmpOffset: 0, cmpTotal: 0, pair: null, recordings: [], charts: null,
  picked: [], listRequest: 0, compareRequest: 0,
};
const FILTERS = ["env", "stop", "failure", "version", "seed", "rmin", "rmax"];
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
    $("metric-names").replaceChildren(...info.metric_names.map((name) => el("option", { value: name })));
    await applyView(location.hash);
    window.addEventListener("hashchange", () => {
      if (location.hash !== viewHash()) applyView(location.hash).catch((e) => showError(e.message));
    });
  } catch (e) {
    showError(`The viewer could not load: ${e.message}`);
    $("status").textContent = "";
  }
}

async function openRecording(rid, view) {
  // view: the list's filters, sort, page and episode to open with (from a URL); none: a fresh list
  view = view || {};
  state.rec = rid; state.offset = view.offset || 0; state.selected = null; state.filters = view.filters || {};
  state.sort = view.sort || "i"; state.desc = !!view.desc;
  $("recording-select").value = String(rid);
  $("status").textContent = "Reading the recording…";
  const [summary] = await Promise.all([api("recording", { r: rid }), loadPage()]);
  showSummary(summary);
  if (view.ep !== undefined && view.ep !== null) await openEpisode(view.ep);
  saveView();
}

// ---- the view in the URL ------------------------------------------------------------------
// The hash holds what is on screen (tab, recording, filters, sort, page, episode, comparison,
// picked charts), so a link opens the same view; it is rewritten in place on every change.

function activeTab() { return document.querySelector(".tab.active").dataset.tab; }

function viewHash() {
  const p = new URLSearchParams();
  const tab = activeTab();
  if (tab !== "episodes") p.set("tab", tab);
  p.set("r", state.rec);
  for (const k of FILTERS) if (state.filters[k] !== undefined && state.filters[k] !== "") p.set(k, state.filters[k]);
  if (state.sort !== "i") p.set("sort", state.sort);
  if (state.desc) p.set("desc", "1");
  if (state.offset) p.set("offset", state.offset);
  if (state.limit !== 100) p.set("limit", state.limit);
  if (state.selected !== null) p.set("ep", state.selected);
  if (tab === "compare") {
    p.set("a", $("compare-a").value); p.set("b", $("compare-b").value);
    if ($("compare-changed").checked) p.set("changed", "1");
    if (state.cmpOffset) p.set("coffset", state.cmpOffset);
    if (state.pair) p.set("pair", state.pair);
  }
  for (const name of state.picked) p.append("m", name);
  return "#" + p.toString();
}

function saveView() {
  const hash = viewHash();
  if (location.hash !== hash) history.replaceState(null, "", hash);
}

async function applyView(hash) {
  const p = new URLSearchParams((hash || "").replace(/^#/, ""));
  const int = (name, fallback) => { const v = Number.parseInt(p.get(name), 10); return Number.isFinite(v) && v >= 0 ? v : fallback; };
  const rid = Math.min(int("r", 0), state.recordings.length - 1);
  state.limit = Math.min(500, Math.max(1, int("limit", 100))); // rows a page
  const filters = {};
  for (const k of FILTERS) if (p.get(k) !== null) filters[k] = p.get(k);
  state.picked = p.getAll("m").filter((name) => state.charts.metric_names.includes(name));
  await openRecording(rid, { filters, sort: p.get("sort") || "i", desc: p.get("desc") === "1", offset: int("offset", 0), ep: int("ep", null) });
  if (p.get("a") !== null) $("compare-a").value = String(int("a", 0));
  if (p.get("b") !== null) $("compare-b").value = String(int("b", 0));
  $("compare-changed").checked = p.get("changed") === "1";
  state.cmpOffset = int("coffset", 0);
  state.pair = p.get("pair");
  await showTab(["episodes", "compare", "charts"].includes(p.get("tab")) ? p.get("tab") : "episodes");
}

function showSummary(s) {
  const h = s.header;
  const head = h ? `${h.env_id} ${JSON.stringify(h.env_kwargs)} · policy ${h.policy_id || "?"}${s.model ? ` · ${s.model}` : ""} · created ${h.created || "?"} · schema v${h.schema_version}` : "no readable header";
  $("status").textContent = `${s.label}: ${s.episodes} episodes · ${head}` + (s.skipped ? ` · ${s.skipped} ${s.skipped === 1 ? "line" : "lines"} skipped` : "");
  // the advantages are the run's own (its recorded scoring), or unknown: never another config's
  $("scoring").textContent = s.scoring.note + (s.scoring.turn_level ? " (the adv column: the mean of an episode's turns')" : "");
  $("scoring").className = s.scoring.known ? "hint" : "worse";
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
  for (const input of document.querySelectorAll("#filters [data-param]")) input.value = state.filters[input.dataset.param] || "";
  $("filter-rmin").placeholder = fmt(f.reward_min, 2);
  $("filter-rmax").placeholder = fmt(f.reward_max, 2);
}

// ---- the episode list ---------------------------------------------------------------------

async function loadPage() {
  // The newest request wins: two changes in quick succession (a filter's change event as focus
  // leaves it, then the click that caused it) put two requests in flight, whose answers may come
  // back in either order; an older one's answer is dropped, not drawn over the newer list.
  const request = ++state.listRequest;
  const params = { r: state.rec, offset: state.offset, limit: state.limit, sort: state.sort, desc: state.desc ? 1 : 0 };
  for (const [k, v] of Object.entries(state.filters)) if (v !== "") params[k] = v;
  document.body.dataset.listPending = String(Number(document.body.dataset.listPending || 0) + 1);
  let page;
  try {
    page = await api("episodes", params);
  } finally {
    document.body.dataset.listPending = String(Number(document.body.dataset.listPending) - 1);
  }
  if (request !== state.listRequest) return;
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
  state.total = page.total;
  const end = Math.min(page.offset + page.rows.length, page.total);
  $("list-count").textContent = page.total
    ? `${page.offset + 1}–${end} of ${page.total}` + (page.total !== page.all ? ` (filtered from ${page.all})` : "")
    : `no episodes match (of ${page.all})`;
  $("pager-prev").disabled = page.offset === 0;
  $("pager-next").disabled = end >= page.total;
  const pages = Math.max(1, Math.ceil(page.total / state.limit));
  $("pager-page").max = pages;
  $("pager-page").value = Math.floor(page.offset / state.limit) + 1;
  $("pager-pages").textContent = `of ${pages}`;
  for (const th of document.querySelectorAll("#episode-table th[data-sort]")) {
    th.classList.toggle("sorted", th.dataset.sort === state.sort);
    th.classList.toggle("desc", th.dataset.sort === state.sort && state.desc);
  }
  if (window.__firstRender === undefined && page.rows.length) window.__firstRender = performance.now();
  document.body.dataset.listVersion = String(Number(document.body.dataset.listVersion || 0) + 1);
}

const reload = () => loadPage().then(saveView).catch((e) => showError(e.message));

function goToPage(offset) {
  const last = Math.max(0, Math.ceil(state.total / state.limit) - 1) * state.limit;
  state.offset = Math.min(Math.max(0, offset), last);
  return loadPage().then(saveView);
}

function markSelected(tr) {
  for (const other of tr.parentNode.children) other.classList.remove("selected");
  tr.classList.add("selected");
  tr.scrollIntoView({ block: "nearest" });
}

async function openEpisode(i) {
  state.selected = i;
  const tr = document.querySelector(`#episode-table tbody tr[data-i='${i}']`);
  if (tr) markSelected(tr);
  saveView();
  const target = $("episode-detail");
  const ep = await showEpisode(state.rec, i, target);
  if (ep && ep.match.length > 1) await showMatch(state.rec, ep, target);
}

// A game's seats, side by side: every seat of the episode's match recorded beside it, each its
// own transcript (its own conversation, its own tokens).
async function showMatch(rid, ep, target) {
  const request = {};
  latestEpisode.set(target, request);
  const sides = ep.match.map((seat) => {
    const box = el("div", { class: `seat${seat.i === ep.i ? " seat-picked" : ""}`, "data-seat": seat.seat });
    return [box, showEpisode(rid, seat.i, box).then((drawn) => drawn && box.prepend(el("h3", { text: `seat ${seat.seat} (episode ${seat.i}${seat.opponent ? ", the opponent: not trained" : ""})` })))];
  });
  const row = el("div", { class: "sides match" });
  row.append(...sides.map(([box]) => box));
  await Promise.all(sides.map(([, shown]) => shown));
  if (latestEpisode.get(target) !== request) return;
  target.replaceChildren(el("p", { class: "hint", text: `match: task seed ${ep.seed}, sample ${ep.sample}, ${ep.match.length} seats` }), row);
}

function wireList() {
  for (const input of document.querySelectorAll("#filters [data-param]")) {
    input.addEventListener("change", () => { state.filters[input.dataset.param] = input.value; state.offset = 0; reload(); });
  }
  $("filter-clear").addEventListener("click", () => {
    state.filters = {}; state.offset = 0;
    for (const input of document.querySelectorAll("#filters [data-param]")) input.value = "";
    reload();
  });
  $("pager-prev").addEventListener("click", () => goToPage(state.offset - state.limit).catch((e) => showError(e.message)));
  $("pager-next").addEventListener("click", () => goToPage(state.offset + state.limit).catch((e) => showError(e.message)));
  $("pager-page").addEventListener("change", () => {
    const n = Number.parseInt($("pager-page").value, 10);
    if (Number.isFinite(n)) goToPage((n - 1) * state.limit).catch((e) => showError(e.message));
  });
  for (const th of document.querySelectorAll("#episode-table th[data-sort]")) {
    th.addEventListener("click", () => {
      state.desc = state.sort === th.dataset.sort ? !state.desc : th.dataset.sort !== "i";
      state.sort = th.dataset.sort; state.offset = 0;
      reload();
    });
  }
  $("episode-table").tBodies[0].addEventListener("click", (event) => {
    const tr = event.target.closest("tr");
    if (tr) openEpisode(Number(tr.dataset.i)).catch((e) => showError(e.message));
  });
  $("recording-select").addEventListener("change", (e) => openRecording(Number(e.target.value)).catch((err) => showError(err.message)));
}

// ---- the keyboard -------------------------------------------------------------------------
// j / ↓ and k / ↑: the next and previous row (episodes or pairs), across pages; n / → and p / ←:
// the next and previous page; g: the page-number box. Keys typed into a field are the field's.

async function stepRow(delta) {
  const compare = activeTab() === "compare";
  const body = (compare ? $("compare-table") : $("episode-table")).tBodies[0];
  const rows = [...body.rows];
  if (!rows.length) return;
  const at = rows.findIndex((tr) => tr.classList.contains("selected"));
  let next = at < 0 ? (delta > 0 ? 0 : rows.length - 1) : at + delta;
  if (next < 0 || next >= rows.length) { // off this page: the neighbouring page, if there is one
    const moved = await turnPage(compare, delta);
    if (!moved) return;
    const fresh = [...body.rows];
    next = delta > 0 ? 0 : fresh.length - 1;
    return (compare ? openPair : (tr) => openEpisode(Number(tr.dataset.i)))(fresh[next]);
  }
  return compare ? openPair(rows[next]) : openEpisode(Number(rows[next].dataset.i));
}

async function turnPage(compare, delta) {
  if (compare) {
    const offset = state.cmpOffset + 100 * delta;
    if (offset < 0 || offset >= state.cmpTotal) return false;
    state.cmpOffset = offset;
    await loadCompare();
    return true;
  }
  const offset = state.offset + state.limit * delta;
  if (offset < 0 || offset >= state.total) return false;
  await goToPage(offset);
  return true;
}

function wireKeys() {
  document.addEventListener("keydown", (event) => {
    if (event.ctrlKey || event.metaKey || event.altKey || event.target.closest("input, select, textarea")) return;
    if (activeTab() === "charts") return;
    const compare = activeTab() === "compare";
    let action = null;
    if (event.key === "j" || event.key === "ArrowDown") action = () => stepRow(1);
    else if (event.key === "k" || event.key === "ArrowUp") action = () => stepRow(-1);
    else if (event.key === "n" || event.key === "ArrowRight") action = () => turnPage(compare, 1);
    else if (event.key === "p" || event.key === "ArrowLeft") action = () => turnPage(compare, -1);
    else if (event.key === "g" && !compare) action = async () => { $("pager-page").focus(); $("pager-page").select(); };
    if (!action) return;
    event.preventDefault();
    action().catch((e) => showError(e.message));
  });
}

// ---- one episode, token by token ----------------------------------------------------------

const episodes = new WeakMap(); // transcript element -> episode data (for the tooltip)

const latestEpisode = new WeakMap(); // detail element -> the request it should show

// Draws episode i into target; false when a later request for target came first (stale answer).
async function showEpisode(rid, i, target) {
  const request = {};
  latestEpisode.set(target, request);
  target.replaceChildren(el("p", { class: "hint", text: "Loading…" }));
  const ep = await api("episode", { r: rid, i });
  if (latestEpisode.get(target) !== request) return false; // answers can arrive out of order
  const meta = el("div", { class: "meta" });
  meta.append(
    el("div", {}, el("b", { text: `episode ${ep.i}` }), ` (line ${ep.line}) · ${ep.env} ${ep.kwargs} · task seed ${ep.seed} · group ${ep.group} · sample ${ep.sample} · ${ep.sampled_by}`),
    el("div", {}, `stop ${ep.stop} · failure mode ${ep.failure || "–"} · reward `, el("b", { text: signed(ep.reward) }),
      ` (${objText(ep.components)}) · advantage ${ep.scoring.known ? signed(ep.adv, 3) : "unknown"}${ep.trained ? "" : " (not trained on)"} · ${ep.turns} turns · ${ep.tokens} sampled tokens`),
    el("div", {}, `env metrics: ${objText(ep.metrics, false)}`),
  );
  for (const j of ep.judge) { // what a judge said, per criterion: its score, its answer, its prompt
    const value = j.score === null || j.weight === null ? "–" : signed(j.score * j.weight);
    const where = j.position === null || j.position === undefined ? "" : `, shown at position ${j.position + 1}`;
    meta.append(el("details", { class: "judge", "data-criterion": j.criterion },
      el("summary", { text: `judge · ${j.criterion}: score ${j.score} × weight ${j.weight} = ${value}${where}` }),
      el("div", { class: "hint", text: "answer" }), el("pre", { class: "judge-answer", text: j.answer }),
      el("div", { class: "hint", text: "prompt" }), el("pre", { class: "judge-prompt", text: j.prompt })));
  }
  if (ep.error) meta.append(el("div", { class: "worse", text: `error: ${ep.error}` }));
  if (ep.notice) meta.append(el("div", { class: "hint", text: ep.notice }));
  if (!ep.scoring.known) meta.append(el("div", { class: "hint advantages-unknown", text: ep.scoring.note }));
  const transcript = el("div", { class: "transcript", "data-episode": ep.i });
  episodes.set(transcript, ep);
  drawTranscript(transcript, ep);
  state.teacher = Boolean(ep.stream.teacher); // a teacher scored it: its log-ratio is a shade
  if (!state.teacher && state.shade === "teacher") state.shade = "adv";
  target.replaceChildren(meta, shadeSwitch(), legend(), transcript);
  applyShade(transcript, ep);
  return ep;
}

let shadeGroups = 0;
function shadeSwitch() {
  const box = el("div", { class: "shade" }, "shade by:");
  const group = `shade-${(shadeGroups += 1)}`; // one radio group per transcript
  const modes = [["mask", "loss mask"], ["logprob", "sampler logprob"], ["adv", "advantage"]];
  if (state.teacher) modes.push(["teacher", "teacher log-ratio"]); // on-policy distillation's
  for (const [mode, label] of modes) {
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
  if (state.shade === "teacher") box.append(span("teacher less likely", advColor(-1, 1)), span("agrees", advColor(0, 1)), span("teacher more likely", advColor(1, 1)), " (log p_teacher - log p_sampler, sampled tokens)");
  if (state.shade === "adv") box.append(span("advantage < 0", advColor(-1, 1)), span("= 0", advColor(0, 1)), span("> 0", advColor(1, 1)), " (as the run scored it: per turn under turn-level credit; unknown: unshaded)");
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
  const segmentNote = (turn) => {
    const why = turn.context_rewrite ? "the context policy rewrote" : "the chat template re-rendered";
    return el("span", { class: "turn-note segment-start", text: `[a new training sequence: ${why} the history]` });
  };
  const note = (k) => {
    const turn = ep.turn_list[k];
    const parts = [`turn ${k}: reward ${signed(turn.reward)} · advantage ${signed(turn.turn_adv)}`];
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
        frag.append(segmentNote(ep.turn_list[t.turn[k]]));
      }
      const span = el("span", { class: `tok m${t.mask[k]}`, "data-k": k, text });
      if (/^<\|.*\|>$/.test(text)) span.classList.add("special");
      frag.append(span);
      if (k === t.id.length - 1 || t.turn[k + 1] !== t.turn[k]) frag.append(note(t.turn[k]));
    }
  } else { // no token text (another tokenizer): each turn's text as two spans
    ep.turn_list.forEach((turn, k) => {
      if (k > 0 && turn.sequence_start) frag.append(segmentNote(turn));
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
  const scale = t.adv ? Math.max(1e-9, ...t.adv.map(Math.abs)) : 1; // t.adv null: unknown
  const teacherScale = t.teacher ? Math.max(1e-9, ...t.teacher.filter((x) => x !== null).map(Math.abs)) : 1;
  for (const span of box.querySelectorAll(".tok")) {
    const k = span.dataset.k === undefined ? null : Number(span.dataset.k);
    const sampled = span.classList.contains("m1");
    let color = "";
    if (state.shade === "mask") color = maskColor(sampled ? 1 : 0);
    else if (sampled && k !== null && state.shade === "logprob" && t.logprob[k] !== null) color = probColor(Math.exp(t.logprob[k]));
    else if (sampled && k !== null && state.shade === "adv" && t.adv) color = advColor(t.adv[k], scale);
    else if (sampled && k !== null && state.shade === "teacher" && t.teacher && t.teacher[k] !== null) color = advColor(t.teacher[k], teacherScale);
    else if (sampled && k === null && state.shade === "adv" && ep.scoring.known) { // no token text: each turn's
      const a = ep.turn_list[Number(span.dataset.turnAction)].turn_adv;
      color = advColor(a, Math.max(1e-9, ...ep.turn_list.map((x) => Math.abs(x.turn_adv))));
    }
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
      t.mask[k] ? `sampler logprob ${fmt(lp, 4)} (p ${lp === null ? "–" : fmt(Math.exp(lp), 3)}) · advantage ${t.adv ? signed(t.adv[k], 4) : "unknown"}` : "prompt / env token: not trained on",
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
  // The newest request wins, as in loadPage: opening the tab and changing a select put two
  // comparisons in flight; an older one's late answer is dropped, not drawn over the newer one.
  const request = ++state.compareRequest;
  const a = $("compare-a").value, b = $("compare-b").value;
  document.body.dataset.comparePending = String(Number(document.body.dataset.comparePending || 0) + 1);
  let page;
  try {
    page = await api("compare", { a, b, changed: $("compare-changed").checked ? 1 : 0, offset: state.cmpOffset, limit: 100 });
  } finally {
    document.body.dataset.comparePending = String(Number(document.body.dataset.comparePending) - 1);
  }
  if (request !== state.compareRequest) return;
  state.cmpTotal = page.total;
  $("compare-warning").hidden = !page.warning;
  $("compare-warning").textContent = page.warning || "";
  const delta = page.mean_a !== null && page.mean_b !== null ? page.mean_b - page.mean_a : null;
  $("compare-summary").textContent = `${page.a} vs ${page.b}: ${page.common} (task seed, sample) pairs in both (mean reward A ${fmt(page.mean_a)}, B ${fmt(page.mean_b)}, B − A ${signed(delta)}) · only in A ${page.only_a} · only in B ${page.only_b} · rows ${page.total ? page.offset + 1 : 0}–${page.offset + page.rows.length} of ${page.total}`;
  $("compare-table").tBodies[0].replaceChildren(...page.rows.map((row) => {
    const d = row.a && row.b && row.a.reward !== null && row.b.reward !== null ? row.b.reward - row.a.reward : null;
    const cls = d === null || d === 0 ? "" : d > 0 ? "better" : "worse";
    const tr = el("tr", { "data-seed": row.seed, "data-sample": row.sample, "data-a": row.a ? row.a.i : "", "data-b": row.b ? row.b.i : "" },
      el("td", { text: row.seed }), el("td", { text: row.sample }),
      el("td", { text: row.a ? fmt(row.a.reward) : "–" }), stopCell(row.a),
      el("td", { text: row.b ? fmt(row.b.reward) : "–" }), stopCell(row.b),
      el("td", { class: cls, text: signed(d) }));
    if (`${row.seed}.${row.sample}` === state.pair) tr.classList.add("selected");
    return tr;
  }));
  $("compare-prev").disabled = page.offset === 0;
  $("compare-next").disabled = page.offset + page.rows.length >= page.total;
  saveView();
  const picked = $("compare-table").querySelector("tbody tr.selected");
  if (picked && !$("compare-detail").querySelector(".side-a")) await openPair(picked);
}

function stopCell(side) {
  const text = side ? side.stop : "(none)";
  return el("td", { class: "stop", title: text, text });
}

function openPair(tr) {
  markSelected(tr);
  state.pair = `${tr.dataset.seed}.${tr.dataset.sample}`;
  saveView();
  const shown = [];
  const sides = [["a", $("compare-a")], ["b", $("compare-b")]].map(([side, select]) => {
    const box = el("div", { class: `side-${side}` });
    const i = tr.dataset[side];
    const label = select.options[select.selectedIndex].text;
    if (i === "") box.append(el("p", { class: "hint", text: `${label}: no episode for task seed ${tr.dataset.seed}` }));
    else shown.push(showEpisode(Number(select.value), Number(i), box).then((drawn) => drawn && box.prepend(el("h3", { text: `${side.toUpperCase()}: ${label}` }))));
    return box;
  });
  $("compare-detail").replaceChildren(...sides);
  return Promise.all(shown);
}

function wireCompare() {
  for (const id of ["compare-a", "compare-b", "compare-changed"]) {
    $(id).addEventListener("change", () => {
      state.cmpOffset = 0; state.pair = null;
      $("compare-detail").replaceChildren(el("p", { class: "hint", text: "Pick a task seed to see both episodes side by side." }));
      loadCompare().catch((e) => showError(e.message));
    });
  }
  $("compare-prev").addEventListener("click", () => turnPage(true, -1).catch((e) => showError(e.message)));
  $("compare-next").addEventListener("click", () => turnPage(true, 1).catch((e) => showError(e.message)));
  $("compare-table").tBodies[0].addEventListener("click", (event) => {
    const tr = event.target.closest("tr");
    if (tr) openPair(tr).catch((e) => showError(e.message));
  });
}

// ---- charts -------------------------------------------------------------------------------

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const TITLES = { reward: "reward", accuracy: "accuracy", turns: "turns per episode", tokens: "sampled tokens per episode" };

function drawCharts() {
  const info = state.charts;
  $("charts-note").textContent = (info.charts_kind === "run"
    ? "From the run's metrics.jsonl: train batches as lines, held-out evals as markers, against step."
    : "No run metrics given: each recording's mean per policy version.")
    + ` Add any of the ${info.metric_names.length} metrics below; hover a chart for its values.`;
  const box = $("charts");
  const xlabel = info.charts_kind === "run" ? "step" : "policy version";
  box.replaceChildren(...Object.entries(info.charts).map(([name, series]) => chart(TITLES[name] || name, series, xlabel)));
  return Promise.all(state.picked.map((name) => addChart(name, false)));
}

async function addChart(name, save = true) {
  const info = state.charts;
  if (!info.metric_names.includes(name)) { showError(`no metric ${JSON.stringify(name)}: pick one the list offers`); return; }
  if (save && state.picked.includes(name)) return;
  if (save) state.picked.push(name);
  const body = await api("series", { name });
  const wrap = chart(name, body.series, info.charts_kind === "run" ? "step" : "policy version");
  wrap.classList.add("picked");
  const close = el("button", { class: "close", title: "remove this chart", text: "×" });
  close.addEventListener("click", () => { state.picked = state.picked.filter((n) => n !== name); wrap.remove(); saveView(); });
  wrap.querySelector("h3").append(close);
  $("charts").append(wrap);
  saveView();
}

function wireCharts() {
  const pick = $("metric-pick");
  pick.addEventListener("change", () => {
    const name = pick.value.trim();
    pick.value = "";
    if (name) addChart(name).catch((e) => showError(e.message));
  });
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
  // Hover: a guide at the nearest logged x, and each series' value there in the tooltip.
  const xs = [...new Set(points.map((p) => p[0]))].sort((a, b) => a - b);
  const guide = add("line", { x1: 0, y1: T, x2: 0, y2: H - B, stroke: "#333", "stroke-dasharray": "3 3", visibility: "hidden", class: "guide" });
  const tip = $("tooltip");
  svg.addEventListener("mousemove", (event) => {
    const box = svg.getBoundingClientRect();
    const x = x0 + ((event.clientX - box.left - L) / (W - L - R)) * (x1 - x0);
    const near = xs.reduce((best, v) => (Math.abs(v - x) < Math.abs(best - x) ? v : best), xs[0]);
    guide.setAttribute("x1", px(near)); guide.setAttribute("x2", px(near)); guide.setAttribute("visibility", "visible");
    const lines = series.map((s) => {
      const hit = s.points.find((p) => p[0] === near);
      return hit ? `${s.name}: ${hit[1] === null ? "–" : Number(hit[1].toPrecision(6))}` : null;
    }).filter((line) => line !== null);
    tip.textContent = [`${title}`, `${xlabel} ${near}`, ...lines].join("\n");
    tip.hidden = false;
    tip.style.left = `${event.clientX + 14}px`; tip.style.top = `${event.clientY + 14}px`;
  });
  svg.addEventListener("mouseleave", () => { guide.setAttribute("visibility", "hidden"); tip.hidden = true; });
  wrap.append(svg);
  return wrap;
}

// ---- tabs ---------------------------------------------------------------------------------

async function showTab(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.tab === name);
  for (const pane of document.querySelectorAll(".pane")) pane.hidden = pane.id !== `pane-${name}`;
  saveView();
  if (name === "compare") await loadCompare();
  if (name === "charts") await drawCharts();
}

function wireTabs() {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => showTab(tab.dataset.tab).catch((e) => showError(e.message)));
  }
}

wireTabs(); wireList(); wireCompare(); wireCharts(); wireTooltip(); wireKeys();
init();
