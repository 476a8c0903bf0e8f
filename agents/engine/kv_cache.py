"""The torch engine's KV cache: preallocated k/v slots, the prefix store and the history pool.

A running sequence owns one slot; its tokens sit at positions 0..len-1 of that slot. The engine
keeps the running sequences in slots 0..n-1 (it moves the last one into a hole when a sequence
finishes), so a decode step reads the block [:n, ..., :span] in place, with no gather.

With `routes` (a mixture of experts' routing being recorded: agents/engine/routes.py), every slot,
the prefix store and the history pool also hold each position's chosen experts, int16 [positions,
MoE layers, top_k] (-1: none recorded), copied wherever that position's k/v are.

A model with Gated DeltaNet layers (Qwen3.5: `ModelConfig.layer_linear`) keeps, per slot and such
layer, the state the sequence so far left (`state` [linear layers, slots + 1, Hv, dk, dv] float32,
`conv` [linear layers, slots + 1, channels, taps - 1]) instead of anything per position: slot moves
and the prefix store copy it whole; the history pool is off for such a model (a state is kept at
one length only, a finished sample's).

Layout: v is [layers, slots, kv_heads, max_seq_len, head_dim]; k is that ("sd") or transposed,
[..., head_dim, max_seq_len] ("ds"). Which layout is the engine's `Backend`'s choice
(agents/engine/backend.py). The cache only stores: each forward's writes and attention are its
`ForwardBatch`'s and the backend's `CacheAttention`'s (agents/engine/cache_attention.py,
agents/model/forward.py).
"""

from __future__ import annotations

import torch

from ..model.config import ModelConfig
from .backend import Backend, KeyLayout


