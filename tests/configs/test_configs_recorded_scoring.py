"""A training run's recording carries the run's own scoring config, so the viewer shades and
sorts by the advantages the trainer used (dr_grpo + turn_state here), while an eval recording,
never trained on, says its advantages are unknown."""

from __future__ import annotations

import pytest
from test_configs_resume_recordings import tiny_config

from toolgym.configs.cli.train import train
from toolgym.configs.cli.viewer.index import RecordingIndex
from toolgym.configs.load import config_from_dict
from toolgym.rollouts.recording.format import read_recording
from toolgym.rollouts.scoring.scorer import score_recorded

pytestmark = pytest.mark.slow


def test_a_training_recording_is_scored_with_the_runs_own_config(tmp_path):
    settings = tiny_config(tmp_path / "run")
    settings["batch"]["advantage"] = {"estimator": "dr_grpo", "credit": "turn_state"}
    settings["eval"] = {"every_steps": 0, "at_start": False, "num_tasks": 2, "num_examples": 0}
    config = config_from_dict(settings)
    assert train(config, progress=False) == 0
    recording = tmp_path / "run" / "trajectories" / "train_rank0.jsonl"
    index = RecordingIndex(recording)
    assert index.scoring is not None and index.scoring.advantage == config.batch.advantage
    assert index.scoring.loss["name"] == config.trainer.loss.name
    _, trajectories = read_recording(recording)
    assert len(index.rows) == len(trajectories) == 4
    assert all(row["adv"] is not None for row in index.rows)
    eval_index = RecordingIndex(tmp_path / "run" / "trajectories" / "eval_step_00000001.jsonl")
    assert eval_index.scoring is None and "unknown" in eval_index.scoring_note
    assert all(row["adv"] is None for row in eval_index.rows)
    # the viewer's per-episode advantages are those of the run's config (not the viewer's defaults)
    expected = score_recorded(
        trajectories, config.batch.advantage, train_on_infra_failures=config.batch.train_on_infra_failures
    )
    assert index._advantages == expected
    assert all(isinstance(a, list) for a in expected)  # turn-level credit: one per turn
