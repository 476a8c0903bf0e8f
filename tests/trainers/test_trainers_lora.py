"""LoRA in training: only adapters train and hold optimizer state, only adapters sync (checked by
version and checksum), checkpoints resume them bitwise, exports are merged + PEFT, config refusals."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).parent))
from trainers_testlib import full_params, random_episodes, sample_and_score

import toolgym.trainers.trainer as trainer_module
from toolgym.agents.engine.backend import select_backend
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.checkpoint import load_hf_checkpoint
from toolgym.agents.model.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraConfig,
    adapter_tensors,
    apply_lora,
    has_lora,
    is_adapter_name,
    lora_modules,
    merged_state_dict,
)
from toolgym.agents.model.transformer import build_model
from toolgym.agents.types import SamplingParams
from toolgym.configs.load import ConfigError, config_from_dict
from toolgym.trainers.checkpoint import ADAPTER_DIR, CheckpointManager, export_hf
from toolgym.trainers.config import OptimizerConfig, TrainerConfig
from toolgym.trainers.distributed import fsdp_wrap
from toolgym.trainers.losses import LossConfig
from toolgym.trainers.trainer import Trainer
from toolgym.trainers.weight_sync import AdapterSyncError, gather_weights, push_weights

torch.set_num_threads(1)
TIMING = {"step_time_s", "tokens_per_s"}


def lora_model(seed: int = 0, rank: int = 4):
    return apply_lora(build_model("test", seed=seed), LoraConfig(rank=rank, alpha=8), seed=seed)


def lora_trainer(seed: int = 0) -> Trainer:
    config = TrainerConfig(
        loss=LossConfig(name="grpo"),
        micro_batch_tokens=200,
        optimizer=OptimizerConfig(lr=5e-3, warmup_steps=1, decay="cosine", total_steps=4, weight_decay=0.01),
    )
    return Trainer(lora_model(seed), config, device="cpu")


def train(trainer: Trainer, steps) -> list[dict[str, float]]:
    return [
        {k: v for k, v in trainer.train_step(random_episodes(6, seed=s)).items() if k not in TIMING}
        for s in steps
    ]


def test_a_step_changes_only_the_adapters_and_the_optimizer_holds_only_them():
    trainer = lora_trainer()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    train(trainer, range(2))
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    adapters = {n for n, _ in adapter_tensors(trainer.model)}
    assert changed == adapters  # every adapter moved (B from 0), the base is bitwise the same
    state_params = {id(p) for p in trainer.optimizer.state}
    trainable = {id(p) for n, p in trainer.model.named_parameters() if n in adapters}
    assert state_params == trainable
    assert [id(p) for p in trainer.optimizer.param_groups[0]["params"]] == [id(p) for p in trainer.trainable]


def test_loraplus_trains_b_at_the_ratio_times_the_lr_under_the_schedule():
    def first_step(ratio: float) -> dict[str, torch.Tensor]:
        optimizer = OptimizerConfig(lr=1e-3, loraplus_lr_ratio=ratio)
        trainer = Trainer(
            lora_model(), TrainerConfig(loss=LossConfig(name="grpo"), optimizer=optimizer), device="cpu"
        )
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        train(trainer, range(1))
        return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters() if "lora_" in n}

    plain, plus = first_step(1.0), first_step(16.0)
    b_names = [n for n in plain if n.endswith("lora_B.weight")]
    assert b_names and all(plain[n].abs().max() > 0 for n in b_names)
    for n in b_names:  # Adam's first step is lr x sign(g): B moves 16x as far, A not at all (B was 0)
        torch.testing.assert_close(plus[n], 16 * plain[n], rtol=1e-4, atol=1e-9)
    assert all(torch.equal(plus[n], plain[n]) for n in plain if n.endswith("lora_A.weight"))
    scheduled = OptimizerConfig(lr=1e-3, loraplus_lr_ratio=16, warmup_steps=1, decay="cosine", total_steps=4)
    trainer = Trainer(
        lora_model(), TrainerConfig(loss=LossConfig(name="grpo"), optimizer=scheduled), device="cpu"
    )
    train(trainer, range(2))
    a_group, b_group = trainer.optimizer.param_groups
    assert {id(p) for p in b_group["params"]} == {
        id(p) for n, p in trainer.model.named_parameters() if n.endswith("lora_B.weight")
    }
    assert 0 < a_group["lr"] < 1e-3 and b_group["lr"] == pytest.approx(16 * a_group["lr"])
    with pytest.raises(ValueError, match="loraplus_lr_ratio must be > 0"):
        OptimizerConfig(loraplus_lr_ratio=0)


def test_a_model_with_nothing_to_train_is_refused():
    with pytest.raises(ValueError, match="no trainable parameters"):
        Trainer(build_model("test").requires_grad_(False), TrainerConfig(), device="cpu")


def lora_engine(serving: str | None, **kwargs) -> TorchEngine:
    """A TorchEngine over lora_model(seed=0) (the trainer's base), serving its adapters as asked
    (None: the engine's default, merged)."""
    model = lora_model(seed=0)
    if serving is None:
        return TorchEngine(model, **kwargs)
    dtype = kwargs.get("dtype", torch.float32)
    return TorchEngine(model, backend=select_backend(model.config, "cpu", dtype, lora=serving), **kwargs)


@pytest.mark.parametrize("serving", [None, "merged", "unmerged"])
def test_adapter_sync_sends_only_adapters_and_the_engine_scores_like_the_trainer(serving):
    trainer = lora_trainer()
    engine = lora_engine(serving, max_batch_size=4, max_seq_len=64)
    try:
        described = engine.backend.describe()
        if serving == "unmerged":
            assert "LoRA adapters unmerged" in described and "layers plain" in described
        else:  # merged: plain weights, so the layer form is the machine's default (packed here)
            assert "LoRA adapters merged" in described and not has_lora(engine.model)
        train(trainer, range(2))
        weights = gather_weights(trainer)
        assert weights and all(is_adapter_name(n) for n in weights)
        assert set(gather_weights(trainer, full=True)) > set(weights)
        push_weights(trainer, engine)
        applied = engine.applied_adapter()
        assert applied is not None and applied.version == engine.policy_version == trainer.step == 2
        completion, gap = sample_and_score(trainer, engine, [3, 17, 42, 7, 99])
        assert gap <= 1e-5, gap
        assert completion.policy_version == trainer.step
    finally:
        engine.close()


@pytest.mark.parametrize("serving", ["merged", "unmerged"])
def test_an_engine_on_another_base_takes_a_full_sync_then_adapters_only(serving):
    # a generator process's engine: its own copy of a base (here another one), a first full sync
    trainer = lora_trainer()
    model = lora_model(seed=1)
    engine = TorchEngine(model, backend=select_backend(model.config, "cpu", torch.float32, lora=serving))
    try:
        train(trainer, range(1))
        push_weights(trainer, engine, version=1)  # adapters only: the base is still seed 1's
        engine.load_weights(gather_weights(trainer, full=True).items(), 1)
        train(trainer, range(1, 2))
        push_weights(trainer, engine)  # adapters only, checked
        _, gap = sample_and_score(trainer, engine, [5, 9, 2, 77], max_tokens=8, seed=3)
        assert gap <= 1e-5, gap
    finally:
        engine.close()


@pytest.mark.filterwarnings("ignore:TorchEngine. torch.bfloat16 matmuls")
@pytest.mark.parametrize("serving", ["merged", "unmerged"])
def test_bf16_engine_keeps_float32_adapters_and_the_check_passes(serving):
    trainer = lora_trainer()
    engine = lora_engine(serving, max_batch_size=2, max_seq_len=32, dtype=torch.bfloat16)
    try:
        q = engine.model.model.layers[0].self_attn.q_proj
        kept = dict(engine.adapter_tensors())
        assert q.weight.dtype == torch.bfloat16
        assert {t.dtype for t in kept.values()} == {torch.float32}
        assert len(kept) == 2 * len(list(lora_modules(lora_model(0))))
        train(trainer, range(1))
        push_weights(trainer, engine)  # checked: raises on a mismatch
        asyncio.run(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, seed=0)))
    finally:
        engine.close()


