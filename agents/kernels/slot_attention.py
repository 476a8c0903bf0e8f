"""The `CacheAttention` (agents/model/forward.py) of a kernel that reads the KV cache's slots in
place, one row of a forward per slot: what vLLM's paged kernel (agents/kernels/paged_attention.py)
and SGLang's kernels (agents/kernels/sglang_attention.py) share.

A decode step's tokens go through the kernel's `decode` (which writes their k/v and attends); a
prefill's or a continue's new k/v are written into the slots first (`write_new_tokens`), then the
kernel's `extend` attends each row's new queries over its slot, or `attend_slots` attends the one
query a row that a prefill's last layer keeps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar, cast

import torch

from ..model.forward import ForwardBatch, write_new_tokens

Rows = TypeVar("Rows")  # the kernel's description of a decode step's rows (`decode_rows`)


class SlotKernelAttention(ABC, Generic[Rows]):
    """`plan_decode` and `attend` over a kernel's four calls. Subclasses hold the cache's k and v
    ([layers, slots + 1, ...]) and `slot_ids` (the attended slots, 0..slots-1)."""

    k: torch.Tensor
    v: torch.Tensor
    slot_ids: torch.Tensor

    @abstractmethod
    def decode_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> Rows:
        """One new token per row at `positions` [n] of `slots` [n]: where it goes, how far it reads."""

    @abstractmethod
    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows) -> torch.Tensor:
        """q [n, H, D], k/v [n, Hkv, D]: write each row's k/v and attend -> [n, H, D]."""

    @abstractmethod
    def attend_slots(
        self, layer: int, q: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """q [n, H, D]: row i over the first lengths[i] positions of slot slots[i] -> [n, H, D]."""

    @abstractmethod
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
        """q [B, H, T, D]: row i's new queries over the first prefix_lens[i] positions of slot
        slots[i] and, causally, its own new k/v [B, Hkv, T, D] (already in the slot); new_lens[i]:
        row i's real tokens (the rest are padding; None: all T) -> like q."""

    def plan_decode(self, positions: torch.Tensor, span: int) -> Rows:
        """A decode step of slots 0..n-1 at `positions` [n]: every row attends over its own
        length (no span, no mask)."""
        return self.decode_rows(self.slot_ids[: positions.shape[0]], positions)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward: ForwardBatch
    ) -> torch.Tensor:
        """`CacheAttention.attend` (see the module doc)."""
        if forward.kind == "decode":
            n, heads, _, d = q.shape  # one token a row: [n, heads, 1, D] -> the kernel's [n, heads, D]
            rows = cast(Rows, forward.plan)
            return self.decode(layer, q.reshape(n, heads, d), k.reshape(n, -1, d), v.reshape(n, -1, d), rows)[
                :, :, None
            ]
        write_new_tokens(self.k, self.v, layer, k, v, forward)
        slots, prefix_lens = forward.slot_rows(k.shape[0])
        if q.shape[2] != k.shape[2]:  # a prefill's last layer: the kept query of each row
            n, heads, _, d = q.shape
            assert forward.kept_lens is not None
            return self.attend_slots(layer, q.reshape(n, heads, d), slots, forward.kept_lens)[:, :, None]
        return self.extend(layer, q, k, v, slots, prefix_lens, forward.new_lens)
