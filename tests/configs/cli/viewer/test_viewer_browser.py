"""`toolgym view` in a real browser: headless Chromium (the system's `chromium`, never a
downloaded one) driven by Playwright. The page loads, filters change the list, token shading
matches the recording's loss masks, the comparison aligns episodes by task seed, a damaged file
shows what it skipped, and the run charts draw.

Skipped when Playwright or Chromium is missing, unless TOOLGYM_REQUIRE_BROWSER is set (CI sets
it, so a missing browser fails loudly there)."""

from __future__ import annotations

import os
import shutil

import pytest
from recording_testlib import play, shipped_renderer, write

from toolgym.configs.cli.viewer.index import RecordingIndex
from toolgym.configs.cli.viewer.server import ViewerData, ViewerServer
from toolgym.rollouts.episodes import trajectory_to_episodes
from toolgym.rollouts.recording.format import read_recording
from toolgym.rollouts.scripted import OracleConfig

ZORPLEX = "toolgym/Zorplex-v0"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


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
        launched = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
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
    return a, b, damaged


@pytest.fixture(scope="module")
def server(recordings):
    with ViewerServer(ViewerData(list(recordings), shipped_renderer())) as running:
        yield running


@pytest.fixture
def page(server, browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.goto(server.url)
    tab.wait_for_selector("#episode-table tbody tr")
    yield tab
    context.close()
    assert not errors, errors


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


def test_token_shading_matches_the_recording_masks(page, recordings):
    _, trajectories = read_recording(recordings[0])
    index = RecordingIndex(recordings[0])
    i = 3
    (episode,) = trajectory_to_episodes(trajectories[i], index.rows[i]["adv"])
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

    first = sampled[0]
    page.hover(f"#episode-detail .tok[data-k='{first}']")
    tip = page.text_content("#tooltip")
    assert "loss mask 1" in tip and f"{episode.sampler_logprobs[first]:.4f}" in tip


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
