"""Routing recorded by the torch engine: which experts a mixture of experts sent each position to.

With `TorchEngine(record_routes=True)` every MoE block keeps its last forward's chosen experts
(agents/model/moe.py `keep_routes`), and after each forward the recorder writes them into the KV
cache's routes beside the k/v of the same positions (agents/engine/kv_cache.py), so the prefix
store, the history pool and slot moves carry them as they carry k/v. When a sample finishes, its
slot's routes for every position the model ran (the prompt and each sampled token but the last)
become `Completion.routes`; the trainer replays them (TrainerConfig.replay_routes) so that its
forward sends every token to the experts the sampler did.

Where a forward keeps one query per row (a prefill's last layer runs its MLP at each row's last
prompt position only), the positions it skipped are left -1 for that layer: their output there
feeds no sampled token, and the trainer routes them itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..model.moe import moe_blocks
from ..model.transformer import Transformer
from ..types import Routes
from .kv_cache import KVCache


class RouteRecorder:
    """Writes each forward's chosen experts into `cache.routes` (module doc). `cache` must hold
    routes of shape (len(moe_blocks(model)), top_k)."""

    def __init__(self, model: Transformer, cache: KVCache) -> None:
        self.blocks = moe_blocks(model)
        if not self.blocks:
            raise ValueError(
                f"{model.config.model_type} has no mixture-of-experts layers: no routes to record"
            )
        if cache.routes is None:
            raise ValueError("the KV cache keeps no routes (KVCache(routes=...))")
        self.cache, self.top_k = cache, self.blocks[0].top_k
        for block in self.blocks:
            block.keep_routes = True

    @staticmethod
    def shape(model: Transformer) -> tuple[int, int] | None:
        """(MoE layers, top_k) of `model`'s routes, None for a model without MoE layers."""
        blocks = moe_blocks(model)
        return (len(blocks), blocks[0].top_k) if blocks else None

    def _taken(self) -> list[torch.Tensor]:
        """Each block's chosen experts of the forward that just ran, then forgotten (a block that
        did not run, e.g. a kernel path without the module's forward, is an error here)."""
        taken = []
        for layer, block in enumerate(self.blocks):
            if block.routes is None:
                raise RuntimeError(
                    f"MoE layer {layer} recorded no routes: this forward does not run the module path"
                )
            taken.append(block.routes.to(torch.int16))
            block.routes = None
        return taken

    def prefill(
        self,
        first_slot: int,
        slot_rows: torch.Tensor | None,
        rows: int,
        start: int,
        width: int,
        keep: torch.Tensor | None,
    ) -> None:
        """A prefill of `rows` rows of `width` tokens at positions start.. ; slot first_slot + i
        holds row slot_rows[i] (None: row i); keep [rows]: the model's `keep=` (row positions)."""
        device = self.cache.routes.device  # type: ignore[union-attr]
        source = torch.arange(rows, device=device) if slot_rows is None else slot_rows.to(device)
        slots = first_slot + torch.arange(source.shape[0], device=device)
        # Each slot's rows: [slots, width] of (row, column) -> flat row index row * width + column.
        columns = torch.arange(width, device=device)
        flat_slots = slots[:, None].expand(-1, width).reshape(-1)
        flat_positions = (start + columns).expand(source.shape[0], -1).reshape(-1)
        order = (source[:, None] * width + columns).reshape(-1)
        kept = None
        if keep is not None:
            kept = (slots, start + keep.to(device)[source])
        self._write_rows(order, flat_slots, flat_positions, kept, source, rows)

    def _write_rows(
        self,
        order: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        kept: tuple[torch.Tensor, torch.Tensor] | None,
        kept_rows: torch.Tensor,
        rows: int,
    ) -> None:
        """Block rows order[i] at (slots[i], positions[i]); a kept-query block's row kept_rows[j]
        at kept's (slot j, position j); `rows` rows in a kept-query block's forward."""
        routes = self.cache.routes
        assert routes is not None
        full = int(order.max()) + 1 if order.numel() else 0
        for layer, chosen in enumerate(self._taken()):
            if kept is not None and chosen.shape[0] == rows and rows != full:
                routes[slots, positions, layer] = -1  # not what an earlier sequence there left
                routes[kept[0], kept[1], layer] = chosen[kept_rows]
            elif chosen.shape[0] >= full:
                routes[slots, positions, layer] = chosen[order]
            else:
                raise RuntimeError(f"MoE layer {layer} routed {chosen.shape[0]} rows, the forward ran {full}")

    def continue_(self, first_slot: int, history: Sequence[int], own: Sequence[int]) -> None:
        """Rows continuing their slot's history (agents/engine/cache_attention.py `continue_`):
        row i's own[i] new tokens, right-padded to max(own), at positions history[i].. ; the
        model kept each row's last new token in its last layer."""
        device = self.cache.routes.device  # type: ignore[union-attr]
        rows, width = len(own), max(own)
        offsets = torch.arange(width, device=device)
        valid = offsets[None, :] < torch.tensor(list(own), device=device)[:, None]
        start = torch.tensor(list(history), device=device)
        row_of = torch.arange(rows, device=device)[:, None].expand(-1, width)
        order = (row_of * width + offsets)[valid]
        slots = first_slot + row_of[valid]
        positions = (start[:, None] + offsets)[valid]
        last = start + torch.tensor(list(own), device=device) - 1
        kept = (first_slot + torch.arange(rows, device=device), last)
        self._write_rows(order, slots, positions, kept, torch.arange(rows, device=device), rows)

    def decode(self, n: int, positions: torch.Tensor) -> None:
        """A decode step of slots 0..n-1 at `positions` [>= n] (rows past n are padding)."""
        device = self.cache.routes.device  # type: ignore[union-attr]
        rows = torch.arange(n, device=device)
        self._write_rows(rows, rows, positions[:n].to(device), None, rows, n)

    def read(self, slot: int, length: int) -> Routes:
        """Slot `slot`'s routes of positions 0..length-1."""
        routes = self.cache.routes
        assert routes is not None
        return Routes.of(routes[slot, :length].cpu().numpy())


__all__ = ["RouteRecorder"]
