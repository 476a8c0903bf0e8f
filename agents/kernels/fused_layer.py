"""GPU inference kernels for the engine's private model copy: fewer, fused kernels per layer.

A decode step on a GPU is launch-bound even when replayed from a CUDA graph
(agents/engine/decode.py): at Qwen2.5-0.5B's shapes, each of the ~40 kernels of a `DecoderLayer`
costs a few microseconds whatever it computes, several times the layer's memory traffic
(bench/RESULTS.md, 'bench/generate.py' on CUDA). `FusedDecoderLayer` computes the same layer in ~13:
- q/k/v are one GEMM, and gate/up one GEMM. The fused weights are not copies: the layer's own
  Parameters become views into them, so `load_weights` (which copies into the Parameters) updates
  the fused GEMMs with nothing to repack;
- the pointwise work between the GEMMs is one kernel each, compiled by `torch.compile` (on CUDA;
  on CPU the same functions run eagerly, which is what the tests compare): the input norm; the
  split of q/k/v with Qwen3's head norms and RoPE; the residual add with the next norm; SwiGLU.
Results are the layer's up to bf16 rounding (a compiled kernel rounds once where eager rounds
after each op).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..model.transformer import (
    AttentionCache,
    DecoderLayer,
    RMSNorm,
    Transformer,
    apply_rope,
    attend_rows,
    rms_norm,
)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta)): a residual add and the norm that reads its result."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def split_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
):
    """qkv [B, T, heads + 2 kv_heads, D] -> contiguous q, k (head-normed for Qwen3, rotated) and v."""
    q, k, v = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads], qkv[:, :, heads + kv_heads :]
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the fused gate/up GEMM's output: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Kernels(NamedTuple):
    rms_norm: Callable[..., Any]
    add_rms_norm: Callable[..., Any]
    split_qkv: Callable[..., Any]
    silu_mul: Callable[..., Any]


@functools.cache
def kernels(compiled: bool) -> Kernels:
    """The pointwise functions, each compiled once (dynamic shapes: one kernel serves every batch
    and span) and shared by every layer; or the eager functions."""
    functions = Kernels(rms_norm, add_rms_norm, split_qkv, silu_mul)
    if not compiled:
        return functions
    return Kernels(*(torch.compile(f, dynamic=True) for f in functions))


def _fuse_rows(params: list[torch.Tensor]) -> torch.Tensor:
    """One tensor holding `params` stacked along dim 0; each Parameter becomes a view into it."""
    fused = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = fused[start : start + p.shape[0]]
        start += p.shape[0]
    return fused


class FusedNorm(nn.Module):
    """An RMSNorm computed by the compiled kernel (same `weight` Parameter, same name)."""

    def __init__(self, norm: RMSNorm, compiled: bool) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon
        self.kernels = kernels(compiled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.variance_epsilon)


class FusedDecoderLayer(nn.Module):
    """A DecoderLayer in 5 GEMMs, 4 fused pointwise kernels and the attention (see the module doc).
    The layer's modules stay children (the same Parameters under the same names) but are not called."""

    def __init__(self, layer: DecoderLayer, compiled: bool) -> None:
        super().__init__()
        self.self_attn, self.mlp = layer.self_attn, layer.dense_mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        attention, mlp = layer.self_attn, layer.dense_mlp
        self.layer_idx, self.head_dim = attention.layer_idx, attention.head_dim
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.eps = layer.input_layernorm.variance_epsilon
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        with torch.no_grad():
            self.qkv_weight = _fuse_rows([p.weight for p in projections])
            self.qkv_bias = None
            if attention.q_proj.bias is not None:
                self.qkv_bias = _fuse_rows([p.bias for p in projections])
            self.gate_up_weight = _fuse_rows([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.head_norms = hasattr(attention, "q_norm")  # Qwen3
        self.kernels = kernels(compiled)

    def forward(
        self, x: torch.Tensor, cos, sin, cache: AttentionCache | None = None, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As DecoderLayer.forward."""
        fused = self.kernels
        B, T, _ = x.shape
        normed = fused.rms_norm(x, self.input_layernorm.weight, self.eps)
        qkv = F.linear(normed, self.qkv_weight, self.qkv_bias).view(B, T, -1, self.head_dim)
        attention = self.self_attn
        q_norm, k_norm = (
            (attention.q_norm.weight, attention.k_norm.weight) if self.head_norms else (None, None)
        )
        q, k, v = fused.split_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads, q_norm, k_norm, self.eps)
        attended, x = attend_rows(q, k, v, x, self.layer_idx, cache, keep, self.self_attn.window)
        o_proj = attention.o_proj
        x, normed = fused.add_rms_norm(
            x, F.linear(attended, o_proj.weight, o_proj.bias), self.post_attention_layernorm.weight, self.eps
        )
        return x + F.linear(fused.silu_mul(F.linear(normed, self.gate_up_weight)), self.mlp.down_proj.weight)


def fuse_model(model: Transformer, compiled: bool) -> None:
    """Swap every decoder layer and the final norm of `model` for their fused forms, in place
    (inference only). compiled: torch.compile the pointwise kernels (CUDA)."""
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = FusedDecoderLayer(cast(DecoderLayer, layer), compiled)
    # The fused form stands in for the declared RMSNorm (same Parameter, same name).
    model.model.norm = FusedNorm(model.model.norm, compiled)  # pyright: ignore[reportAttributeAccessIssue]


__all__ = ["FusedDecoderLayer", "FusedNorm", "fuse_model", "kernels"]