class KVCache:
    """The engine's k/v slots, prefix store and history pool for a model of `config`, laid out as
    `backend` (agents/engine/backend.py `select_backend`) says, in its dtype on its device."""

    def __init__(
        self,
        config: ModelConfig,
        max_slots: int,
        max_seq_len: int,
        backend: Backend,
        *,
        history_capacity: int = 0,
        routes: tuple[int, int] | None = None,
    ) -> None:
        layers, heads, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        dtype, device = backend.dtype, backend.device
        self.backend = backend
        self.key_layout: KeyLayout = backend.key_layout
        seq = backend.slot_length(max_seq_len)
        k_shape = (d, seq) if self.key_layout == "ds" else (seq, d)
        # One slot more than the engine runs: the prefix store (`store_prefix`, `load_prefix`).
        self.k = torch.zeros((layers, max_slots + 1, heads, *k_shape), dtype=dtype, device=device)
        self.v = torch.zeros((layers, max_slots + 1, heads, seq, d), dtype=dtype, device=device)
        self.max_slots, self.max_seq_len, self.prefix_slot = max_slots, max_seq_len, max_slots
        # Finished samples' k/v (`park`, `unpark`; agents/engine/history.py): a pool laid out like one
        # slot `history_capacity` positions long.
        self.history_capacity = history_capacity
        pool_k_shape = (d, history_capacity) if self.key_layout == "ds" else (history_capacity, d)
        self.history_k = torch.zeros((layers, heads, *pool_k_shape), dtype=dtype, device=device)
        self.history_v = torch.zeros((layers, heads, history_capacity, d), dtype=dtype, device=device)
        self.kv_heads, self.head_dim = heads, d
        # Gated DeltaNet layers: index in `state` / `conv` by decoder layer (module doc).
        linear = [i for i in range(layers) if config.layer_linear(i)]
        self.linear_index = {layer: j for j, layer in enumerate(linear)}
        self.state = self.conv = None
        if linear:
            if history_capacity:
                raise ValueError(
                    "a model with Gated DeltaNet layers keeps no history pool (history_capacity=0)"
                )
            self.state = torch.zeros(
                (len(linear), max_slots + 1, config.linear_num_value_heads, config.linear_key_head_dim,
                 config.linear_value_head_dim), dtype=torch.float32, device=device,
            )  # fmt: skip
            self.conv = torch.zeros(
                (len(linear), max_slots + 1, config.linear_conv_dim, config.linear_conv_kernel_dim - 1),
                dtype=dtype,
                device=device,
            )
        # routes = (MoE layers, top_k): each position's chosen experts (module doc), or None.
        self.routes = self.history_routes = None
        if routes is not None:
            self.routes = torch.full((max_slots + 1, seq, *routes), -1, dtype=torch.int16, device=device)
            self.history_routes = torch.full(
                (history_capacity, *routes), -1, dtype=torch.int16, device=device
            )
        # Flat offsets of (slot, head, position 0) in a layer's [slots*heads*seq, D] view, and of
        # (slot, head, dim, position 0) in a "ds" layer's flat view: where a forward writes.
        self.row_base = torch.arange(max_slots * heads, device=device).view(max_slots, -1) * seq
        self.dim_base = torch.arange(max_slots * heads * d, device=device).view(max_slots, -1) * seq

    @property
    def nbytes(self) -> int:
        """Bytes of the slots (the prefix store's included) and the history pool together."""
        states = sum(t.numel() * t.element_size() for t in (self.state, self.conv) if t is not None)
        return (self.k.numel() + self.v.numel()) * self.k.element_size() + self.history_nbytes + states

    @property
    def history_nbytes(self) -> int:
        return (self.history_k.numel() + self.history_v.numel()) * self.history_k.element_size()

    def move_slot(self, source: int, target: int, length: int) -> None:
        """Copy a running sequence's first `length` positions from slot `source` to `target`."""
        self._copy_positions(self._slots(target), slice(0, length), self._slots(source), slice(0, length))
        self._copy_states(slice(target, target + 1), source)

    # ---- the prefix store: a prompt prefix computed once, reused by later prefills --------------
    def store_prefix(self, slot: int, length: int) -> None:
        """Keep the first `length` positions of `slot` (a prefix just prefilled there)."""
        self._copy_positions(
            self._slots(self.prefix_slot), slice(0, length), self._slots(slot), slice(0, length)
        )
        self._copy_states(slice(self.prefix_slot, self.prefix_slot + 1), slot)

    def load_prefix(self, first_slot: int, count: int, length: int) -> None:
        """Fill positions 0..length-1 of slots first_slot..first_slot+count-1 from the store."""
        store = self._slots(self.prefix_slot, self.prefix_slot + 1)  # broadcast over the count slots
        self._copy_positions(
            self._slots(first_slot, first_slot + count), slice(0, length), store, slice(0, length)
        )
        self._copy_states(slice(first_slot, first_slot + count), self.prefix_slot)

    # ---- the history pool: a finished sample's k/v, for its conversation's next turn ----------
    def park(self, slot: int, start: int, length: int) -> None:
        """Keep the first `length` positions of running `slot` at pool positions start.. ."""
        pool = (self.history_k, self.history_v, self.history_routes)
        self._copy_positions(pool, slice(start, start + length), self._slots(slot), slice(0, length))

    def unpark(self, start: int, slot: int, length: int) -> None:
        """Copy pool positions start..start+length-1 back into positions 0.. of running `slot`."""
        pool = (self.history_k, self.history_v, self.history_routes)
        self._copy_positions(self._slots(slot), slice(0, length), pool, slice(start, start + length))

    def _slots(self, first: int, end: int | None = None) -> tuple:
        """(k, v, routes) views of slot `first` (end None: that slot's axis dropped) or slots
        first..end-1 (routes None when not recorded)."""
        index = first if end is None else slice(first, end)
        return self.k[:, index], self.v[:, index], None if self.routes is None else self.routes[index]

    def _copy_states(self, targets: slice, source: int) -> None:
        """The Gated DeltaNet layers' state and conv window of slot `source` into slots `targets`."""
        for kept in (self.state, self.conv):
            if kept is not None:
                kept[:, targets] = kept[:, source : source + 1]

    def _copy_positions(self, dst: tuple, dst_positions: slice, src: tuple, src_positions: slice) -> None:
        """Copy (k, v, routes) positions between slot views and the pool; a position is the last
        axis of a "ds" key, the second-to-last of every other k/v tensor and the third-to-last of
        the routes."""
        (dst_k, dst_v, dst_routes), (src_k, src_v, src_routes) = dst, src
        if self.key_layout == "ds":
            dst_k[..., dst_positions] = src_k[..., src_positions]
        else:
            dst_k[..., dst_positions, :] = src_k[..., src_positions, :]
        dst_v[..., dst_positions, :] = src_v[..., src_positions, :]
        if dst_routes is not None:
            dst_routes[..., dst_positions, :, :] = src_routes[..., src_positions, :, :]
