"""`toolgym train --resume` and the run's recordings: NaN sampler logprobs read back and the run
resumes; a damaged recording refuses the resume with one line (path, line) before anything on
disk changes."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest

from toolgym.configs.cli.main import main
from toolgym.configs.cli.train import train
from toolgym.configs.load import config_from_dict
from toolgym.rollouts.recording.format import RecordingReader, RecordingWriter, read_recording

pytestmark = pytest.mark.slow


def tiny_config(run_dir: Path) -> dict:
    """The 'test' model shape, 2 groups of 2, short episodes, no SFT, no evals: seconds."""
    return {
        "run": {"steps": 1, "run_dir": str(run_dir)},
        "model": {"name": "test", "overrides": {"vocab_size": 1024}},
        "policy": {"max_batch_size": 16, "max_seq_len": 256},
        "rollout": {"group_size": 2, "max_turns": 3, "max_tokens_per_turn": 8, "max_tokens_per_episode": 24},
        "batch": {"groups_per_batch": 2},
        "sft": {"enabled": False},
        "eval": {"every_steps": 0, "at_start": False},
        "checkpoint": {"every_steps": 1, "keep_last": 1},
        "logging": {"progress_bar": False, "record_training": True},
    }


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_nan_logprobs_resume_and_a_damaged_recording_refuses_resume_changing_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(config_from_dict(tiny_config(run_dir))) == 0
    recording = run_dir / "trajectories" / "train_rank0.jsonl"

    # a float16 sampler after a diverging update: NaN logprobs in the recorded episodes
    reader = RecordingReader(recording)
    episodes = list(reader)
    assert len(episodes) == 4
    nan_episodes = []
    for t in episodes:
        transitions = [
            msgspec.structs.replace(
                tr, action=msgspec.structs.replace(tr.action, logprobs=[math.nan] * len(tr.action.logprobs))
            )
            for tr in t.transitions
        ]
        nan_episodes.append(msgspec.structs.replace(t, transitions=transitions))
    recording.unlink()
    with RecordingWriter(recording, reader.header) as writer:
        writer.write_all(nan_episodes)
    raw = msgspec.json.decode(recording.read_bytes().split(b"\n")[1])
    assert set(raw["transitions"][0]["action"]["logprobs"]) == {"nan"}  # never null in a float field
    _, back = read_recording(recording)
    assert all(math.isnan(x) for t in back for tr in t.transitions for x in tr.action.logprobs)

    assert main(["train", "--resume", str(run_dir), "--set", "run.steps=2", "--no-progress"]) == 0
    assert len(read_recording(recording)[1]) == 8  # the step-1 episodes kept, step 2's appended
    capsys.readouterr()

    # one damaged line in the middle: refused, one line naming the file and the line, nothing changed
    lines = recording.read_bytes().split(b"\n")
    lines[2] = lines[2][:40] + b"#" + lines[2][41:]  # line 3
    recording.write_bytes(b"\n".join(lines))
    before = snapshot(run_dir)
    assert main(["train", "--resume", str(run_dir), "--set", "run.steps=3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{recording}: line 3 is corrupt" in err and "Traceback" not in err
    assert snapshot(run_dir) == before  # config.toml not rewritten, no recording cut
