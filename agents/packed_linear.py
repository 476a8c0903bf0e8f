"""CPU inference kernels for the engine's private model copy: oneDNN pre-packed linears.

oneDNN's linear with a weight reordered once into its blocked layout (what torch.compile's CPU
backend uses) runs the engine's shapes 10-45% faster than torch's default float32 GEMM, and
fuses the SwiGLU pointwise work into the GEMMs: silu(gate(x)) as the gate GEMM's post-op, the
`* up(x)` as the up GEMM's binary post-op. q/k/v are one packed GEMM whose q and k columns get
RoPE in one pass. Results are float32-exact up to summation order.

The packed weight is a copy, so `repack(model)` must run after the parameters change (the
engine's `load_weights` does). Parameter names and `state_dict()` are untouched: the packed
modules hold the very same `weight`/`bias` Parameters under the same names.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .model import MLP, Attention, Transformer, apply_rope, rope_at


def packing_available(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN packing on this build, device (CPU only) and CPU for `dtype`: oneDNN's bf16/fp16
    linears need AVX-512 (bw/vl/dq) or AVX-NE-CONVERT, which an AVX2-only CPU lacks."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    ops = getattr(torch.ops, "mkldnn", None)
    if ops is None or not (hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return bool(ops._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(ops._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def resolve_packing(device: torch.device, dtype: torch.dtype, requested: bool | None) -> bool:
    """The engine's `pack_weights` decision: None picks packing where it is available; True where
    it is not is an error. Either way, a CPU dtype without fast kernels gets a warning (it works,
    but its matmuls run 6-75x slower than float32 there: bench/RESULTS.md)."""
    available = packing_available(device, dtype)
    if requested and not available:
        raise ValueError(
            f"pack_weights=True: oneDNN packed linears are not available for {dtype} on {device} "
            "(bf16/fp16 need AVX-512 or AVX-NE-CONVERT); pass pack_weights=None to pick automatically"
        )
    if device.type == "cpu" and dtype != torch.float32 and not available:
        warnings.warn(
            f"TorchEngine: {dtype} matmuls on this CPU have no fast kernels (no AVX-512 BF16/FP16, "
            "AMX or AVX-NE-CONVERT) and run several times slower than float32; use float32 here",
            stacklevel=3,
        )
    return available if requested is None else requested


def _pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


class PackedLinear(nn.Module):
    """nn.Linear's parameters, computed with a oneDNN-packed copy of the weight."""

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.batch_hint = batch_hint
        self.repack()

    def repack(self) -> None:
        self.packed = _pack(self.weight, self.batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PackedMLP(nn.Module):
    """SwiGLU with the pointwise work fused into the packed GEMMs' post-ops."""

    def __init__(self, mlp: MLP, batch_hint: int) -> None:
        super().__init__()
        self.gate_proj = PackedLinear(mlp.gate_proj, batch_hint)
        self.up_proj = PackedLinear(mlp.up_proj, batch_hint)
        self.down_proj = PackedLinear(mlp.down_proj, batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = torch.ops.mkldnn._linear_pointwise
        gate = linear(x, self.gate_proj.packed, None, "swish", [], "")  # silu(x @ Wg^T)
        hidden = linear.binary(x, gate, self.up_proj.packed, None, "mul")  # (x @ Wu^T) * gate
        return self.down_proj(hidden)


class PackedAttention(Attention):
    """Attention whose q/k/v projections are one packed GEMM, and whose RoPE rotates q and k in
    one pass (they are adjacent columns of its output). Two GEMM calls and four small ops fewer
    per layer: 3-5% of a CPU decode step at the benchmark's shapes (bench/RESULTS.md).

    q_proj/k_proj/v_proj stay plain Linears that hold the Parameters under their names, but are
    not called; the packed weight is their concatenation (refreshed by `repack`)."""

    def __init__(self, attention: Attention, batch_hint: int) -> None:
        nn.Module.__init__(self)
        for name in ("layer_idx", "head_dim", "num_heads", "num_kv_heads"):
            setattr(self, name, getattr(attention, name))
        self.q_proj, self.k_proj, self.v_proj = attention.q_proj, attention.k_proj, attention.v_proj
        self.o_proj = PackedLinear(attention.o_proj, batch_hint)
        if hasattr(attention, "q_norm"):
            self.q_norm, self.k_norm = attention.q_norm, attention.k_norm
        self.batch_hint = batch_hint
        self.repack()

    def repack(self) -> None:
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.packed = _pack(torch.cat([p.weight for p in projections]), self.batch_hint)
        with torch.no_grad():
            biases = [p.bias for p in projections]
            self.qkv_bias = None if biases[0] is None else torch.cat(biases)

    def project(self, x: torch.Tensor, cos, sin, keep: torch.Tensor | None = None):
        B, T, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.qkv_bias, "none", [], "")
        qkv = qkv.view(B, T, heads + 2 * kv_heads, self.head_dim)
        q, k, v = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads], qkv[:, :, heads + kv_heads :]
        if keep is None and not hasattr(self, "q_norm"):
            qk = apply_rope(qkv[:, :, : heads + kv_heads], cos, sin)
            return qk[:, :, :heads], qk[:, :, heads:], v
        q_cos, q_sin = cos, sin
        if keep is not None:  # the query at position keep[b] of each row (its GEMM ran at all)
            q = q[torch.arange(B, device=x.device), keep][:, None]
            q_cos, q_sin = rope_at(cos, sin, keep)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, q_cos, q_sin), apply_rope(k, cos, sin), v


def pack_model(model: Transformer, batch_hint: int) -> None:
    """Swap every Linear, MLP and attention of `model` for its packed form, in place (inference only)."""
    for layer in model.model.layers:
        layer.mlp = PackedMLP(layer.mlp, batch_hint)
        layer.self_attn = PackedAttention(layer.self_attn, batch_hint)
    model.lm_head = PackedLinear(model.lm_head, batch_hint)


def repack(model: nn.Module) -> None:
    """Refresh every packed weight from its Parameter (after the parameters were overwritten)."""
    for module in model.modules():
        if isinstance(module, (PackedLinear, PackedAttention)):
            module.repack()


def reference_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The unpacked SwiGLU on a PackedMLP's parameters (for tests)."""
    gate = F.linear(x, mlp.gate_proj.weight)
    return F.linear(F.silu(gate) * F.linear(x, mlp.up_proj.weight), mlp.down_proj.weight)


__all__ = [
    "PackedAttention",
    "PackedLinear",
    "PackedMLP",
    "pack_model",
    "packing_available",
    "repack",
    "resolve_packing",
]
