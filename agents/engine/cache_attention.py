"""Each forward over the KV cache described once (`Forwards`), and torch's attention over it.

`Forwards` builds the immutable `ForwardBatch` (agents/model/forward.py) of each forward, which
the model receives as its `cache=` and hands, layer by layer, to the backend's `CacheAttention`:
- prefill: fresh prompts (right-padded to one length) attend causally among themselves; their
  k/v are written to their slots (one source row may fill several slots: n samples, one prefill).
  When the prompts share a prefix, the engine prefills it once as one row that fills every slot
  (or copies it from the prefix store), then the rows' own tokens with `prefix_len` set: they are
  written after the prefix and attend to it (agents/model/prefix_attention.py) and causally to
  themselves;
- continue: prompts that extend a finished sample's conversation (agents/engine/history.py) find its
  k/v copied back into their slots (`KVCache.unpark`); only their new tokens run, written after
  each slot's own history and attending to it and causally to themselves;
- decode: one new token per running slot is written at that slot's position, then it attends
  over positions 0..pos of its own slot (an additive mask hides the rest of the span).
A model with sliding-window layers (`ModelConfig.layer_window`) gets each forward's masks twice,
built once per forward: the full ones, and in `ForwardBatch.windowed` the same banded to the
window (a query at p sees keys p - window + 1 .. p); a windowed layer attends with the latter.

`TorchCacheAttention` is torch's attention: agents/model/attention.py's
`scaled_dot_product_attention` for new tokens (explicit matmuls where the backend says
`matmul_attention`), SDPA over an "sd" cache or batched matmuls over a "ds" one for a decode
step. vLLM's kernels implement the same protocol in agents/kernels/ (the backend picks).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..model.attention import scaled_dot_product_attention, sliding_causal_mask
from ..model.config import ModelConfig
from ..model.forward import CacheAttention, ForwardBatch, write_new_tokens
from ..model.prefix_attention import attend_after_prefix, prefix_mask
from ..model.transformer import rope_cos_sin
from .backend import Backend
from .kv_cache import KVCache


class TorchDecodePlan:
    """A torch decode step's per-layer constants: flat write offsets of each row's new k and v,
    and the additive mask (-inf after each row's own position)."""

    __slots__ = ("bias", "k_index", "v_index")

    def __init__(self, k_index: torch.Tensor, v_index: torch.Tensor, bias: torch.Tensor) -> None:
        self.k_index, self.v_index, self.bias = k_index, v_index, bias


class TorchCacheAttention:
    """torch's attention over `cache` (a `CacheAttention`). matmul: new tokens' attention as
    explicit matmuls (agents/model/attention.py)."""

    def __init__(self, cache: KVCache, config: ModelConfig, matmul: bool) -> None:
        self.cache, self.matmul = cache, matmul
        self.kv_heads, self.head_dim = cache.kv_heads, cache.head_dim
        self.groups = config.num_attention_heads // cache.kv_heads
        self.scale = cache.head_dim**-0.5
        self.windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]

    def plan_decode(self, positions: torch.Tensor, span: int, window: int | None = None) -> TorchDecodePlan:
        cache = self.cache
        n = positions.shape[0]
        rows = (cache.row_base[:n] + positions[:, None]).view(-1)
        k_index = rows if cache.key_layout == "sd" else (cache.dim_base[:n] + positions[:, None]).view(-1)
        # Additive mask: positions after the slot's own are -inf (and, with a sliding window, those
        # `window` or more before it). [n, 1, 1, span] for SDPA ("sd"), [n*Hkv, 1, span] for the
        # batched matmuls ("ds").
        cols = torch.arange(span, device=positions.device)
        future = cols[None, :] > positions[:, None]
        if window is not None:
            future = future | (cols[None, :] <= positions[:, None] - window)
        if cache.key_layout == "ds":
            future = future.repeat_interleave(self.kv_heads, dim=0)[:, None]
        else:
            future = future[:, None, None]
        bias = torch.zeros(future.shape, dtype=cache.k.dtype, device=cache.k.device).masked_fill_(
            future, float("-inf")
        )
        return TorchDecodePlan(k_index, rows, bias)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.windows[layer] is not None:
            assert forward.windowed is not None, "a windowed layer's forward carries its banded masks"
            forward = forward.windowed
        if forward.kind == "decode":
            return self._decode(layer, q, k, v, forward.plan, sinks)  # type: ignore[arg-type]
        write_new_tokens(self.cache.k, self.cache.v, layer, k, v, forward)
        if forward.kind == "prefill":
            return self._prefill(layer, q, k, v, forward, sinks)
        return self._continue(layer, q, k, forward, sinks)

    def recur(self, layer: int, mixer, x: torch.Tensor, forward: ForwardBatch) -> torch.Tensor:
        """A Gated DeltaNet layer's rows x [rows, T, hidden] (agents/model/linear_attention.py
        `mix`) from their slots' kept state, the state after each row's own tokens kept in the
        slots it fills: a decode step's row i is slot i; a prefill's rows start from the shared
        prefix's state (every slot of the prefill holds it) or from zero, and `kept_lens` says
        where each row's tokens end (padding after)."""
        cache = self.cache
        assert cache.state is not None and cache.conv is not None
        j = cache.linear_index[layer]
        if forward.kind == "decode":
            rows = x.shape[0]
            out, window, state = mixer.mix(x, cache.conv[j, :rows], cache.state[j, :rows])
            cache.conv[j, :rows], cache.state[j, :rows] = window, state
            return out
        if forward.kind != "prefill" or forward.kept_lens is None:
            raise RuntimeError("a Gated DeltaNet layer continues no kept history (the pool is off for it)")
        rows, first = x.shape[0], forward.first_slot
        if forward.prefix_len:
            window = cache.conv[j, first].expand(rows, -1, -1)
            state = cache.state[j, first].expand(rows, -1, -1, -1)
        else:
            window, state = mixer.initial_state(rows, x)
        out, window, state = mixer.mix(x, window, state, forward.kept_lens - forward.prefix_len)
        source = forward.source_rows
        slots = rows if source is None else source.shape[0]
        cache.conv[j, first : first + slots] = window if source is None else window[source]
        cache.state[j, first : first + slots] = state if source is None else state[source]
        return out

    def _prefill(self, layer: int, q, k, v, forward: ForwardBatch, sinks=None) -> torch.Tensor:
        first, start = forward.first_slot, forward.prefix_len
        # The model's `keep=` layer sends one query per row; every other layer sends them all.
        kept_queries = forward.keep_mask is not None and q.shape[2] != k.shape[2]
        attention = functools.partial(scaled_dot_product_attention, matmul=self.matmul, sinks=sinks)
        if not start:
            if kept_queries:
                return attention(q, k, v, attn_mask=forward.keep_mask)
            if forward.prefix_mask is not None:  # a windowed layer's band
                return attention(q, k, v, attn_mask=forward.prefix_mask)
            return attention(q, k, v, is_causal=True)
        # The prefix, as the shared-prefix prefill wrote it into every slot: read the first one.
        cache_k, cache_v = self.cache.k, self.cache.v
        if self.cache.key_layout == "ds":
            k_prefix = cache_k[layer, first : first + 1, :, :, :start].transpose(-1, -2)
        else:
            k_prefix = cache_k[layer, first : first + 1, :, :start]
        v_prefix = cache_v[layer, first : first + 1, :, :start]
        mask = forward.keep_mask if kept_queries else forward.prefix_mask
        assert mask is not None
        return attend_after_prefix(q, k, v, k_prefix, v_prefix, mask, matmul=self.matmul, sinks=sinks)

    def _continue(self, layer: int, q, k, forward: ForwardBatch, sinks=None) -> torch.Tensor:
        first, end = forward.first_slot, forward.end
        last = first + q.shape[0]
        k_layer, v_layer = self.cache.k[layer], self.cache.v[layer]
        keys = k_layer[first:last, :, :end]
        if self.cache.key_layout == "ds":
            keys = k_layer[first:last, :, :, :end].transpose(-1, -2)
        mask = forward.keep_mask if q.shape[2] != k.shape[2] else forward.mask
        values = v_layer[first:last, :, :end]
        return scaled_dot_product_attention(q, keys, values, matmul=self.matmul, sinks=sinks, attn_mask=mask)

    def _decode(self, layer: int, q, k, v, plan: TorchDecodePlan, sinks=None) -> torch.Tensor:
        # Sizes come from tensor shapes (not Python ints) so a compiled step stays shape-generic.
        n, span, heads, d = q.shape[0], plan.bias.shape[-1], self.kv_heads, self.head_dim
        k_layer, v_layer = self.cache.k[layer], self.cache.v[layer]
        v_layer.view(-1, d).index_copy_(0, plan.v_index, v.reshape(n * heads, d))
        values = v_layer[:n, :, :span]  # [n, Hkv, span, D], strided view
        if self.cache.key_layout == "sd":
            k_layer.view(-1, d).index_copy_(0, plan.k_index, k.reshape(n * heads, d))
            keys = k_layer[:n, :, :span]
            if sinks is not None:
                return scaled_dot_product_attention(q, keys, values, attn_mask=plan.bias, sinks=sinks)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.bias, enable_gqa=True)
        k_layer.view(-1).index_copy_(0, plan.k_index, k.reshape(-1))
        keys = k_layer[:n, :, :, :span].reshape(n * heads, d, span)
        # GQA without repeating k/v: the G query heads of a kv head are the rows of one matmul.
        scores = torch.baddbmm(plan.bias, q.reshape(n * heads, self.groups, d), keys, alpha=self.scale)
        if sinks is not None:  # one more column, the sink's logit, in the softmax and then dropped
            sink = sinks.to(scores.dtype).view(1, heads, self.groups, 1).expand(n, -1, -1, -1)
            scores = torch.cat([scores, sink.reshape(n * heads, self.groups, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        probs = (probs if sinks is None else probs[..., :-1]).to(values.dtype)
        return torch.bmm(probs, values.reshape(n * heads, span, d)).view(n, heads * self.groups, 1, d)


class Forwards:
    """Builds each forward's `ForwardBatch` over `cache`, for a model of `config`, with the
    attention `cache.backend` picks (`Backend.cache_attention`: vLLM's kernels, or None for
    `TorchCacheAttention`). Holds the RoPE tables for every position a slot can hold."""

    def __init__(self, cache: KVCache, config: ModelConfig) -> None:
        backend: Backend = cache.backend
        self.cache = cache
        device = cache.k.device
        positions = torch.arange(cache.max_seq_len, device=device)
        self.rope_cos, self.rope_sin = rope_cos_sin(  # the rotated dims only (partial RoPE: Qwen3.5)
            positions, config.rotary_dim, config.rope_theta, cache.k.dtype, config.rope_scaling
        )
        self.rope_table = backend.rope_table(self.rope_cos, self.rope_sin)
        self.rotary = None if self.rope_table is None else backend.rotary(cache.head_dim, self.rope_table)
        self._arange = positions
        # The window of the sliding-window layers (they share config.sliding_window), or None.
        self.window = config.sliding_window if config.windowed else None
        self.rope_local = None
        if config.rope_local_base_freq is not None:  # the layers whose RoPE has its own base
            self.rope_local = rope_cos_sin(
                positions, cache.head_dim, config.rope_local_base_freq, cache.k.dtype
            )
        kernel = backend.cache_attention(cache.k, cache.v, config.num_attention_heads)
        # vLLM's kernels over this cache (for a decode step that calls them itself), or None.
        self.kernel_attention = kernel
        self.attention: CacheAttention = (
            kernel if kernel is not None else TorchCacheAttention(cache, config, backend.matmul_attention)
        )

    def prefill(
        self,
        length: int,
        first_slot: int,
        source_rows: torch.Tensor | None,
        prefix_len: int = 0,
        keep: torch.Tensor | None = None,
        *,
        rows: int | None = None,
    ) -> ForwardBatch:
        """Prompts padded to `length` go to slots first_slot.. (row source_rows[i] fills slot
        first_slot + i; None means row i fills slot first_slot + i), at positions prefix_len.. :
        with prefix_len > 0 the slots already hold a shared prefix (positions 0..prefix_len-1)
        and the rows are what follows it. `keep` [rows]: the model's `keep=` (the last layer's one
        query per row, at row position keep[i]). rows: the forward's rows (default: len(keep), or
        one per slot source_rows names)."""
        device = self.cache.k.device
        end = prefix_len + length
        keep_mask = None
        if keep is not None:  # the kept query sees the prefix and its row up to its own position
            columns = torch.arange(end, device=device)
            keep_mask = (columns[None, :] <= prefix_len + keep[:, None])[:, None, None]
        # Each row's slot and prefix, and how far each kept query reads (vLLM's kernels; without
        # `rows` or `keep`, their attention counts the rows at each layer: `ForwardBatch.slot_rows`).
        if rows is None and self.kernel_attention is not None:
            if keep is not None:
                rows = keep.shape[0]
            elif source_rows is not None:
                rows = int(source_rows[-1]) + 1
        row_slots = prefix_lens = None
        if rows is not None and self.kernel_attention is not None:
            row_ids = torch.arange(rows, device=device)
            row_slots = first_slot + (
                row_ids if source_rows is None else torch.searchsorted(source_rows, row_ids)
            )
            prefix_lens = torch.full_like(row_ids, prefix_len)
        forward = ForwardBatch(
            kind="prefill",
            attention=self.attention,
            rope=(self.rope_cos[None, prefix_len:end, None], self.rope_sin[None, prefix_len:end, None]),
            positions=self._arange[None, prefix_len:end],
            key_layout=self.cache.key_layout,
            first_slot=first_slot,
            source_rows=source_rows,
            prefix_len=prefix_len,
            prefix_mask=prefix_mask(prefix_len, length, device) if prefix_len else None,
            keep_mask=keep_mask,
            row_slots=row_slots,
            prefix_lens=prefix_lens,
            kept_lens=None if keep is None else prefix_len + keep + 1,
            rotary=self.rotary,
            rope_local=self._rope_local(lambda table: table[None, prefix_len:end, None]),
        )
        if self.window is None:
            return forward
        window = self.window
        windowed_keep = None
        if keep is not None and keep_mask is not None:
            columns = torch.arange(end, device=device)
            windowed_keep = (
                keep_mask & (columns[None, :] > prefix_len + keep[:, None] - window)[:, None, None]
            )
        band = sliding_causal_mask(length, end, window, device, offset=prefix_len)
        return replace(forward, windowed=replace(forward, prefix_mask=band, keep_mask=windowed_keep))

    def _rope_local(self, pick) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`pick` (a function of a [positions, D] table) of the local RoPE's cos and sin, or None."""
        return None if self.rope_local is None else (pick(self.rope_local[0]), pick(self.rope_local[1]))

    def continue_(self, first_slot: int, history: list[int], own: list[int]) -> ForwardBatch:
        """Rows that continue their own slot's history (slots first_slot.. already hold
        history[i] positions, copied back by `KVCache.unpark`): row i brings own[i] >= 1 new
        tokens, right-padded to max(own), at positions history[i].. . The model is run with
        keep = own - 1 (each row's last new token)."""
        cache = self.cache
        device, width = cache.k.device, max(own)
        start = torch.tensor(history, device=device)
        offsets = torch.arange(width, device=device)
        positions = start[:, None] + offsets  # [rows, width]
        valid = offsets[None, :] < torch.tensor(own, device=device)[:, None]
        end = max(h + n for h, n in zip(history, own, strict=True))
        columns = torch.arange(end, device=device)
        last = torch.tensor([h + n - 1 for h, n in zip(history, own, strict=True)], device=device)
        # Flat cache offsets of each valid (row, position): [valid, Hkv] rows of a layer's
        # [slots*heads*seq, D] view, and for "ds" [valid, Hkv*D] flat entries.
        slot_of_valid = first_slot + torch.nonzero(valid)[:, 0]
        valid_positions = positions[valid][:, None]
        v_index = cache.row_base[slot_of_valid] + valid_positions
        k_index = v_index
        if cache.key_layout == "ds":
            k_index = cache.dim_base[slot_of_valid] + valid_positions
        clamped = positions.clamp(max=cache.max_seq_len - 1)  # padding past the end: never written
        mask = (columns <= positions[..., None])[:, None]  # [rows, 1, width, end]
        keep_mask = (columns[None, :] <= last[:, None])[:, None, None]  # [rows, 1, 1, end]
        forward = ForwardBatch(
            kind="continue",
            attention=self.attention,
            rope=(self.rope_cos[clamped][:, :, None], self.rope_sin[clamped][:, :, None]),
            positions=clamped,
            key_layout=cache.key_layout,
            first_slot=first_slot,
            end=end,
            mask=mask,
            keep_mask=keep_mask,
            valid=valid,
            k_index=k_index,
            v_index=v_index,
            row_slots=first_slot + torch.arange(len(history), device=device),
            prefix_lens=start,
            kept_lens=last + 1,
            new_lens=torch.tensor(own, device=device),
            rotary=self.rotary,
            rope_local=self._rope_local(lambda table: table[clamped][:, :, None]),
        )
        if self.window is None:
            return forward
        # A padding query past `end` keeps the window's last keys to look at (its output is unused).
        low = positions.clamp(max=end - 1) - self.window
        windowed = replace(
            forward,
            mask=mask & (columns > low[..., None])[:, None],
            keep_mask=keep_mask & (columns[None, :] > last[:, None] - self.window)[:, None, None],
        )
        return replace(forward, windowed=windowed)

    def decode(self, positions: torch.Tensor, span: int) -> ForwardBatch:
        """One token per slot 0..n-1 at `positions` [n] (int64); span = max(positions) + 1."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        forward = ForwardBatch(
            kind="decode",
            attention=self.attention,
            rope=(cos[:, None, None], sin[:, None, None]),
            positions=positions[:, None],
            key_layout=self.cache.key_layout,
            plan=self.attention.plan_decode(positions, span),
            rotary=self.rotary,
            rope_local=self._rope_local(lambda table: table[positions][:, None, None]),
        )
        if self.window is None:
            return forward
        attention = self.attention
        assert isinstance(attention, TorchCacheAttention), "the backend refuses kernels for windowed models"
        return replace(
            forward, windowed=replace(forward, plan=attention.plan_decode(positions, span, self.window))
        )


__all__ = ["Forwards", "TorchCacheAttention", "TorchDecodePlan"]
