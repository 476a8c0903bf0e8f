"""One inference forward over the engine's KV cache, described once: `ForwardBatch`, and the one
protocol every attention over that cache implements: `CacheAttention`.

The engine (agents/engine/cache_attention.py `Forwards`) builds a `ForwardBatch` per forward (a
prefill, a continue, a decode step) and passes it to the model as its `cache=`; each layer calls
`forward.attend(layer, q, k, v)`, which hands the batch to its `CacheAttention`: torch's
(agents/engine/cache_attention.py) or vLLM's kernels (agents/kernels/sglang_attention.py,
agents/kernels/paged_attention.py). The batch is immutable and holds everything that is the same
for every layer (slots, positions, masks, write offsets), so a layer allocates nothing to learn
where its tokens go. It lives here, in model/, so that both engine/ and kernels/ can read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

ForwardKind = Literal["prefill", "continue", "decode"]
KeyLayout = Literal["sd", "ds"]


class CacheAttention(Protocol):
    """Attention over the engine's KV cache for one `ForwardBatch`."""

    def plan_decode(self, positions: torch.Tensor, span: int) -> object:
        """What a decode step of one token per slot 0..n-1 at `positions` [n] (span = max + 1)
        needs at every layer (write offsets, a mask, the kernel's rows): `ForwardBatch.plan`."""
        ...

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward: ForwardBatch
    ) -> torch.Tensor:
        """Write the new tokens' k/v [B, Hkv, T, D] (RoPE applied) into `layer`'s slots as
        `forward` says, and attend: q [B, H, T or 1, D] -> [B, H, T or 1, D]. (Attention sinks,
        `sinks=` [H], come only to torch's: the backend gives no other to a model with them.)"""
        ...


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """An immutable description of one inference forward (built by agents/engine/cache_attention.py's
    `Forwards`). Row i of the forward fills slot first_slot + i (a prefill with `source_rows`:
    slot first_slot + j is filled by row source_rows[j]); its new tokens start at prefix_len
    (prefill) or at its own history's end (continue), or are one token at positions[i] (decode).

    rope: (cos, sin) for the model. positions: [rows or 1, T] each token's position (for a RoPE
    kernel). key_layout: the cache's. Masks are boolean, True where a query may look:
    prefix_mask [1, 1, T, prefix+T] (prefill after a prefix), mask [rows, 1, T, end] (continue),
    keep_mask [rows, 1, 1, end] (the model's `keep=` layer). valid [rows, T]: a continue's real
    (not padding) tokens; k_index / v_index their flat write offsets. row_slots, prefix_lens,
    kept_lens, new_lens [rows]: each row's slot, the positions before its new tokens, how far its
    kept query reads, its new tokens (vLLM's kernels). plan: the attention's `plan_decode`.
    rotary: RoPE in place (positions, q rows, k rows), where a kernel rotates.
    windowed: this forward as the model's sliding-window layers see it (`ModelConfig.layer_window`),
    built once per forward: the same batch with each mask (and the decode plan) banded to the
    window, a prefill's prefix_mask set even without a prefix; None where no layer is windowed.
    rope_local: (cos, sin) of the layers whose RoPE has its own base (`ModelConfig.layer_rope_local`),
    None where every layer shares `rope`."""

    kind: ForwardKind
    attention: CacheAttention
    rope: tuple[torch.Tensor, torch.Tensor]
    positions: torch.Tensor
    key_layout: KeyLayout
    first_slot: int = 0
    source_rows: torch.Tensor | None = None
    prefix_len: int = 0
    end: int = 0
    prefix_mask: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    keep_mask: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    k_index: torch.Tensor | None = None
    v_index: torch.Tensor | None = None
    row_slots: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None
    kept_lens: torch.Tensor | None = None
    new_lens: torch.Tensor | None = None
    plan: object = None
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    windowed: ForwardBatch | None = None
    rope_local: tuple[torch.Tensor, torch.Tensor] | None = None

    def recur(self, layer: int, mixer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A Gated DeltaNet layer's call (agents/model/linear_attention.py): `mixer.mix` of its rows
        x [rows, T, hidden] from the state their slots keep, the state after them kept (torch's
        attention keeps it: the backend gives no other to such a model)."""
        recur = getattr(self.attention, "recur", None)
        if recur is None:
            raise RuntimeError("this forward's attention keeps no recurrent state")
        return recur(layer, mixer, x, self)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The model's call (agents/model/transformer.py `AttentionCache`): this forward's attention."""
        if sinks is None:
            return self.attention.attend(layer, q, k, v, self)
        return self.attention.attend(layer, q, k, v, self, sinks=sinks)  # type: ignore[call-arg]

    def slot_rows(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row_slots, prefix_lens) of a forward of `rows` rows: as built, or (a prefill built
        without its row count) each row's first slot and the shared prefix length."""
        if self.row_slots is not None and self.prefix_lens is not None:
            return self.row_slots, self.prefix_lens
        ids = torch.arange(rows, device=self.positions.device)
        slots = ids if self.source_rows is None else torch.searchsorted(self.source_rows, ids)
        return self.first_slot + slots, torch.full_like(ids, self.prefix_len)

    def rotate(self, qk: torch.Tensor, heads: int) -> None:
        """RoPE in place with the backend's kernel at this forward's positions: qk [B, T, heads +
        kv_heads, D] holds q then k (a view of the q/k/v GEMM's output may be passed)."""
        if self.rotary is None:
            raise RuntimeError("this forward's backend rotates with torch's RoPE (apply_rope)")
        B, T, _, d = qk.shape
        # contiguous: the kernel reads positions densely, and [1, 1] expanded to [B, 1] is a stride-0 view.
        positions = self.positions.expand(B, T).reshape(-1).contiguous()
        rows = qk.view(B * T, -1)  # a view, never a copy: the rotation must land in qk
        self.rotary(positions, rows[:, : heads * d], rows[:, heads * d :])


def write_new_tokens(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    forward: ForwardBatch,
) -> None:
    """A prefill's or a continue's new k/v [B, Hkv, T, D] into `layer` of the cache's k/v slots
    ([layers, slots, Hkv, seq, D], k transposed where forward.key_layout is "ds"). A prefill
    writes whole rows after its prefix; a continue only its real tokens (padding would run past a
    slot's end)."""
    ds = forward.key_layout == "ds"
    if forward.kind == "prefill":
        first, rows, start = forward.first_slot, forward.source_rows, forward.prefix_len
        end = start + k.shape[2]
        k_rows, v_rows = (k[rows], v[rows]) if rows is not None else (k, v)
        last = first + k_rows.shape[0]
        if ds:
            cache_k[layer, first:last, :, :, start:end] = k_rows.transpose(-1, -2)
        else:
            cache_k[layer, first:last, :, start:end] = k_rows
        cache_v[layer, first:last, :, start:end] = v_rows
        return
    assert forward.valid is not None and forward.k_index is not None and forward.v_index is not None
    d = k.shape[-1]
    cache_v[layer].view(-1, d).index_copy_(
        0, forward.v_index.view(-1), v.transpose(1, 2)[forward.valid].reshape(-1, d)
    )
    k_new = k.transpose(1, 2)[forward.valid]  # [valid, Hkv, D]
    if ds:
        cache_k[layer].view(-1).index_copy_(0, forward.k_index.view(-1), k_new.reshape(-1))
    else:
        cache_k[layer].view(-1, d).index_copy_(0, forward.k_index.view(-1), k_new.reshape(-1, d))


__all__ = ["CacheAttention", "ForwardBatch", "ForwardKind", "KeyLayout", "write_new_tokens"]
