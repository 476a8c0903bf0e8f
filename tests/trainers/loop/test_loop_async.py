"""`loop.mode = "async"` end to end with a test-size model: a generator process (or, with
`loop.generator = "thread"` and on CUDA, the engine's thread) samples groups while the trainer
trains; the staleness bound holds (drop and downweight, counted); a `kill -9` mid-run and
`--resume` lose and repeat no group in the recordings and metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from toolgym.configs.assembly.placement import generator_layout
from toolgym.configs.cli.train import train
from toolgym.configs.load import ConfigError, config_from_dict, config_to_toml
from toolgym.rollouts.recording.format import read_recording
from toolgym.trainers.metrics_log import read_metrics

pytestmark = pytest.mark.slow

GROUP_SIZE = 2


def async_config(run_dir: Path, steps: int, **loop) -> dict:
    """The 'test' model shape, no SFT, 2 groups of 2 per step, evals off: seconds per run."""
    return {
        "run": {"steps": steps, "run_dir": str(run_dir), "plot": False, "export_hf": False},
        "model": {"name": "test", "overrides": {"vocab_size": 1024}},
        "policy": {"max_batch_size": 16, "max_seq_len": 256},
        "rollout": {
            "group_size": GROUP_SIZE,
            "max_turns": 3,
            "max_tokens_per_turn": 8,
            "max_tokens_per_episode": 24,
        },
        "batch": {"groups_per_batch": 2},
        "trainer": {"optimizer": {"lr": 1e-3}},
        "eval": {"every_steps": 0, "at_start": False, "at_end": False},
        "checkpoint": {"every_steps": 2, "keep_last": 1},
        "logging": {"progress_bar": False, "record_training": True},
        "loop": {"mode": "async", **loop},
    }


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]


@pytest.mark.parametrize("over_stale", ["drop", "downweight"])
def test_async_mode_trains_with_staleness_bounded(tmp_path, capsys, over_stale):
    run_dir = tmp_path / "run"
    # max_staleness 0 with a deep buffer: groups sampled before the last push are over-stale.
    # "drop" runs the default layout (a generator process per core, the cores shared) and loads
    # weights in flight; "downweight" splits them (one generator process on one thread, the
    # trainer the rest) and drains. Drain because downweighted groups are trained: a sample that
    # took new weights in flight samples its later tokens over k/v the old weights computed, so
    # those tokens, stamped with the new version, differ from the trainer's logprobs at staleness 0
    # whenever a push lands mid-sample (drop discards every such group at max_staleness 0).
    layout = {} if over_stale == "drop" else {"generator_processes": 1, "generator_threads": 1}
    if over_stale == "downweight":
        layout["weight_updates"] = "drain"
    config = async_config(run_dir, 6, max_staleness=0, over_stale=over_stale, buffer_groups=6, **layout)
    config["trainer"]["loss"] = {"entropy_coef": 0.05}  # the weights move every step
    assert train(config_from_dict(config)) == 0
    out = capsys.readouterr().out
    assert "loop: async, max_staleness 0" in out
    found = re.search(r"generator: (\d+) process\(es\) with 1 thread\(s\) each, the trainer (\d+)(.*)", out)
    assert found, out
    processes, trainer_threads, shared = int(found[1]), int(found[2]), found[3]
    if over_stale == "drop":
        assert processes == min(trainer_threads, 4) and shared == ", sharing the cores"
    else:
        assert processes == 1 and shared == ""
    check_async_run(run_dir, over_stale)
    # the generator processes' weights (through shared memory) are exactly each version's: tokens
    # sampled by the current version (over k/v of that version) have the trainer's logprobs
    for r in train_records(run_dir):
        assert r["train/grad_norm"] > 0 and r["train/logprob_gap_mean_s0"] < 1e-4, r
    assert not list(Path("/dev/shm").glob(f"toolgym-weights-{os.getpid()}-*"))  # none left behind


@pytest.mark.parametrize(
    ("threads", "loop", "expected"),
    [
        (2, {}, (2, 1, 2)),  # the cores shared: a generator per core, the trainer all of its threads
        (16, {}, (4, 1, 16)),  # at most 4 generators by default
        (2, {"generator_processes": 1, "generator_threads": 1}, (1, 1, 1)),  # split
        (8, {"generator_processes": 2, "generator_threads": 6}, (2, 3, 2)),
        (1, {"generator_threads": 1}, (1, 1, 1)),  # each side keeps a thread
    ],
)
def test_generator_layout(tmp_path, threads, loop, expected):
    config = config_from_dict(async_config(tmp_path / "run", 1, **loop))
    assert generator_layout(config, threads) == expected
    # on CUDA one generator process by default (it shares the GPU), the trainer all its threads
    assert generator_layout(config, 16, "cuda")[0] == (loop.get("generator_processes") or 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_mode_with_a_generator_process_on_cuda(tmp_path, capsys):
    """`loop.generator = "process"` on CUDA: the generator process's engine on the trainer's GPU,
    groups over the loopback channel and weights through shared memory, as a torchrun generator
    rank but without torchrun."""
    run_dir = tmp_path / "run"
    config = async_config(run_dir, 6, max_staleness=0, buffer_groups=6, generator="process")
    config["parallel"] = {"device": "cuda"}
    assert train(config_from_dict(config)) == 0
    out = capsys.readouterr().out
    assert "generator: 1 process(es) with 1 thread(s) each" in out
    check_async_run(run_dir, "drop")


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_async_mode_with_the_generator_in_this_process(tmp_path, capsys, device):
    """`loop.generator = "thread"` (CUDA's default): the engine runs on its thread beside the
    trainer and takes the weights in flight, with the same guarantees as the process."""
    run_dir = tmp_path / "run"
    config = async_config(run_dir, 6, max_staleness=0, buffer_groups=6)
    config["parallel"] = {"device": device}
    if device == "cpu":
        config["loop"]["generator"] = "thread"
    assert train(config_from_dict(config)) == 0
    out = capsys.readouterr().out
    assert "generator: the engine's thread in this process" in out and "policy: torch engine, " in out
    check_async_run(run_dir, "drop")


def check_async_run(run_dir: Path, over_stale: str) -> None:
    """The async run's metrics and recording keep the staleness bound and count every group."""
    records = train_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["policy_version"] for r in records] == [float(s) for s in range(1, 7)]
    assert all(r["train/episodes"] == 2 * GROUP_SIZE for r in records)
    counted = sum(
        r[f"async/over_stale_{'dropped' if over_stale == 'drop' else 'downweighted'}"] for r in records
    )
    assert counted > 0  # the deep buffer held groups from older versions
    for r in records:
        stale_tokens = r["train/staleness_tokens_s1_sum"] + r["train/staleness_tokens_s2_sum"]
        stale_tokens += r["train/staleness_tokens_s3plus_sum"]
        if over_stale == "drop":  # nothing older than the bound was trained on
            assert r["async/staleness_max"] == 0 and stale_tokens == 0
        assert r["train/num_tokens"] == r["train/staleness_tokens_s0_sum"] + stale_tokens
    # every group the trainer took is recorded once, with its G episodes
    trajectories = read_recording(run_dir / "trajectories" / "train_rank0.jsonl")[1]
    recorded = Counter(t.group_id for t in trajectories)
    assert set(recorded.values()) == {GROUP_SIZE}
    # weights loaded in flight: a turn's tokens carry non-decreasing versions, none ahead of training
    for transition in (tr for t in trajectories for tr in t.transitions):
        versions = transition.action.token_versions or [transition.action.policy_version]
        assert versions == sorted(versions) and versions[0] == transition.action.policy_version
        assert versions[-1] <= 6
        if over_stale == "downweight":  # drained: every turn sampled by one version
            assert len(set(versions)) == 1, versions
    taken = sum(r["dynamic_sampling/groups_rolled_out"] for r in records)
    assert len(recorded) == taken


