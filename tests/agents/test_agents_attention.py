"""The model's attention entry point: on CPU a bf16 attention of < 256 queries that will be
differentiated runs in float32 (torch's CPU bf16 backward is slow there); inference, float32 and
longer rows are plain SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from toolgym.agents.kv_cache import KVCache, default_key_layout
from toolgym.agents.model import build_model, scaled_dot_product_attention
from toolgym.agents.model_config import ModelConfig
from toolgym.agents.prefix_attention import attend_after_prefix, prefix_mask


def qkv(dtype: torch.dtype, requires_grad: bool, seed: int = 0, length: int = 9) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 4, length, 32), (3, 2, length, 32), (3, 2, length, 32)]  # GQA: 4 query heads, 2 kv
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(requires_grad) for s in shapes]


def test_bf16_training_attention_runs_in_float32() -> None:
    dtype = torch.bfloat16
    q, k, v = qkv(dtype, requires_grad=True)
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == dtype
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    # The same computation written out: upcast, float32 SDPA, cast back; bit for bit.
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    expected = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, (q32, k32, v32), grad_out.float())
    torch.testing.assert_close(out, expected.to(dtype), rtol=0, atol=0)
    for grad, reference in zip(grads, expected_grads, strict=True):
        assert grad.dtype == dtype
        torch.testing.assert_close(grad, reference.to(dtype), rtol=0, atol=0)


def test_half_precision_inference_attention_stays_in_its_dtype() -> None:
    q, k, v = qkv(torch.bfloat16, requires_grad=False)
    with torch.inference_mode():
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("dtype", "length"), [(torch.float32, 9), (torch.float16, 9), (torch.bfloat16, 256)])
def test_float32_fp16_and_long_bf16_attention_is_plain_sdpa(dtype: torch.dtype, length: int) -> None:
    q, k, v = qkv(dtype, requires_grad=True, length=length)
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_prefix_attention_with_half_precision_grads_matches_float32() -> None:
    """The trainer's shared-prefix attention takes the same float32 path (a boolean mask)."""
    q, k, v = qkv(torch.bfloat16, requires_grad=True)
    k_prefix, v_prefix = (t[:1, :, :5].detach().clone().requires_grad_() for t in (k, v))
    mask = prefix_mask(5, 9, "cpu")
    out = attend_after_prefix(q, k, v, k_prefix, v_prefix, mask)
    assert out.dtype == torch.bfloat16
    reference = attend_after_prefix(*(t.detach().float() for t in (q, k, v, k_prefix, v_prefix)), mask).to(
        torch.bfloat16
    )
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v, k_prefix, v_prefix))


def test_bf16_model_trains_with_finite_gradients_close_to_float32() -> None:
    model32 = build_model("test", seed=3)
    model16 = build_model("test", seed=3, dtype=torch.bfloat16)
    tokens = torch.randint(0, model32.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    for model in (model32, model16):
        model(tokens).float().logsumexp(-1).mean().backward()
    grad32 = model32.model.layers[0].self_attn.q_proj.weight.grad
    grad16 = model16.model.layers[0].self_attn.q_proj.weight.grad
    assert grad16.dtype == torch.bfloat16 and torch.isfinite(grad16).all()
    torch.testing.assert_close(grad16.float(), grad32, rtol=0.1, atol=2e-3)


def test_training_attention_under_autocast_runs_in_float32() -> None:
    """The trainer's one-process bf16 runs the model under autocast: the attention's inputs may be
    float32 (RoPE in float32) or bf16 (a linear's output); either way it is computed in float32
    and handed on in bf16, as autocast would."""
    q, k, v = qkv(torch.float32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = scaled_dot_product_attention(q, k.bfloat16(), v, is_causal=True)
    assert out.dtype == torch.bfloat16
    expected = F.scaled_dot_product_attention(q, k.bfloat16().float(), v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("device", "dtype", "amx", "layout"),
    [
        ("cpu", torch.bfloat16, False, "ds"),
        ("cpu", torch.float16, False, "ds"),
        ("cpu", torch.bfloat16, True, "sd"),
        ("cpu", torch.float32, False, "sd"),
        ("cuda", torch.bfloat16, False, "sd"),
    ],
)
def test_default_key_layout_avoids_slow_half_precision_sdpa_on_cpus_without_amx(
    monkeypatch, device, dtype, amx, layout
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert default_key_layout(torch.device(device), dtype) == layout
    if device == "cpu":
        cache = KVCache(ModelConfig.named("test"), 2, 16, dtype=dtype, device=device)
        assert cache.key_layout == layout
