"""2-process FSDP2 on gloo gives the same loss, gradients and parameters as 1 process (with
activation checkpointing on the two ranks for dapo), for the "test" model and for Qwen3.5's hybrid
("test-qwen3.5": Gated DeltaNet layers sharded whole per block like any other)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainers_testlib import WORKER, full_params, random_episodes, run_worker, worker_config

from toolgym.agents.model.transformer import build_model
from toolgym.trainers.checkpoint import CheckpointManager
from toolgym.trainers.trainer import Trainer, lr_factor

LOSSES = ("grpo", "dapo", "dapo:test-qwen3.5")  # seq-mean-token-mean and token-mean: step-wide counts


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One plain process (a world of one, no torchrun) and one 2-process torchrun, both losses."""
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    run_worker([sys.executable, str(WORKER), str(one), ",".join(LOSSES)], one)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run_worker([*torchrun, str(WORKER), str(two), ",".join(LOSSES)], two)
    return one, two


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("loss", LOSSES)
def test_two_process_fsdp_matches_one_process(runs, loss):
    one, two = runs
    a, b = torch.load(one / f"{loss}.pt"), torch.load(two / f"{loss}.pt")

    assert abs(a["first"]["loss"] - b["first"]["loss"]) <= 1e-5
    assert a["first"]["num_tokens"] == b["first"]["num_tokens"]
    assert a["grads"].keys() == b["grads"].keys() and len(a["grads"]) > 0
    for name in a["grads"]:
        assert (a["grads"][name] - b["grads"][name]).abs().max().item() <= 1e-5, name
    for x, y in zip(a["history"], b["history"], strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-5
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5
        assert x["num_tokens"] == y["num_tokens"] and x["skipped"] == y["skipped"] == 0.0
    # 3 Adam steps at lr 1e-3: per-step updates are ~1e-3, float noise in the sums stays far below
    for name in a["params"]:
        assert (a["params"][name] - b["params"][name]).abs().max().item() <= 5e-5, name


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_checkpoint_loads_in_one_process(runs):
    _, two = runs
    saved = torch.load(two / "dapo.pt")
    resumed = Trainer(build_model("test", seed=7), worker_config("dapo"), device="cpu")
    assert CheckpointManager(two / "dapo.ckpt").load(resumed) == {"next_step": 3}  # DCP reshards 2 -> 1
    assert resumed.step == 3 and resumed.lr == pytest.approx(1e-3 * lr_factor(3, resumed.config.optimizer))
    for name, value in full_params(resumed.model).items():
        assert torch.equal(value, saved["params"][name]), name
    assert resumed.train_step(random_episodes(13, seed=13))["skipped"] == 0.0
