"""`toolgym view` in a real browser: headless Chromium (the system's `chromium`, never a
downloaded one) driven by Playwright. The page loads, filters change the list, token shading
matches the recording's loss masks, the comparison aligns episodes by task seed, a damaged file
shows what it skipped, and the run charts draw.

Skipped when Playwright or Chromium is missing, unless TOOLGYM_REQUIRE_BROWSER is set (CI sets
it, so a missing browser fails loudly there)."""

from __future__ import annotations

import asyncio
import os
import shutil

import msgspec
import pytest
from judge_testlib import judge_server
from recording_testlib import play, shipped_renderer, write

from toolgym.agents.tokenizer import tokenizer_fingerprint
from toolgym.configs.cli.viewer.index import RecordingIndex
from toolgym.configs.cli.viewer.server import ViewerData, ViewerServer
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.match import BotPolicy, MatchRunner
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.episodes import trajectory_to_episodes
from toolgym.rollouts.recording.chat_jsonl import export_chat_jsonl
from toolgym.rollouts.recording.format import (
    SCORING,
    RecordingHeader,
    RecordingWriter,
    read_recording,
    scoring_entry,
)
from toolgym.rollouts.scoring.advantages import AdvantageConfig, AdvantageEstimator, Credit
from toolgym.rollouts.scoring.judge import Judge, JudgeConfig, JudgeCriterion
from toolgym.rollouts.scripted import OracleConfig
from toolgym.rollouts.types import StopReason

ZORPLEX = "toolgym/Zorplex-v0"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# How long a wait (an element, a page function, a navigation) may take before it fails: every
# wait is for the condition the test needs, and this bound only ends a test whose condition never
# comes. Playwright's 30 s default is a budget two busy cores can exhaust; this one they cannot.
PATIENCE_MS = 300_000


def _missing(what: str) -> None:
    if os.environ.get("TOOLGYM_REQUIRE_BROWSER"):
        pytest.fail(f"TOOLGYM_REQUIRE_BROWSER is set but {what}")
    pytest.skip(f"{what} (install it, e.g. `apt-get install -y chromium`; CI sets TOOLGYM_REQUIRE_BROWSER)")


