"""The mixture-of-experts MLP's own parts (agents/model/moe.py); its parity with transformers'
Qwen3-MoE is tests/agents/model/test_model_families.py's (cases qwen3-moe*): the grouped matmul's
two paths agree (values and gradients, empty experts included), checkpoints' per-expert tensors
fuse and split back, the config's refusals, and the published shape's parameter count."""

from __future__ import annotations

import pytest
import torch

from toolgym.agents.model import moe
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import build_model


def _groups(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([3, 0, 5, 1, 0, 7])  # two experts get no rows
    x = torch.randn(int(counts.sum()), 16, generator=g)
    weight = torch.randn(len(counts), 24, 16, generator=g)
    return x, weight, counts


def _reference(x, weight, counts):
    rows, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows.append(x[start : start + n] @ weight[e].T)
        start += n
    return torch.cat(rows)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "padded-bmm"])
def test_grouped_matmul_is_each_groups_matmul(monkeypatch, grouped):
    if not grouped:
        monkeypatch.setattr(moe, "_grouped_mm_fits", lambda x, w: False)
    else:
        assert moe._grouped_mm_fits(*_groups()[:2])
    x, weight, counts = _groups()
    xs, ws = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    xr, wr = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = moe.grouped_matmul(xs, ws, counts)
    expected = _reference(xr, wr, counts)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(xs.grad, xr.grad)
    torch.testing.assert_close(ws.grad, wr.grad)
    assert ws.grad is not None and ws.grad[1].abs().sum() == 0 and ws.grad[4].abs().sum() == 0


def test_the_block_runs_alike_on_both_paths_and_under_bf16_autocast(monkeypatch):
    model = build_model("test-qwen3-moe", seed=0)
    tokens = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        grouped = model(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(tokens)
        monkeypatch.setattr(moe, "_grouped_mm_fits", lambda x, w: False)
        padded = model(tokens)
    torch.testing.assert_close(grouped, padded, atol=1e-5, rtol=1e-5)
    assert (low.float() - grouped).abs().max() < 0.1


def test_checkpoint_experts_fuse_and_split_back():
    state = {n: t for n, t in build_model("test-qwen3-moe", seed=0).state_dict().items()}
    split = moe.split_experts(state)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in split
    assert not any(n.endswith(".gate_up_proj") for n in split)
    back = moe.fuse_experts(split)
    assert list(back) != [] and set(back) == set(state)
    assert all(torch.equal(back[n], state[n]) for n in state)
    del split["model.layers.0.mlp.experts.2.down_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: .* experts 0\.\.3"):
        moe.fuse_experts(split)


def test_config_refusals_and_the_published_shape():
    base = ModelConfig.named("test-qwen3-moe")
    for change, message in [
        ({"model_type": "qwen3"}, "num_experts .* is not a qwen3 field"),
        ({"num_experts": 0}, "qwen3_moe needs num_experts >= 1"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok <= num_experts"),
        ({"mlp_only_layers": (2,)}, "mlp_only_layers layers 0..1"),
    ]:
        with pytest.raises(ValueError, match=message):
            ModelConfig(**{**{f: getattr(base, f) for f in base.__struct_fields__}, **change})
    assert [base.layer_moe(i) for i in range(2)] == [True, False]
    big = ModelConfig.named("qwen3-30b-a3b")
    assert 30.4e9 < big.num_params() < 30.6e9  # Qwen3-30B-A3B: 30.5B in all
    assert ModelConfig.from_hf_dict(big.to_hf_dict()) == big
