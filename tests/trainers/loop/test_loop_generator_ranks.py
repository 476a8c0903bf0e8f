"""Async mode under torchrun with the ranks split (`loop.generator_ranks`), 3 CPU processes on
gloo: generator ranks roll out, the trainer ranks train one FSDP2 model, the weights reach the
generators exactly, and a resumed run loses and repeats no group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from test_loop_async import GROUP_SIZE, async_config, train_records

from toolgym.configs.load import config_from_dict, config_to_toml
from toolgym.rollouts.recording.format import read_recording

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def torchrun(cwd: Path, nproc: int, *args: str, program: str = "-m toolgym.configs.cli", ok: bool = True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    done = subprocess.run(
        [*command, *program.split(), "train", *args, "--no-progress"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if ok:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.parametrize("generators", [1, 2])
def test_generator_ranks_and_trainer_ranks(tmp_path, generators):
    run_dir = tmp_path / "run"
    # max_staleness 0: every trained token was sampled by the weights the trainer had, so the
    # sampler's logprobs must match the trainer's: each version's weights reached the generators.
    # The entropy bonus changes the weights every step even with all-zero rewards.
    config = async_config(run_dir, 4, max_staleness=0, generator_ranks=generators)
    config["trainer"] = {"optimizer": {"lr": 1e-3}, "loss": {"entropy_coef": 0.05}}
    config["eval"] = {"every_steps": 0, "at_start": True, "at_end": True, "num_tasks": 2}
    path = tmp_path / "split.toml"
    path.write_text(config_to_toml(config_from_dict(config)))
    trainers = 3 - generators
    done = torchrun(tmp_path, 3, str(path))
    assert f"generator: torchrun ranks {trainers}..2, the trainer on ranks 0..{trainers - 1}" in done.stdout

    done = torchrun(tmp_path, 3, "--resume", str(run_dir), "--set", "run.steps=6")
    assert "resuming at step 4" in done.stdout

    records = train_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, 7))  # each step once across the resume
    assert [r["policy_version"] for r in records] == [float(s) for s in range(1, 7)]
    for r in records:
        assert r["train/episodes"] == 2 * GROUP_SIZE and r["async/staleness_max"] == 0
        assert r["train/grad_norm"] > 0  # the weights moved
        assert r["train/num_tokens"] == r["train/staleness_tokens_s0_sum"] > 0
        assert r["train/logprob_gap_mean_s0"] < 1e-4, r  # sampled by exactly the trainer's weights
    meta = json.loads((run_dir / "checkpoints" / "rl" / "step_00000006" / "meta.json").read_text())
    assert meta["world_size"] == trainers
    positions, pending = meta["data_position"]["positions"], meta["data_position"]["pending"]
    assert len(positions) == generators

    # every group taken is recorded once (trainer rank 0 records); with the groups outstanding at
    # the end, exactly the task indices the generators' streams drew (index = k * N + g)
    trajectories = read_recording(run_dir / "trajectories" / "train_rank0.jsonl")[1]
    recorded = Counter(t.group_id for t in trajectories)
    assert set(recorded.values()) == {GROUP_SIZE}
    drawn = {k * generators + g for g in range(generators) for k in range(positions[g])}
    assert not set(recorded) & set(pending) and set(recorded) | set(pending) == drawn
    assert {i % generators for i in recorded} == set(range(generators))  # every generator's groups
    assert len(recorded) == sum(r["dynamic_sampling/groups_rolled_out"] for r in records)
    assert not list(run_dir.glob("trajectories/train_rank[1-9]*.jsonl"))


def test_a_failing_generator_rank_ends_the_run_with_its_error(tmp_path):
    """A generator's producer fails (injected: tests/trainers/loop/failing_generator.py): trainer
    rank 0 names the rank and the error, and the run ends (no rank waits on the others)."""
    config = async_config(tmp_path / "run", 20, generator_ranks=1)
    path = tmp_path / "split.toml"
    path.write_text(config_to_toml(config_from_dict(config)))
    program = str(Path(__file__).with_name("failing_generator.py"))
    done = torchrun(tmp_path, 2, str(path), program=program, ok=False)
    assert done.returncode != 0
    assert "generator rank 0's group producer failed: RuntimeError('injected failure in the generator')" in (
        done.stdout + done.stderr
    )