def dropping_load(engine, named_tensors, version):
    """A broken sync on purpose: the load keeps the base tensors and drops the adapters."""
    TorchEngine.load_weights(engine, [(n, t) for n, t in named_tensors if not is_adapter_name(n)], version)


class DroppingEngine(TorchEngine):
    load_weights = dropping_load


def test_a_sync_that_drops_the_adapters_raises_naming_both_versions():
    trainer = lora_trainer()
    train(trainer, range(1))
    engine = DroppingEngine(lora_model(seed=0), max_batch_size=2, max_seq_len=32)
    try:
        push_weights(trainer, engine, version=1)  # nothing applied: the engine has no adapter report
    except AdapterSyncError as exc:
        assert str(exc) == (
            "LoRA adapter sync failed: the trainer sent version 1, the policy applied no adapters"
        )
    else:
        pytest.fail("a dropped adapter sync went unnoticed")
    finally:
        engine.close()

    engine = TorchEngine(lora_model(seed=0), max_batch_size=2, max_seq_len=32)
    try:
        push_weights(trainer, engine)  # version 1 applied
        train(trainer, range(1, 2))
        engine.load_weights = dropping_load.__get__(engine)  # the next load drops them
        with pytest.raises(AdapterSyncError) as info:
            push_weights(trainer, engine)
        message = str(info.value)
        assert "\n" not in message
        assert "the trainer sent version 2 (checksum" in message
        assert "the policy applied version 1 (checksum" in message
    finally:
        engine.close()