@pytest.fixture(scope="module")
def browser(recordings):  # recordings first: Playwright's sync API holds an event loop (asyncio.run fails)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is not installed (pip install -e '.[dev]')")
    if CHROMIUM is None:
        _missing("no chromium executable on PATH")
    with sync_playwright() as p:
        launched = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"], timeout=PATIENCE_MS
        )
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    folder = tmp_path_factory.mktemp("viewer")
    a = write(folder / "eval_a.jsonl", play(ZORPLEX, list(range(6)), group_size=2), ZORPLEX)
    later = play(ZORPLEX, list(range(3, 9)), group_size=2, oracle=OracleConfig(p_omit_tag=0.0), policy_version=4)
    b = write(folder / "eval_b.jsonl", later, ZORPLEX)
    lines = a.read_bytes().splitlines(keepends=True)
    damaged = folder / "damaged.jsonl"
    damaged.write_bytes(b"".join([*lines[:2], lines[2].replace(b'"group_id":', b'"group_id":7', 1), *lines[3:]]))
    # the widest stop reasons in every row: what a compare table must fit at 1280 px
    stops = [StopReason.CONTEXT_OVERFLOW, StopReason.NO_TOOL_CALL]
    long_stops = write(
        folder / "eval_long_stops.jsonl",
        [msgspec.structs.replace(t, stop_reason=stops[k % 2]) for k, t in enumerate(later)],
        ZORPLEX,
    )
    other_env = write(folder / "simple_tier.jsonl", play(ZORPLEX, [0, 1], env_kwargs={"tier": "simple"}), ZORPLEX)
    chat = folder / "chat.jsonl"
    with chat.open("w") as out:
        export_chat_jsonl(a, out)
    # a run's recording: its header records how the run scored (turn-level credit)
    run = folder / "train_rank0.jsonl"
    config = AdvantageConfig(estimator=AdvantageEstimator.DR_GRPO, credit=Credit.TURN_STATE)
    header = RecordingHeader(
        tokenizer_fingerprint=tokenizer_fingerprint(shipped_renderer().tokenizer),
        env_id=ZORPLEX,
        env_kwargs={"tier": "recursive"},
        extra={SCORING: scoring_entry(config, {"name": "grpo"}, train_on_infra_failures=False)},
    )
    with RecordingWriter(run, header) as writer:
        oracle = OracleConfig(p_omit_tag=0.5, p_malformed_call=0.3)  # turns that differ in value
        episodes = play(ZORPLEX, list(range(4)), group_size=3, env_kwargs={"tier": "recursive"}, oracle=oracle)
        writer.write_all(episodes)
    # a game's seats: two Nim matches between random players, both seats recorded
    nim = "toolgym/Nim-v0"
    renderer = shipped_renderer()
    config = EnvRolloutConfig(env_id=nim, group_size=2, max_turns=16, max_tokens_per_turn=8)
    seats = MatchRunner(RolloutRunner(BotPolicy(renderer, "random"), renderer, config), learn="all")
    match = write(folder / "match.jsonl", asyncio.run(seats.run_groups([3])), nim)
    # judged episodes: what the judge said is kept with each
    judged = play(ZORPLEX, [0, 1], group_size=2)
    criteria = [JudgeCriterion(name="polite", prompt="The transcript contains 'zorplex'.", weight=0.5)]
    with judge_server() as judge_at:
        judge = Judge(JudgeConfig(url=judge_at.url, criteria=criteria))
        for group in (judged[:2], judged[2:]):
            assert judge.annotate(group)[0] is None
    judged_path = write(folder / "judged.jsonl", judged, ZORPLEX)
    return a, b, damaged, long_stops, other_env, chat, run, match, judged_path


@pytest.fixture(scope="module")
def server(recordings):
    with ViewerServer(ViewerData(list(recordings), shipped_renderer())) as running:
        yield running


@pytest.fixture
def open_page(server, browser):
    """Opens the viewer (at `hash`, `width` px wide) in a fresh browser context; fails the test on
    any script error on the page."""
    opened: list[tuple] = []

    def open_at(hash: str = "", width: int = 1280):
        context = browser.new_context(viewport={"width": width, "height": 900})
        context.set_default_timeout(PATIENCE_MS)  # every wait and action: for its condition, not 30 s
        tab = context.new_page()
        errors: list[str] = []
        tab.on("pageerror", lambda exc: errors.append(str(exc)))
        opened.append((context, errors))
        tab.goto(server.url + hash)
        tab.wait_for_selector("#episode-table tbody tr", state="attached")  # the list's pane may be hidden
        return tab

    yield open_at
    for context, errors in opened:
        context.close()
        assert not errors, errors


@pytest.fixture
def page(open_page):
    return open_page()


def _rows(page) -> list[dict]:
    return page.eval_on_selector_all(
        "#episode-table tbody tr",
        "rows => rows.map(r => ({i: +r.dataset.i, seed: +r.dataset.seed, cells: [...r.cells].map(c => c.textContent)}))",
    )


def _wait_list_change(page, before: str) -> None:
    page.wait_for_function("v => document.body.dataset.listVersion !== v", arg=before)


def test_page_loads_with_the_first_page_of_episodes(page, recordings):
    rows = _rows(page)
    assert [r["i"] for r in rows] == list(range(12))
    assert "eval_a.jsonl: 12 episodes" in page.text_content("#status")
    assert page.is_hidden("#problems") and page.is_hidden("#error")
    assert page.text_content("#list-count").startswith("1–12 of 12")


