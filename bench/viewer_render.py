"""Time to first render of `toolgym view` on a 10,000-episode recording in headless Chromium
(target: under 2 s).

The recording is made here by the oracle on Zorplex (multi_step tier, some malformed calls and
untagged answers, groups of 4), unless --recording names one. Measured, each in a fresh browser
context (no cache) against the viewer's server (configs/cli/viewer/server.py):
- cold: a new server, so the first request also indexes the file (what a page opened at once
  after starting the server pays);
- warm: the index built (what `toolgym view` does before it prints the URL);
- episode: from clicking the first row to its token-shaded transcript drawn.
"First render" is from `page.goto` until the page has drawn its first rows (`window.__firstRender`
is set by viewer.js right after the first page of rows is in the DOM). The peer in the same run
is reading the whole file with `read_recording` (every Trajectory decoded and kept, as a viewer
that loads everything would start).

    python bench/viewer_render.py                     # records 10,000 episodes first (~30 s)
    python bench/viewer_render.py --recording runs/x.jsonl --repeats 7
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 2.0


def record(path: Path, episodes: int) -> None:
    from toolgym.configs.cli.main import main

    tasks = episodes // 4
    code = main(
        [
            "record", "--env", "toolgym/Zorplex-v0", "--env-kwargs", '{"tier": "multi_step"}',
            "--policy", "oracle", "--tasks", str(tasks), "--group-size", "4", "--out", str(path),
            "--p-omit-tag", "0.3", "--p-malformed-call", "0.2", "--no-progress",
        ]
    )  # fmt: skip
    if code:
        sys.exit(f"toolgym record failed ({code})")


def first_render(browser, url: str) -> float:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    start = time.perf_counter()
    page.goto(url)
    page.wait_for_function("window.__firstRender !== undefined", polling=10)
    elapsed = time.perf_counter() - start
    context.close()
    return elapsed


def open_episode(browser, url: str) -> float:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.goto(url)
    page.wait_for_selector("#episode-table tbody tr")
    start = time.perf_counter()
    page.click("#episode-table tbody tr")
    page.wait_for_selector("#episode-detail .transcript .tok")
    elapsed = time.perf_counter() - start
    context.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=10_000)
    parser.add_argument("--recording", default=None, help="use this recording instead of recording one")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = parser.parse_args()
    if not args.chromium:
        sys.exit("no chromium on PATH (apt-get install -y chromium), or pass --chromium")

    from playwright.sync_api import sync_playwright

    from toolgym.agents.chat import ChatRenderer
    from toolgym.agents.tokenizer import load_tokenizer
    from toolgym.configs.cli.main import DEFAULT_TOKENIZER
    from toolgym.configs.cli.viewer.index import RecordingIndex
    from toolgym.configs.cli.viewer.server import ViewerData, ViewerServer
    from toolgym.rollouts.recording.format import read_recording

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.recording) if args.recording else Path(tmp) / "episodes.jsonl"
        if args.recording is None:
            started = time.perf_counter()
            record(path, args.episodes)
            print(f"recorded in {time.perf_counter() - started:.1f} s")
        renderer = ChatRenderer(load_tokenizer(DEFAULT_TOKENIZER))
        size = path.stat().st_size
        start = time.perf_counter()
        _, trajectories = read_recording(path)
        read_s = time.perf_counter() - start
        count = len(trajectories)
        del trajectories
        index_s = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            RecordingIndex(path)
            index_s.append(time.perf_counter() - start)

        cold, warm, episode = [], [], []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
            for _ in range(args.repeats):
                with ViewerServer(ViewerData([path], renderer)) as server:
                    cold.append(first_render(browser, server.url))
            with ViewerServer(ViewerData([path], renderer)) as server:
                first_render(browser, server.url)  # builds the index
                for _ in range(args.repeats):
                    warm.append(first_render(browser, server.url))
                    episode.append(open_episode(browser, server.url))
            version = browser.version
            browser.close()

    print(
        f"recording: {count:,} episodes, {size / 2**20:.1f} MiB; headless Chromium {version}; "
        f"{args.repeats} repeats, median (min)"
    )
    rows = [
        ("read_recording (peer: decode all)", [read_s]),
        ("RecordingIndex (rows + spans)", index_s),
        ("first render, cold (index on 1st request)", cold),
        ("first render, warm (index built)", warm),
        ("open one episode (click -> tokens)", episode),
    ]
    for name, values in rows:
        print(f"  {name:<44} {statistics.median(values):7.3f} s  ({min(values):.3f})")
    print(f"cold first render / target {TARGET_S:.0f} s = {statistics.median(cold) / TARGET_S:.2f}x (target <= 1.00x)")
    print(f"warm first render / target {TARGET_S:.0f} s = {statistics.median(warm) / TARGET_S:.2f}x")
    print(f"index / read_recording = {statistics.median(index_s) / read_s:.2f}x")


if __name__ == "__main__":
    main()