def test_a_policy_that_cannot_report_adapters_is_refused():
    class Plain:
        policy_version = 0

        def load_weights(self, named_tensors, version):
            self.policy_version = version

    trainer = lora_trainer()
    with pytest.raises(AdapterSyncError, match="Plain cannot report the LoRA adapters it applied"):
        push_weights(trainer, Plain())  # type: ignore[arg-type]


def test_resume_restores_adapters_and_their_optimizer_state_bitwise(tmp_path):
    straight = lora_trainer()
    expected_metrics = train(straight, range(4))
    expected = full_params(straight.model)
    del straight

    first = lora_trainer()
    metrics = train(first, range(2))
    path = CheckpointManager(tmp_path / "ckpt").save(first, data_position={"next_step": 2})
    assert (path / ADAPTER_DIR / ADAPTER_CONFIG).is_file() and (
        path / ADAPTER_DIR / ADAPTER_WEIGHTS
    ).is_file()
    del first
    gc.collect()
    torch.manual_seed(999)

    resumed = lora_trainer(seed=123)  # other base and adapter values before the load
    CheckpointManager(tmp_path / "ckpt").load(resumed)
    assert {id(p) for p in resumed.optimizer.state} == {id(p) for p in resumed.trainable}
    metrics += train(resumed, range(2, 4))
    assert metrics == expected_metrics
    for name, value in full_params(resumed.model).items():
        assert torch.equal(value, expected[name]), name


def test_export_writes_the_merged_model_and_the_peft_adapter(tmp_path):
    trainer = lora_trainer()
    train(trainer, range(2))
    export_hf(trainer, tmp_path / "hf", adapter_directory=tmp_path / "adapter", base_model="/base")
    merged = load_hf_checkpoint(tmp_path / "hf")  # a plain HF directory: no adapter keys
    expected = merged_state_dict(trainer.model)
    for name, tensor in merged.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, "/base")
    assert sorted(config["target_modules"]) == sorted(LoraConfig().target_modules)


@pytest.mark.parametrize(
    ("lora", "backend", "message"),
    [
        ({"rank": -1}, "torch", "config error: policy.lora.rank: must be >= 0 (0 = off), got -1"),
        ({"rank": 8, "alpha": 0}, "torch", "config error: policy.lora.alpha: must be > 0, got 0"),
        ({"rank": 8, "dropout": 1}, "torch", "config error: policy.lora.dropout: must be in [0, 1), got 1"),
        ({"rank": 8, "target_modules": ["lm_head"]}, "torch", "policy.lora.target_modules: must be"),
        ({"rank": 1024}, "vllm", "config error: policy.lora.rank: must be <= 512 with backend 'vllm'"),
        (
            {"rank": 8, "target_modules": ["q_proj", "experts"]},
            "vllm",
            "config error: policy.lora.target_modules: must leave out 'experts' with backend 'vllm'",
        ),
    ],
)
def test_config_refusals(lora, backend, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"policy": {"lora": lora, "backend": backend}})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_lora_config_parses():
    config = config_from_dict({"policy": {"lora": {"rank": 8, "alpha": 32, "target_modules": ["q_proj"]}}})
    assert config.policy.lora == LoraConfig(rank=8, alpha=32, target_modules=["q_proj"])
    assert not config_from_dict({}).policy.lora.enabled
    with_vllm = config_from_dict({"policy": {"lora": {"rank": 512}, "backend": "vllm"}})  # vLLM's LoRARequest
    assert with_vllm.policy.lora.rank == 512 and with_vllm.policy.backend == "vllm"


def test_fsdp2_wrapped_lora_trains_syncs_and_exports_like_the_plain_model(tmp_path, monkeypatch):
    """FSDP2 (`fsdp_wrap`, what every world size > 1 uses) in a world of one: frozen base
    parameters beside trainable adapters in each unit."""
    plain = lora_trainer()
    expected = train(plain, range(2))
    monkeypatch.setattr(trainer_module, "shard_model", lambda model, mesh, precision: fsdp_wrap(model, mesh))
    wrapped = lora_trainer()
    assert isinstance(wrapped.model, FSDPModule)
    got = train(wrapped, range(2))
    for a, b in zip(got, expected, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6
    params, reference = full_params(wrapped.model), full_params(plain.model)
    for name, value in params.items():
        assert torch.allclose(value, reference[name], atol=1e-6), name
    weights = gather_weights(wrapped)
    assert set(weights) == {n for n, _ in adapter_tensors(plain.model)}
    export_hf(wrapped, tmp_path / "hf", adapter_directory=tmp_path / "adapter")
    assert (tmp_path / "adapter" / ADAPTER_WEIGHTS).is_file()
    merged = load_hf_checkpoint(tmp_path / "hf").state_dict()
    for name, tensor in merged_state_dict(plain.model).items():
        assert torch.allclose(merged[name], tensor, atol=1e-6), name
