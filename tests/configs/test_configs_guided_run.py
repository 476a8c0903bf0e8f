"""`toolgym train` with `rollout.guided_samples`: the env's oracle plays a sample of each training
group, the run trains on it, and its recording, replay and viewer say who played it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolgym.configs.cli.main import main
from toolgym.configs.cli.train import train
from toolgym.configs.cli.viewer.index import GUIDED_BY, RecordingIndex
from toolgym.configs.load import config_from_dict
from toolgym.rollouts.recording.format import read_recording

pytestmark = pytest.mark.slow


def guided_config(run_dir: Path, mode: str = "sync") -> dict:
    return {
        "loop": {"mode": mode},
        "run": {"steps": 1, "run_dir": str(run_dir), "plot": False, "export_hf": False},
        "model": {"name": "test", "overrides": {"vocab_size": 1024}},
        "policy": {"max_batch_size": 16, "max_seq_len": 512},
        "rollout": {
            "group_size": 2,
            "guided_samples": 1,
            "max_turns": 3,
            "max_tokens_per_turn": 24,
            "max_tokens_per_episode": 64,
        },
        "batch": {"groups_per_batch": 2},
        "sft": {"enabled": False},
        "eval": {"every_steps": 0, "at_start": False},
        "checkpoint": {"every_steps": 0},
        "logging": {"progress_bar": False, "record_training": True},
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_guided_run_trains_on_the_oracles_samples_and_its_recording_names_them(tmp_path, capsys, mode):
    """Async mode's generator (a process of its own on CPU) plays the oracle the same way."""
    run_dir = tmp_path / "run"
    assert train(config_from_dict(guided_config(run_dir, mode))) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (step,) = [m for m in records if m.get("kind") == "train"]
    assert step["batch/guided_episodes"] == 2.0  # one a group, both groups kept
    assert step["rollout/episodes"] == 2.0  # the policy's alone
    recording = run_dir / "trajectories" / "train_rank0.jsonl"
    _, trajectories = read_recording(recording)
    assert [t.guided for t in trajectories if t.sample_index == 1] == [True, True]
    assert not any(t.guided for t in trajectories if t.sample_index == 0)
    guided = [i for i, t in enumerate(trajectories) if t.guided]
    # the oracle answers right; the untrained random model does not
    assert all(trajectories[i].total_reward > 0.5 for i in guided)
    index = RecordingIndex(recording)
    assert index.episode(guided[0], None)["sampled_by"] == GUIDED_BY
    assert (
        index.episode(next(i for i in range(len(trajectories)) if i not in guided), None)["sampled_by"]
        == "policy v0"
    )
    capsys.readouterr()
    assert main(["replay", str(recording), "--verify"]) == 0
    assert capsys.readouterr().out.count("(played by the env oracle: a guided sample)") == 2