def test_async_refuses_what_it_cannot_run(tmp_path, monkeypatch):
    config = config_from_dict(
        async_config(tmp_path / "run", 1) | {"agent_program": {"module": "toolgym.examples.shop_agent"}}
    )
    with pytest.raises(ConfigError, match="agent_program"):
        train(config)
    config = config_from_dict(async_config(tmp_path / "run", 1) | {"policy": {"replicas": 2}})
    for generator in ("process", "thread"):  # sync mode's engine processes, not async's generators
        config.loop.generator = generator
        with pytest.raises(ConfigError, match=r"policy\.replicas: .*loop\.generator_processes.*= 1"):
            train(config)
    # the torchrun split (tests/trainers/loop/test_loop_generator_ranks.py): refused before any
    # process group forms when the ranks cannot be split as asked
    config = config_from_dict(async_config(tmp_path / "run", 1, generator_ranks=1))
    with pytest.raises(ConfigError, match=r"generator_ranks: 1 generator rank.*more ranks than that"):
        train(config)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="generator_ranks: async mode under torchrun splits the 3 ranks"):
        train(config_from_dict(async_config(tmp_path / "run", 1)))
    config.loop.mode = "sync"
    with pytest.raises(ConfigError, match=r'generator_ranks: splits the ranks in loop\.mode = "async" only'):
        train(config)
    assert not (tmp_path / "run").exists()


