"""`toolgym plot RUN_DIR`: PNGs from a metrics.jsonl (train lines, eval markers, SFT loss)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from toolgym.configs.cli.main import main

pytestmark = pytest.mark.slow  # matplotlib renders seven figures

PNGS = {"reward.png", "accuracy.png", "tag_rate.png", "entropy.png", "kl.png", "curves.png"}


def test_plot_writes_pngs_from_a_metrics_file(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"kind": "sft", "step": s, "sft/loss": 3.0 / s} for s in (1, 2, 3)]
    lines += [
        {"kind": "train", "step": s, "rollout/reward_mean": 0.1 * s, "rollout/accuracy": 0.2, "rollout/tag_rate": 0.5,
         "train/entropy": 1.0, "train/sampler_kl_k3": 1e-3}
        for s in range(1, 6)
    ]  # fmt: skip
    lines += [
        {"kind": "eval", "step": s, "eval/accuracy": 0.5, "eval/tag_rate": 0.4, "eval/reward_mean": 0.6}
        for s in (0, 5)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "tr')
    assert main(["plot", str(run_dir)]) == 0
    written = capsys.readouterr().out.split()
    assert {Path(p).name for p in written} == PNGS
    for p in written:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path / "nope")]) == 2


def test_plot_skips_lines_that_are_not_records(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = ["42", "[1, 2]", '{"kind": "train", "step": null, "rollout/reward_mean": 1.0}']
    lines += [json.dumps({"kind": "train", "step": s, "rollout/reward_mean": 0.1 * s}) for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    with pytest.warns(UserWarning, match="skipped lines 1, 2, 3"):
        assert main(["plot", str(run_dir), "--out", str(tmp_path / "plots")]) == 0
    # no env metric was logged, so none is plotted (a metric is never drawn as a flat zero)
    assert {Path(p).name for p in capsys.readouterr().out.split()} == PNGS - {"accuracy.png", "tag_rate.png"}


def test_reward_components_are_drawn_in_one_panel_whatever_their_names(tmp_path, capsys):
    from matplotlib.figure import Figure

    from toolgym.trainers.plots import _draw_components, component_names

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    names = ["correct", "transfer_made", "$cost^$", "_hidden"]  # mathtext and legend-hiding characters
    lines = [
        {
            "kind": "train",
            "step": s,
            "rollout/reward_mean": 0.1 * s,
            **{f"rollout/reward/{n}": 0.1 * s for n in names[:3]},
        }
        for s in (1, 2, 3)
    ]
    lines += [{"kind": "eval", "step": 3, "eval/reward_mean": 0.5, "eval/reward/_hidden": 0.5}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["plot", str(run_dir)]) == 0
    written = {Path(p).name for p in capsys.readouterr().out.split()}
    assert written == PNGS - {"accuracy.png", "tag_rate.png"} | {"reward_components.png"}

    train = [x for x in lines if x["kind"] == "train"]
    evals = [x for x in lines if x["kind"] == "eval"]
    assert component_names(train, evals) == names
    fig = Figure()
    ax = fig.add_subplot()
    assert _draw_components(ax, names, train, evals)
    fig.savefig(io.BytesIO(), format="png")  # `$cost^$` as mathtext would fail here
    assert len(ax.get_lines()) == 4  # three train lines, one eval series
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["correct", "transfer_made", r"\$cost^\$", " _hidden (eval)"]


def test_staleness_histogram_is_drawn_when_the_trainer_reported_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [
        {"kind": "train", "step": s, "rollout/reward_mean": 0.5, "train/staleness_tokens_s0_sum": 10.0,
         "train/staleness_tokens_s1_sum": 5.0 * s, "train/logprob_gap_mean_s1": 0.02}
        for s in (1, 2)
    ]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["plot", str(run_dir)]) == 0
    written = {Path(p).name for p in capsys.readouterr().out.split()}
    assert "staleness.png" in written


def test_a_pool_runs_ratings_are_drawn_a_line_per_player(tmp_path, capsys):
    from matplotlib.figure import Figure

    from toolgym.trainers.plots import _draw_ratings

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [
        {"kind": "train", "step": 1, "selfplay/elo": 1010.0, "selfplay/elo/random": 990.0},
        {"kind": "train", "step": 2, "selfplay/elo": 1030.0, "selfplay/elo/random": 985.0,
         "selfplay/elo/step_1": 995.0, "selfplay/games/step_1": 3.0},
    ]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["plot", str(run_dir)]) == 0
    assert "ratings.png" in {Path(p).name for p in capsys.readouterr().out.split()}
    ax = Figure().add_subplot()
    assert _draw_ratings(ax, lines)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["policy", "random", "step_1"]
    assert [len(line.get_xdata()) for line in ax.get_lines()] == [2, 2, 1]  # a member from when it joined
