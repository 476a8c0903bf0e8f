"""LoRA over 2-process FSDP2 on gloo: the adapters' gradients and updates match 1 process, the
sharded base stays frozen bitwise, and the sync from rank 0 carries the adapters' checksum."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainers_testlib import WORKER, full_params, lora_test_model, random_episodes, run_worker, worker_config

from toolgym.agents.model.lora import adapter_checksum, is_adapter_name
from toolgym.trainers.checkpoint import CheckpointManager
from toolgym.trainers.trainer import Trainer


@pytest.fixture(scope="module", params=["lora", "lora-moe"])
def runs(tmp_path_factory, request):
    """The LoRA worker in one plain process and in a 2-process torchrun; "lora-moe": a Qwen3-MoE
    model with adapters on every expert (LoraExperts' stacked weights sharded by FSDP2)."""
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    run_worker([sys.executable, str(WORKER), str(one), request.param], one)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run_worker([*torchrun, str(WORKER), str(two), request.param], two)
    a, b = torch.load(one / "lora.pt"), torch.load(two / "lora.pt")
    assert (a["world_size"], b["world_size"]) == (1, 2)
    return a, b, two, request.param == "lora-moe"


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_lora_gradients_and_updates_match_one_process(runs):
    a, b, *_ = runs
    assert abs(a["first"]["loss"] - b["first"]["loss"]) <= 1e-5
    # only the adapters have gradients, on both
    assert set(a["grads"]) == set(b["grads"]) and a["grads"]
    assert all(is_adapter_name(n) for n in b["grads"])
    assert set(b["grads"]) == {n for n in b["after"] if is_adapter_name(n)}
    for name in a["grads"]:
        assert (a["grads"][name] - b["grads"][name]).abs().max().item() <= 1e-5, name
    assert any(b["grads"][n].abs().max() > 0 for n in b["grads"] if ".lora_B." in n)  # B gets a gradient at 0
    for x, y in zip(a["history"], b["history"], strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5
        assert x["skipped"] == y["skipped"] == 0.0
    for name in a["after"]:
        if is_adapter_name(name):
            moved = (b["after"][name] - b["before"][name]).abs().max().item()
            assert moved > 1e-4, name  # every adapter trained
            assert (a["after"][name] - b["after"][name]).abs().max().item() <= 5e-5, name


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_lora_keeps_the_sharded_base_bitwise(runs):
    a, b, *_ = runs
    base = [n for n in b["before"] if not is_adapter_name(n)]
    assert base and len(base) < len(b["before"])
    for name in base:
        assert torch.equal(b["after"][name], b["before"][name]), name
        assert torch.equal(b["after"][name], a["after"][name]), name  # the same base on both


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_lora_sync_from_rank_0_carries_the_adapters_checksum(runs):
    a, b, *_ = runs
    for run in (a, b):
        assert run["sync_error"] == ""
        adapters = {n: t for n, t in run["after"].items() if is_adapter_name(n)}
        assert set(run["sent"]) == set(adapters)  # adapters only, gathered whole
        for name, tensor in adapters.items():
            assert torch.equal(run["sent"][name], tensor), name
        expected = adapter_checksum(adapters.items())
        assert run["applied"] == (3, expected)
        assert run["engine_checksum"] == expected


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_lora_checkpoint_resumes_in_one_process(runs):
    _, b, two, moe = runs
    resumed = Trainer(lora_test_model(seed=7, moe=moe), worker_config("grpo"), device="cpu")
    assert CheckpointManager(two / "lora.ckpt").load(resumed) == {"next_step": 3}
    assert resumed.step == 3
    params = full_params(resumed.model)
    for name, value in b["after"].items():
        if is_adapter_name(name):
            assert torch.equal(params[name], value), name
    assert {id(p) for p in resumed.optimizer.state} == {id(p) for p in resumed.trainable}
    assert resumed.train_step(random_episodes(13, seed=13))["skipped"] == 0.0