def test_filters_and_sorting_change_the_list(page, recordings):
    index = RecordingIndex(recordings[0])
    failure = sorted({r["failure"] for r in index.rows})[-1]
    expected = [r["i"] for r in index.rows if r["failure"] == failure]
    assert 0 < len(expected) < 12
    version = page.get_attribute("body", "data-list-version")
    page.select_option("#filter-failure", failure)
    _wait_list_change(page, version)
    rows = _rows(page)
    assert [r["i"] for r in rows] == expected and all(r["cells"][4] == failure for r in rows)
    assert f"of {len(expected)} (filtered from 12)" in page.text_content("#list-count")

    version = page.get_attribute("body", "data-list-version")
    page.fill("#filter-seed", "4")
    page.dispatch_event("#filter-seed", "change")
    _wait_list_change(page, version)
    assert {r["seed"] for r in _rows(page)} <= {4}

    version = page.get_attribute("body", "data-list-version")
    page.click("#filter-clear")
    _wait_list_change(page, version)
    version = page.get_attribute("body", "data-list-version")
    page.click("#episode-table th[data-sort=reward]")
    _wait_list_change(page, version)
    rewards = [float(r["cells"][5]) for r in _rows(page)]
    assert len(rewards) == 12 and rewards == sorted(rewards, reverse=True)


def test_a_late_answer_for_an_older_filter_does_not_replace_the_newer_list(page):
    """Two list requests in flight (a filter, then clearing it) whose answers come back in the
    other order: the older answer is dropped, so the list shows what the controls now say."""
    held = []
    page.route(lambda url: "/api/episodes" in url and "seed=4" in url, lambda route: held.append(route))
    page.fill("#filter-seed", "4")
    page.dispatch_event("#filter-seed", "change")
    page.wait_for_function("document.body.dataset.listPending === '1'")
    version = page.get_attribute("body", "data-list-version")
    page.click("#filter-clear")  # focus leaves the seed box too: its change may fire once more (held as well)
    _wait_list_change(page, version)
    assert len(_rows(page)) == 12 and held
    for route in held:
        route.continue_()
    page.wait_for_function("document.body.dataset.listPending === '0'")
    assert len(_rows(page)) == 12
    assert page.input_value("#filter-seed") == "" and page.text_content("#list-count").startswith("1–12 of 12")


def test_token_shading_matches_the_recording_masks(page, recordings):
    _, trajectories = read_recording(recordings[0])
    i = 3
    (episode,) = trajectory_to_episodes(trajectories[i], 0.0)
    page.click(f"#episode-table tbody tr[data-i='{i}']")
    page.wait_for_selector("#episode-detail .transcript .tok")
    spans = page.eval_on_selector_all(
        "#episode-detail .tok[data-k]",
        "s => s.map(e => ({k: +e.dataset.k, m1: e.classList.contains('m1'), bg: e.style.background, text: e.textContent}))",
    )
    assert [s["k"] for s in spans] == list(range(len(episode.tokens)))
    assert [int(s["m1"]) for s in spans] == episode.loss_mask
    assert "".join(s["text"] for s in spans) == shipped_renderer().decode(episode.tokens)
    assert all(bool(s["bg"]) == s["m1"] for s in spans)  # mask mode: only sampled tokens shaded
    notes = page.eval_on_selector_all("#episode-detail .turn-note", "n => n.map(e => e.textContent)")
    assert len(notes) == len(trajectories[i].transitions) and notes[-1].startswith("[turn 1: reward")

    page.check("#episode-detail .shade-logprob")
    page.wait_for_selector("#episode-detail .transcript[data-shade=logprob]")
    shaded = page.eval_on_selector_all("#episode-detail .tok[data-k]", "s => s.map(e => e.style.background)")
    sampled = [k for k, m in enumerate(episode.loss_mask) if m]
    assert all(shaded[k] == "" for k, m in enumerate(episode.loss_mask) if not m)
    assert len({shaded[k] for k in sampled}) > 1  # colours follow the (varied) sampler logprobs

    # an oracle recording records no scoring: the page says so and shades no advantage
    assert "advantages unknown" in page.text_content("#scoring")
    assert "advantages unknown" in page.text_content("#episode-detail .advantages-unknown")
    page.check("#episode-detail .shade-adv")
    page.wait_for_selector("#episode-detail .transcript[data-shade=adv]")
    shaded = page.eval_on_selector_all("#episode-detail .tok[data-k]", "s => s.map(e => e.style.background)")
    assert all(shade == "" for shade in shaded)

    first = sampled[0]
    page.hover(f"#episode-detail .tok[data-k='{first}']")
    tip = page.text_content("#tooltip")
    assert "loss mask 1" in tip and f"{episode.sampler_logprobs[first]:.4f}" in tip
    assert "advantage unknown" in tip


