"""LoRA (agents/model/lora.py): at init the base, adapters frozen-base only, merge, checksum, and the
PEFT round trip: our adapter directory loaded by `peft` onto `transformers`' model gives our logits."""

from __future__ import annotations

import json

import pytest
import torch

from toolgym.agents.model.checkpoint import save_hf_checkpoint
from toolgym.agents.model.lora import (
    ADAPTER_CONFIG,
    LoraConfig,
    LoraLinear,
    adapter_checksum,
    adapter_state,
    adapter_tensors,
    apply_lora,
    load_adapter,
    lora_config_of,
    merge_lora,
    merged_state_dict,
    save_adapter,
)
from toolgym.agents.model.transformer import build_model


def randomised(name: str, seed: int = 0):
    model = build_model(name, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


def trained_adapters(model, seed: int = 1) -> None:
    """B != 0, as after some training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, tensor in adapter_tensors(model):
            tensor.copy_(0.05 * torch.randn(tensor.shape, generator=g))


TOKENS = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["test", "test-qwen3"])
def test_lora_at_init_is_the_base(name: str) -> None:
    model = randomised(name)
    before = logits(model, TOKENS)
    base_names = set(model.state_dict())
    apply_lora(model, LoraConfig(rank=4))
    assert torch.equal(logits(model, TOKENS), before)  # B = 0
    # the base keeps its HF names; the adapters are added beside them
    names = set(model.state_dict())
    assert base_names <= names
    assert {n for n in names - base_names} == {n for n, _ in adapter_tensors(model)}
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in names
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in adapter_tensors(model)}
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoraLinear)
    assert q.lora_A.weight.shape == (4, q.in_features) and q.lora_B.weight.shape == (q.out_features, 4)
    assert not torch.all(q.lora_A.weight == 0) and torch.all(q.lora_B.weight == 0)


def test_targets_rank_and_scale() -> None:
    model = randomised("test")
    apply_lora(model, LoraConfig(rank=2, alpha=8, target_modules=["q_proj", "v_proj"]))
    assert lora_config_of(model) == LoraConfig(rank=2, alpha=8.0, target_modules=["q_proj", "v_proj"])
    assert model.model.layers[0].self_attn.q_proj.scale == 4.0
    assert not isinstance(model.model.layers[0].mlp.up_proj, LoraLinear)
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoraConfig(rank=2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": -1}, "rank must be >= 0"),
        ({"rank": 8, "alpha": 0}, "alpha must be > 0"),
        ({"rank": 8, "dropout": 1.0}, r"dropout must be in \[0, 1\)"),
        (
            {"rank": 8, "target_modules": ["q.proj"]},
            "target_modules must be a non-empty list of linear names",
        ),
        ({"rank": 8, "target_modules": []}, "target_modules must be a non-empty list"),
    ],
)
def test_config_refusals(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        LoraConfig(**kwargs)


def test_merge_equals_unmerged() -> None:
    model = randomised("test-qwen3")
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    trained_adapters(model)
    unmerged = logits(model, TOKENS)
    merged_state = merged_state_dict(model)
    assert not any("lora_" in k for k in merged_state)
    plain = build_model("test-qwen3")
    plain.load_state_dict(merged_state)
    assert torch.allclose(logits(plain, TOKENS), unmerged, atol=1e-5)
    merge_lora(model)
    assert not any(isinstance(m, LoraLinear) for m in model.modules())
    assert set(model.state_dict()) == set(merged_state)
    assert torch.allclose(logits(model, TOKENS), unmerged, atol=1e-5)


def test_checksum_sees_dropped_stale_and_zeroed_adapters() -> None:
    model = randomised("test")
    apply_lora(model, LoraConfig(rank=4))
    trained_adapters(model)
    tensors = list(adapter_tensors(model))
    reference = adapter_checksum(tensors)
    assert adapter_checksum(reversed(tensors)) == reference  # name order, not arrival order
    assert adapter_checksum(tensors[1:]) != reference
    assert adapter_checksum([(n, torch.zeros_like(t)) for n, t in tensors]) != reference
    assert adapter_checksum([(n, t + 1e-3) for n, t in tensors]) != reference
    assert adapter_checksum(tensors, torch.bfloat16) != reference  # rounded to the policy's dtype


def test_adapter_save_and_load_round_trip(tmp_path) -> None:
    model = randomised("test")
    apply_lora(model, LoraConfig(rank=4, alpha=8, dropout=0.1))
    trained_adapters(model)
    save_adapter(adapter_state(model), tmp_path, lora_config_of(model))
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.1)
    assert (config["peft_type"], config["task_type"]) == ("LORA", "CAUSAL_LM")
    fresh = randomised("test")
    apply_lora(fresh, LoraConfig(rank=4, alpha=8), seed=5)
    load_adapter(fresh, tmp_path)
    model.eval()
    assert torch.equal(logits(fresh, TOKENS), logits(model, TOKENS))


@pytest.mark.parametrize("name", ["test", "test-qwen3", "test-gemma3"])
def test_peft_loads_our_adapter_onto_transformers(tmp_path, name: str) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model = randomised(name)
    save_hf_checkpoint(model, model.config, tmp_path / "base")
    apply_lora(
        model, LoraConfig(rank=4, alpha=16, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"])
    )
    trained_adapters(model)
    save_adapter(adapter_state(model), tmp_path / "adapter", lora_config_of(model), str(tmp_path / "base"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = with_adapter(TOKENS).logits
    ours = logits(model, TOKENS)
    assert (ours - logits(randomised(name), TOKENS)).abs().max() > 1e-3  # the adapters matter
    assert (theirs - ours).abs().max() <= 1e-5
    # and merged: our merged weights are a plain HF checkpoint transformers reads
    save_hf_checkpoint(merged_state_dict(model), model.config, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert (merged.eval()(TOKENS).logits - ours).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["test-qwen3-moe", "test-gpt-oss"])
def test_lora_on_experts_loads_in_peft_merges_and_serves_merged(tmp_path, name: str) -> None:
    """LoRA on every expert's stacked projections, in peft's `target_parameters` layout: at init the
    base; peft loads the directory onto transformers' model with our logits; merged (state dict,
    in place, and as the engine serves it after a sync) it computes the same."""
    import copy

    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from toolgym.agents.engine.merged_lora import MergedAdapters
    from toolgym.agents.model.lora import LoraExperts
    from toolgym.agents.model.moe import Experts

    model = randomised(name)
    base_logits = logits(model, TOKENS)
    save_hf_checkpoint(model, model.config, tmp_path / "base")
    apply_lora(model, LoraConfig(rank=2, alpha=8, target_modules=["q_proj", "experts"]))
    assert torch.equal(logits(model, TOKENS), base_logits)  # B = 0
    experts = [n for n, m in model.named_modules() if isinstance(m, LoraExperts)]
    assert experts and len(experts) == sum(isinstance(m, Experts) for m in randomised(name).modules())
    names = {n for n, _ in adapter_tensors(model)}
    assert "model.layers.0.mlp.experts.base_layer.lora_A.weight" in names  # gate_up_proj's, as peft nests
    assert "model.layers.0.mlp.experts.lora_B.weight" in names  # down_proj's
    assert {n for n, p in model.named_parameters() if p.requires_grad} == names
    trained_adapters(model)
    ours = logits(model, TOKENS)
    assert (ours - base_logits).abs().max() > 1e-3
    # a training step reaches every expert adapter
    model(TOKENS).sum().backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0
        for n, p in model.named_parameters()
        if "experts" in n and p.requires_grad
    )
    model.zero_grad()

    config = lora_config_of(model)
    assert config.target_modules == ["experts", "q_proj"]
    save_adapter(adapter_state(model), tmp_path / "adapter", config, str(tmp_path / "base"))
    saved = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert saved["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = with_adapter(TOKENS).logits
    assert (theirs - ours).abs().max() <= 1e-5

    served = copy.deepcopy(model)
    store = MergedAdapters(served)  # the engine's copy: merged at once, refolded on each sync
    assert not any(isinstance(m, LoraExperts) for m in served.modules())
    with torch.no_grad():
        for _, tensor in adapter_tensors(model):
            tensor.mul_(1.5)  # a later step's adapters
    ours = logits(model, TOKENS)
    assert store.load(adapter_tensors(model)) == []
    written = store.fold(dict(served.named_parameters()))
    assert f"{experts[-1]}.gate_up_proj" in written
    assert (logits(served, TOKENS) - ours).abs().max() <= 1e-5

    plain = build_model(name)
    plain.load_state_dict(merged_state_dict(model))
    assert (logits(plain, TOKENS) - ours).abs().max() <= 1e-5
    merge_lora(model)
    assert not any(isinstance(m, LoraExperts) for m in model.modules())
    assert (logits(model, TOKENS) - ours).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="no dropout"):
        apply_lora(randomised(name), LoraConfig(rank=2, dropout=0.1, target_modules=["experts"]))
    with pytest.raises(ValueError, match=r"\['experts'\] name no nn.Linear"):
        apply_lora(randomised("test"), LoraConfig(rank=2, target_modules=["experts"]))