def test_kill_9_mid_run_and_resume_lose_and_repeat_no_group(tmp_path):
    run_dir = tmp_path / "run"
    config_file = tmp_path / "async.toml"
    config_file.write_text(config_to_toml(config_from_dict(async_config(run_dir, 8))))
    command = [sys.executable, "-m", "toolgym.configs.cli", "train", str(config_file)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = (tmp_path / "first.log").open("w")  # a file, not a pipe nobody reads while it runs
    process = subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)
    try:  # kill -9 (the trainer and its generator process) once step 5 is logged: past step 4's checkpoint
        deadline = time.monotonic() + 300
        while not any(r["step"] >= 5 for r in _train_records_if_any(run_dir)):
            assert process.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 5"
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait()
        log.close()
    assert process.returncode == -signal.SIGKILL
    killed_at = max(r["step"] for r in train_records(run_dir))
    assert killed_at < 8, "the run finished before it was killed"

    started = time.monotonic()
    resumed = subprocess.run(
        [sys.executable, "-m", "toolgym.configs.cli", "train", "--resume", str(run_dir)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 4" in resumed.stdout
    print(f"resumed run: {time.monotonic() - started:.1f} s")

    # metrics: each step once
    assert [r["step"] for r in train_records(run_dir)] == list(range(1, 9))
    # recordings: every group taken once, with its G episodes; with the groups still outstanding
    # at the end (the final checkpoint's pending), exactly the task indices the stream drew
    recorded = Counter(t.group_id for t in read_recording(run_dir / "trajectories" / "train_rank0.jsonl")[1])
    assert set(recorded.values()) == {GROUP_SIZE}, recorded
    meta = json.loads((run_dir / "checkpoints" / "rl" / "step_00000008" / "meta.json").read_text())
    positions, pending = meta["data_position"]["positions"], meta["data_position"]["pending"]
    # generator g of n draws task indices g, g + n, g + 2n, ... up to its position
    drawn = {k * len(positions) + g for g, position in enumerate(positions) for k in range(position)}
    assert not set(recorded) & set(pending)
    assert set(recorded) | set(pending) == drawn
    taken = sum(r["dynamic_sampling/groups_rolled_out"] for r in train_records(run_dir))
    assert len(recorded) == taken


def _train_records_if_any(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in read_metrics(path) if r["kind"] == "train"]
