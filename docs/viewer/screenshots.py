"""The README's screenshots of `toolgym view`, taken in headless Chromium with Playwright.

    python docs/viewer/screenshots.py runs/zorplex_tiny-20261126-080850   # a `toolgym train` run

Writes docs/viewer/episodes.png (the list and one transcript shaded by sampler logprob, a
token's details on hover), compare.png (the step-0 eval against the last eval, pairs whose reward
changed, side by side) and charts.png (the run's summary charts). Uses the system's `chromium`.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(run_dir: str) -> None:
    from playwright.sync_api import sync_playwright

    from toolgym.agents.chat import ChatRenderer
    from toolgym.agents.tokenizer import load_tokenizer
    from toolgym.configs.cli.main import DEFAULT_TOKENIZER
    from toolgym.configs.cli.view import view_sources
    from toolgym.configs.cli.viewer.server import ViewerData, ViewerServer

    recordings, metrics, tokenizer = view_sources([run_dir])
    renderer = ChatRenderer(load_tokenizer(tokenizer or DEFAULT_TOKENIZER))
    data = ViewerData(recordings, renderer, metrics, title=Path(run_dir).name)
    evals = [i for i, p in enumerate(recordings) if p.name.startswith("eval_")]
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with ViewerServer(data) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1500, "height": 860})
        page.goto(server.url)
        page.wait_for_selector("#episode-table tbody tr")
        page.select_option("#filter-failure", "wrong_format")
        page.wait_for_function("document.querySelector('#list-count').textContent.includes('filtered')")
        page.click("#episode-table tbody tr:nth-child(2)")
        page.wait_for_selector("#episode-detail .transcript .tok")
        page.check("#episode-detail .shade-logprob")
        page.hover("#episode-detail .tok.m1 >> nth=1")
        page.screenshot(path=str(HERE / "episodes.png"))

        page.click("#tab-compare")
        page.select_option("#compare-a", str(evals[0]))
        page.select_option("#compare-b", str(evals[-1]))
        page.check("#compare-changed")
        page.wait_for_selector("#compare-table tbody tr")
        page.click("#compare-table tbody tr:nth-child(1)")
        page.wait_for_selector("#compare-detail .side-b .transcript .tok")
        page.check("#compare-detail .side-a .shade-adv")
        page.screenshot(path=str(HERE / "compare.png"))

        page.click("#tab-charts")
        page.wait_for_selector("#charts .chart svg")
        page.screenshot(path=str(HERE / "charts.png"), clip={"x": 0, "y": 0, "width": 1500, "height": 620})
        browser.close()
    for name in ("episodes.png", "compare.png", "charts.png"):
        print(HERE / name)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
