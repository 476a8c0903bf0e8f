"""`toolgym train` under torchrun with 2 CPU processes (gloo): each rank rolls out its own groups
from a rank-disjoint task stream, both train one FSDP model, rank 0 logs and evaluates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_configs_loop import records, small_config

from toolgym.configs.load import config_from_dict, config_to_toml
from toolgym.rollouts.recording.format import read_recording

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_two_process_run(tmp_path):
    run_dir = tmp_path / "run"
    config = config_from_dict(small_config(run_dir, eval={"every_steps": 0}, checkpoint={"every_steps": 0}))
    path = tmp_path / "two.toml"
    path.write_text(config_to_toml(config))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*torchrun, "-m", "toolgym.configs.cli", "train", str(path), "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == [1, 2]  # rank 0 alone writes the metrics
    for r in steps:
        assert r["rollout/episodes"] == 4 and r["batch/groups"] == 2  # both ranks' groups
        assert abs(r["train/sampler_kl_k3"]) < 1e-4  # both engines got the synced weights
    assert [r["step"] for r in records(run_dir, "eval")] == [0, 2]
    meta = json.loads((run_dir / "checkpoints" / "rl" / "step_00000002" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["data_position"]["positions"] == [2, 2]
    ids = [
        sorted({t.group_id for t in read_recording(run_dir / "trajectories" / f"train_rank{r}.jsonl")[1]})
        for r in (0, 1)
    ]
    assert ids == [[0, 2], [1, 3]]  # rank-disjoint task streams
    assert (run_dir / "final_model" / "model.safetensors").is_file()
    assert "after RL (step    2)" in done.stdout and done.stdout.count("step 2/2") == 1
