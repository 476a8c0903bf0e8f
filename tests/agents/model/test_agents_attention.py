"""The model's attention entry point: on CPU a bf16 attention of < 256 queries that will be
differentiated runs as `matmul_attention` (bf16 matmuls, float32 softmax; torch's CPU flash kernel
is slow there), or as float32 SDPA when its scores would be too large; a bf16 inference attention
on a CPU without AMX runs as `matmul_attention` in pieces of rows; float32, fp16 and longer rows
are plain SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import toolgym.agents.model.attention as attention_module
from toolgym.agents.model.attention import matmul_attention, scaled_dot_product_attention
from toolgym.agents.model.prefix_attention import attend_after_prefix, prefix_mask
from toolgym.agents.model.transformer import build_model


def qkv(dtype: torch.dtype, requires_grad: bool, seed: int = 0, length: int = 9) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 4, length, 32), (3, 2, length, 32), (3, 2, length, 32)]  # GQA: 4 query heads, 2 kv
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(requires_grad) for s in shapes]


def float64_attention_and_grads(q, k, v, grad_out, **kwargs):
    """The exact attention of the same (rounded) inputs, and its input gradients, in float64."""
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*exact, enable_gqa=True, **kwargs)
    return out, torch.autograd.grad(out, exact, grad_out.double())


@pytest.mark.parametrize("length", [9, 100])
def test_bf16_training_attention_runs_as_matmuls_within_bf16_rounding(monkeypatch, length: int) -> None:
    called = []
    monkeypatch.setattr(
        attention_module, "matmul_attention", lambda *a, **k: called.append(1) or matmul_attention(*a, **k)
    )
    dtype = torch.bfloat16
    q, k, v = qkv(dtype, requires_grad=True, length=length)
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert called and out.dtype == dtype
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    # bf16 rounding of the scores and probabilities: ~1.3e-2 here (float32 flash then bf16: ~8e-3).
    expected, expected_grads = float64_attention_and_grads(q, k, v, grad_out, is_causal=True)
    torch.testing.assert_close(out.double(), expected, rtol=0.02, atol=0.03)
    for grad, reference in zip(grads, expected_grads, strict=True):
        assert grad.dtype == dtype
        torch.testing.assert_close(grad.double(), reference, rtol=0.02, atol=0.03)


def test_bf16_training_attention_past_the_score_bound_runs_in_float32(monkeypatch) -> None:
    monkeypatch.setattr(attention_module, "MATMUL_ATTENTION_MAX_SCORES", 3 * 4 * 9 * 9 - 1)
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


@pytest.mark.parametrize("mask_kind", ["causal", "prefix", "per_row_bool", "additive", "none"])
def test_matmul_attention_in_float32_matches_sdpa(mask_kind: str) -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 9, 32, generator=g, requires_grad=True)
    k, v = (torch.randn(3, 2, 14 if mask_kind != "causal" else 9, 32, generator=g) for _ in range(2))
    kwargs = {
        "causal": {"is_causal": True},
        "prefix": {"attn_mask": prefix_mask(5, 9, "cpu")},
        "per_row_bool": {"attn_mask": torch.rand(3, 1, 9, 14, generator=g) < 0.7},
        "additive": {"attn_mask": torch.randn(3, 4, 9, 14, generator=g)},
        "none": {},
    }[mask_kind]
    if mask_kind == "per_row_bool":
        kwargs["attn_mask"][..., 0] = True  # no row with every key masked (SDPA gives NaN there)
    out = matmul_attention(q, k, v, **kwargs)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad_out = torch.randn(out.shape, generator=g)
    grad, expected_grad = (torch.autograd.grad(o, q, grad_out)[0] for o in (out, expected))
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)


def test_matmul_attention_row_with_every_key_masked_is_finite() -> None:
    q, k, v = qkv(torch.float32, requires_grad=False)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    mask[3] = False
    out = matmul_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :, 3], v.mean(2).repeat_interleave(2, dim=1))


@pytest.mark.parametrize("mask_kind", ["causal", "prefix", "per_row_bool"])
def test_bf16_inference_attention_without_amx_runs_as_matmuls_in_pieces(monkeypatch, mask_kind: str) -> None:
    """The engine's prefills: pieces of rows whose scores fit MATMUL_INFERENCE_CHUNK_SCORES, each
    the matmul attention of its rows, so the result is the whole batch's matmul attention."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    pieces = []
    monkeypatch.setattr(
        attention_module,
        "matmul_attention",
        lambda q, *a, **k: pieces.append(q.shape[0]) or matmul_attention(q, *a, **k),
    )
    monkeypatch.setattr(attention_module, "MATMUL_INFERENCE_CHUNK_SCORES", 4 * 9 * 14)  # one row a piece
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 4, 9, 32, generator=g).bfloat16()
    k, v = (
        torch.randn(3, 2, 9 if mask_kind == "causal" else 14, 32, generator=g).bfloat16() for _ in range(2)
    )
    kwargs = {
        "causal": {"is_causal": True},
        "prefix": {"attn_mask": prefix_mask(5, 9, "cpu")},
        "per_row_bool": {"attn_mask": torch.rand(3, 1, 9, 14, generator=g) < 0.7},
    }[mask_kind]
    if mask_kind == "per_row_bool":
        kwargs["attn_mask"][..., 0] = True
    with torch.inference_mode():
        out = scaled_dot_product_attention(q, k, v, **kwargs)
    assert pieces == [1, 1, 1] and out.dtype == torch.bfloat16
    whole = matmul_attention(q, k, v, **kwargs)
    torch.testing.assert_close(out, whole, rtol=0, atol=0)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True, **kwargs)
    torch.testing.assert_close(out.double(), exact, rtol=0.02, atol=0.03)


@pytest.mark.parametrize(
    ("amx", "dtype", "piece_scores"),
    [
        (True, torch.bfloat16, 1 << 19),
        (False, torch.float16, 1 << 19),
        (False, torch.bfloat16, 4 * 9 * 9 - 1),
    ],
    ids=["amx", "fp16", "row_past_the_piece_size"],
)
def test_other_half_precision_inference_attention_stays_sdpa_in_its_dtype(
    monkeypatch, amx: bool, dtype: torch.dtype, piece_scores: int
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(attention_module, "MATMUL_INFERENCE_CHUNK_SCORES", piece_scores)
    q, k, v = qkv(dtype, requires_grad=False)
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


def test_prefix_attention_with_half_precision_grads_matches_float64() -> None:
    """The trainer's shared-prefix attention takes the same matmul path (a boolean mask)."""
    q, k, v = qkv(torch.bfloat16, requires_grad=True)
    k_prefix, v_prefix = (t[:1, :, :5].detach().clone().requires_grad_() for t in (k, v))
    mask = prefix_mask(5, 9, "cpu")
    out = attend_after_prefix(q, k, v, k_prefix, v_prefix, mask)
    assert out.dtype == torch.bfloat16
    exact = [t.detach().double() for t in (q, k, v, k_prefix, v_prefix)]
    reference = attend_after_prefix(*exact, mask)
    torch.testing.assert_close(out.double(), reference, rtol=0.02, atol=0.03)
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


def test_training_attention_under_autocast_runs_in_bf16() -> None:
    """The trainer's one-process bf16 runs the model under autocast: the attention's inputs may be
    float32 (RoPE in float32) or bf16 (a linear's output); either way its matmuls run in bf16 and
    it is handed on in bf16, as autocast would."""
    q, k, v = qkv(torch.float32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = scaled_dot_product_attention(q, k.bfloat16(), v, is_causal=True)
    assert out.dtype == torch.bfloat16
    expected = matmul_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