def test_a_run_recording_shades_the_advantages_the_run_used(open_page, recordings):
    index = RecordingIndex(recordings[6])
    i = next(k for k, r in enumerate(index.rows) if r["turns"] > 1 and len(set(r["turn_adv"])) > 1)
    page = open_page(f"#r=6&ep={i}")
    page.wait_for_selector("#episode-detail .transcript .tok")
    assert "credit turn_state" in page.text_content("#scoring")
    assert page.query_selector("#episode-detail .advantages-unknown") is None
    page.check("#episode-detail .shade-adv")
    page.wait_for_selector("#episode-detail .transcript[data-shade=adv]")
    shaded = page.eval_on_selector_all("#episode-detail .tok[data-k]", "s => s.map(e => e.style.background)")
    stream = index.episode(i, shipped_renderer())["stream"]
    sampled = [k for k, m in enumerate(stream["mask"]) if m]
    assert all(shaded[k] == "" for k, m in enumerate(stream["mask"]) if not m)
    # each turn's own advantage: tokens of turns with different advantages get different colours
    by_value = {}
    for k in sampled:
        by_value.setdefault(stream["adv"][k], set()).add(shaded[k])
    assert len(by_value) > 1 and all(len(colours) == 1 for colours in by_value.values())
    assert len({c for colours in by_value.values() for c in colours}) == len(by_value)
    notes = page.eval_on_selector_all("#episode-detail .turn-note", "n => n.map(e => e.textContent)")
    assert f"advantage {index.rows[i]['turn_adv'][0]:+.3f}" in notes[0]


def test_comparison_aligns_episodes_by_task_seed(page, recordings):
    page.click("#tab-compare")
    page.select_option("#compare-a", "0")
    page.select_option("#compare-b", "1")
    page.wait_for_function("document.querySelector('#compare-summary').textContent.includes('eval_b')")
    page.wait_for_selector("#compare-table tbody tr")
    summary = page.text_content("#compare-summary")
    assert "6 (task seed, sample) pairs in both" in summary and "only in A 6" in summary
    rows = page.eval_on_selector_all(
        "#compare-table tbody tr", "rows => rows.map(r => ({seed: +r.dataset.seed, a: r.dataset.a, b: r.dataset.b}))"
    )
    a_rows, b_rows = RecordingIndex(recordings[0]).rows, RecordingIndex(recordings[1]).rows
    assert sorted({r["seed"] for r in rows}) == list(range(9))
    for row in rows:
        if row["a"]:
            assert a_rows[int(row["a"])]["seed"] == row["seed"]
        if row["b"]:
            assert b_rows[int(row["b"])]["seed"] == row["seed"]
        assert bool(row["a"]) == (row["seed"] < 6) and bool(row["b"]) == (row["seed"] >= 3)
    page.click("#compare-table tbody tr[data-seed='4']")
    page.wait_for_selector("#compare-detail .side-a .transcript")
    page.wait_for_selector("#compare-detail .side-b .transcript")
    assert "task seed 4" in page.text_content("#compare-detail .side-a .meta")
    assert "task seed 4" in page.text_content("#compare-detail .side-b .meta")
    assert "policy v4" in page.text_content("#compare-detail .side-b .meta")


