"""A run stopped during the eval that follows a checkpoint at the same step: its resume redoes
that eval, so the metrics row and the recording of every scheduled eval are there once, equal to
an uninterrupted run's."""

from __future__ import annotations

import pytest
from test_configs_resume_recordings import tiny_config

from toolgym.configs.cli.train import train
from toolgym.configs.load import config_from_dict
from toolgym.rollouts.recording.format import read_recording
from toolgym.trainers.loop.rl import RLLoop
from toolgym.trainers.metrics_log import read_metrics

pytestmark = pytest.mark.slow

TIMINGS = ("time", "_s")


def eval_rows(run_dir) -> dict[int, list[dict]]:
    rows: dict[int, list[dict]] = {}
    for r in read_metrics(run_dir / "metrics.jsonl"):
        if r["kind"] == "eval":
            kept = {k: v for k, v in r.items() if not k.startswith("time") and not k.endswith(TIMINGS)}
            rows.setdefault(r["step"], []).append(kept)
    return rows


def config(run_dir, steps: int = 3):
    settings = tiny_config(run_dir)
    settings["run"]["steps"] = steps
    settings["eval"] = {"every_steps": 2, "at_start": False, "num_tasks": 4, "num_examples": 0}
    return config_from_dict(settings)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_a_run_stopped_during_an_eval_redoes_it_on_resume(tmp_path, monkeypatch, stop):
    whole = tmp_path / "whole"
    assert train(config(whole), progress=False) == 0

    evaluate = RLLoop.evaluate

    def stopped_at_step_2(self, runner, label):
        if self.step == 2:
            raise stop()  # Ctrl-C (checkpoint saved by train) or a kill (the loop's own checkpoint)
        return evaluate(self, runner, label)

    cut = tmp_path / "cut"
    monkeypatch.setattr(RLLoop, "evaluate", stopped_at_step_2)
    if stop is KeyboardInterrupt:
        assert train(config(cut), progress=False) == 130
    else:
        with pytest.raises(SystemExit):
            train(config(cut), progress=False)
    assert 2 not in eval_rows(cut) and not (cut / "trajectories" / "eval_step_00000002.jsonl").exists()
    monkeypatch.setattr(RLLoop, "evaluate", evaluate)

    assert train(config(cut), resume=cut, progress=False) == 0
    rows, expected = eval_rows(cut), eval_rows(whole)
    assert sorted(rows) == [2, 3] and all(len(v) == 1 for v in rows.values())
    assert rows[2] == expected[2]
    for step in (2, 3):
        name = f"eval_step_{step:08d}.jsonl"
        _, got = read_recording(cut / "trajectories" / name)
        _, want = read_recording(whole / "trajectories" / name)
        assert [t.transitions for t in got] == [t.transitions for t in want]


def test_the_summary_names_a_first_eval_after_rl_steps_as_such(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(config(run_dir, steps=4), progress=False) == 0
    out = capsys.readouterr().out
    assert "first eval (step    2)" in out and "after RL (step    4)" in out
    assert "initial policy" not in out
    single = tmp_path / "single"
    assert train(config(single, steps=2), progress=False) == 0
    out = capsys.readouterr().out
    assert "after RL (step    2)" in out and "first eval" not in out and "initial policy" not in out