def test_a_late_answer_for_an_older_comparison_does_not_replace_the_newer_one(page):
    """Opening the tab asks for A 0 vs B 3 (the default B, the last eval); picking B 1 asks again.
    The first answer held until the second is drawn, then let through: it is dropped, so the
    table shows what the selects now say (the two in flight made the alignment test time out
    under load, waiting for a summary that an older answer had overwritten)."""
    held = []
    page.route(lambda url: "/api/compare" in url and "b=3" in url, lambda route: held.append(route))
    page.click("#tab-compare")
    page.select_option("#compare-b", "1")
    page.wait_for_function("document.querySelector('#compare-summary').textContent.includes('eval_b')")
    assert held
    for route in held:
        route.continue_()
    page.wait_for_function("document.body.dataset.comparePending === '0'")
    assert "eval_a.jsonl vs eval_b.jsonl" in page.text_content("#compare-summary")
    assert "context_overflow" not in page.text_content("#compare-table tbody")


def test_a_damaged_file_shows_what_it_read_and_what_it_skipped(page):
    version = page.get_attribute("body", "data-list-version")
    page.select_option("#recording-select", "2")
    _wait_list_change(page, version)
    page.wait_for_selector("#problems:not([hidden])")
    assert "line 3 is corrupt" in page.text_content("#problems")
    assert len(_rows(page)) == 11 and "1 line skipped" in page.text_content("#status")


def test_charts_draw(page):
    page.click("#tab-charts")
    page.wait_for_selector("#charts .chart svg")
    titles = page.eval_on_selector_all("#charts .chart h3", "h => h.map(e => e.textContent)")
    assert titles == ["reward", "accuracy", "turns per episode", "sampled tokens per episode"]
    assert page.eval_on_selector_all("#charts .chart:first-child circle", "c => c.length") >= 3


# ---- layout, links, keys, charts, warnings (at 1280 px, the narrowest common laptop screen) -------


@pytest.mark.parametrize("width", [1280, 1440])
def test_tables_stay_inside_their_column(open_page, width):
    page = open_page("#tab=compare&a=0&b=3", width)
    page.wait_for_selector("#compare-table tbody tr td.stop")
    assert "context_overflow" in page.text_content("#compare-table tbody")
    for table, column in (("#compare-table", ".compare-list"), ("#episode-table", "#pane-episodes .list")):
        if table == "#episode-table":
            page.click("#tab-episodes")
        box = page.eval_on_selector(
            column,
            "(c, t) => { const r = c.getBoundingClientRect(), tr = document.querySelector(t).getBoundingClientRect();"
            " return {right: r.right, table: tr.right, scroll: c.scrollWidth, client: c.clientWidth,"
            " detail: c.nextElementSibling.getBoundingClientRect().left}; }",
            table,
        )
        assert box["table"] <= box["right"] + 0.5 and box["right"] <= box["detail"], (table, box)
        assert box["scroll"] <= box["client"], (table, box)  # fits: no scroll bar needed


def test_the_url_holds_the_view(open_page, recordings):
    page = open_page()
    index = RecordingIndex(recordings[0])
    failure = sorted({r["failure"] for r in index.rows})[-1]
    expected = [r["i"] for r in index.rows if r["failure"] == failure]
    version = page.get_attribute("body", "data-list-version")
    page.select_option("#filter-failure", failure)
    _wait_list_change(page, version)
    page.click(f"#episode-table tbody tr[data-i='{expected[-1]}']")
    page.wait_for_selector("#episode-detail .transcript")
    page.wait_for_function("location.hash.includes('ep=')")
    link = page.evaluate("location.hash")
    assert f"failure={failure}" in link and f"ep={expected[-1]}" in link

    fresh = open_page(link)  # the link opens the same filtered list and episode
    fresh.wait_for_selector("#episode-detail .transcript")
    assert [r["i"] for r in _rows(fresh)] == expected
    assert fresh.input_value("#filter-failure") == failure
    assert f"episode {expected[-1]} " in fresh.text_content("#episode-detail .meta")
    assert fresh.get_attribute("#episode-table tbody tr.selected", "data-i") == str(expected[-1])

    pair = open_page("#tab=compare&a=0&b=1&pair=4.0")  # a comparison, with a pair open
    pair.wait_for_selector("#compare-detail .side-b .transcript")
    assert pair.is_visible("#pane-compare") and pair.input_value("#compare-b") == "1"
    assert "task seed 4" in pair.text_content("#compare-detail .side-a .meta")


def test_a_late_answer_for_an_earlier_episode_does_not_replace_the_later_one(open_page):
    page = open_page("#limit=5")
    # the answer for episode 0 is asked for only once episode 1 is shown, so it arrives after
    # the one for episode 1; window.lateAnswerHandled is set once the page has taken it in
    page.evaluate(
        """() => {
             const plain = window.fetch;
             const shown = () => document.querySelector('#episode-detail .meta')?.textContent.includes('episode 1 ');
             const afterShown = () => new Promise((done) => { const poll = () => (shown() ? done() : setTimeout(poll, 10)); poll(); });
             window.lateAnswerHandled = false;
             window.fetch = (url, options) => /episode\\?.*i=0(&|$)/.test(String(url))
               ? afterShown().then(() => plain(url, options)).then((response) => {
                   const json = response.json.bind(response);
                   // after the body's readers have run: a timer comes after their microtasks
                   response.json = () => json().then((body) => { setTimeout(() => { window.lateAnswerHandled = true; }); return body; });
                   return response;
                 })
               : plain(url, options);
           }"""
    )
    page.keyboard.press("j")
    page.keyboard.press("j")
    page.wait_for_function("window.lateAnswerHandled === true")
    assert "episode 1 " in page.text_content("#episode-detail .meta")
    assert page.locator("#episode-detail .meta").count() == 1


def test_keys_walk_episodes_and_pages(open_page):
    page = open_page("#limit=5")
    assert page.text_content("#pager-pages") == "of 3" and len(_rows(page)) == 5
    page.keyboard.press("j")
    page.wait_for_selector("#episode-table tbody tr.selected[data-i='0']")
    page.keyboard.press("j")
    page.wait_for_selector("#episode-table tbody tr.selected[data-i='1']")
    page.wait_for_function("document.querySelector('#episode-detail .meta')?.textContent.includes('episode 1 ')")
    page.keyboard.press("k")
    page.wait_for_selector("#episode-table tbody tr.selected[data-i='0']")
    for _ in range(5):  # off the end of page 1: the first row of page 2
        page.keyboard.press("ArrowDown")
    page.wait_for_selector("#episode-table tbody tr.selected[data-i='5']")
    assert page.input_value("#pager-page") == "2"
    version = page.get_attribute("body", "data-list-version")
    page.keyboard.press("n")
    _wait_list_change(page, version)
    assert [r["i"] for r in _rows(page)] == [10, 11]
    version = page.get_attribute("body", "data-list-version")
    page.keyboard.press("g")  # the page box: type a page, Enter
    page.keyboard.type("1")
    page.keyboard.press("Enter")
    _wait_list_change(page, version)
    assert [r["i"] for r in _rows(page)] == [0, 1, 2, 3, 4]
    assert "offset" not in page.evaluate("location.hash")


def test_any_metric_can_be_charted_with_values_on_hover(open_page, server, recordings):
    page = open_page("#tab=charts")
    page.wait_for_selector("#charts .chart svg")
    names = page.eval_on_selector_all("#metric-names option", "o => o.map(e => e.value)")
    assert "metrics/accuracy" in names and len(names) == len(server.httpd.RequestHandlerClass.data.recordings()["metric_names"])
    page.fill("#metric-pick", "metrics/accuracy")
    page.dispatch_event("#metric-pick", "change")
    chart = "#charts .chart.picked[data-chart='metrics/accuracy'] svg"
    page.wait_for_selector(chart)
    assert "m=metrics%2Faccuracy" in page.evaluate("location.hash")
    rows = RecordingIndex(recordings[1]).rows  # eval_b: one policy version, 4
    box = page.eval_on_selector(chart, "s => { const r = s.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; }")
    page.mouse.move(box[0] + box[2] - 12, box[1] + box[3] / 2)  # the right end: the last version
    assert page.is_visible("#tooltip")
    title, x, *values = page.text_content("#tooltip").split("\n")
    assert (title, x) == ("metrics/accuracy", "policy version 4")
    shown = dict(line.split(": ") for line in values)
    mean = sum(r["metrics"]["accuracy"] for r in rows) / len(rows)
    assert set(shown) == {"eval_b.jsonl", "eval_long_stops.jsonl"} and float(shown["eval_b.jsonl"]) == pytest.approx(mean)


def test_comparing_different_envs_warns(open_page):
    page = open_page("#tab=compare&a=0&b=4")
    page.wait_for_selector("#compare-warning:not([hidden])")
    assert "hold different envs" in page.text_content("#compare-warning")
    page.select_option("#compare-b", "1")
    page.wait_for_selector("#compare-warning[hidden]", state="attached")


def test_a_chat_jsonl_is_shown_with_the_import_command(page, recordings):
    version = page.get_attribute("body", "data-list-version")
    page.select_option("#recording-select", "5")
    _wait_list_change(page, version)
    page.wait_for_selector("#problems:not([hidden])")
    assert f"toolgym import {recordings[5]}" in page.text_content("#problems")


def test_a_matchs_seats_are_shown_side_by_side(page, recordings):
    index = RecordingIndex(recordings[7])
    first = next(r for r in index.rows if r["seat"] == "first")
    partner = next(r for r in index.rows if r["seat"] == "second" and r["sample"] == first["sample"])
    assert [m["i"] for m in index.episode(first["i"], None)["match"]] == [first["i"], partner["i"]]
    version = page.get_attribute("body", "data-list-version")
    page.select_option("#recording-select", "7")
    _wait_list_change(page, version)
    page.click(f"#episode-table tbody tr[data-i='{partner['i']}']")
    page.wait_for_selector("#episode-detail .match .seat[data-seat='first'] .transcript")
    page.wait_for_selector("#episode-detail .match .seat[data-seat='second'] .transcript")
    heads = page.eval_on_selector_all("#episode-detail .match .seat > h3", "h => h.map(e => e.textContent)")
    assert heads == [f"seat first (episode {first['i']})", f"seat second (episode {partner['i']})"]
    assert page.get_attribute("#episode-detail .seat-picked", "data-seat") == "second"
    # each side is its own seat's conversation: the second seat is told the first seat's move
    _, trajectories = read_recording(recordings[7])
    move = trajectories[first["i"]].transitions[0].action.text
    second_text = page.text_content("#episode-detail .seat[data-seat='second'] .transcript")
    assert f"Opponent took {move}." in second_text


def test_a_judged_episode_shows_the_judges_answer_per_criterion(page, recordings):
    _, trajectories = read_recording(recordings[8])
    said = trajectories[1].transitions[-1].info["judge"]["polite"]
    version = page.get_attribute("body", "data-list-version")
    page.select_option("#recording-select", "8")
    _wait_list_change(page, version)
    page.click("#episode-table tbody tr[data-i='1']")
    page.wait_for_selector("#episode-detail details.judge[data-criterion='polite']")
    summary = page.text_content("#episode-detail details.judge summary")
    assert summary.startswith(f"judge · polite: score {said['score']:g} × weight 0.5 = {0.5 * said['score']:+.3f}")
    page.click("#episode-detail details.judge summary")
    assert page.text_content("#episode-detail .judge-answer") == said["answer"]
    assert page.text_content("#episode-detail .judge-prompt") == said["prompt"]
