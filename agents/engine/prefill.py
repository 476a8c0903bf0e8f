"""The torch engine's prefill: prompts in, their k/v in cache slots, next-token logits out.

Prompts are right-padded to one width and run as one batch; a prompt with n samples is one row
whose k/v fill n slots. Prompts that start alike share work (`share_prefixes`):
- a common prefix of the batch is computed once, as one row whose k/v fill every slot, and is
  kept in the cache's prefix store;
- a batch whose prompts all start with (part of) the kept prefix copies it from the store;
then only each row's own tokens run, attending to the prefix and causally to themselves
(agents/engine/cache_attention.py, agents/model/prefix_attention.py). Whether sharing is worth it:
agents/model/prefix_attention.py. The kept prefix's k/v belong to the weights they were computed with:
the engine calls `forget()` when it loads new ones.

A prompt that continues a finished sample's conversation (its prompt, the tokens it sampled,
then new ones: the next turn of an episode) goes through `continue_` instead: the sample's k/v,
kept in the cache's history pool (agents/engine/history.py), are copied back and only the new tokens run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..model.prefix_attention import reusable_prefix_length, shared_prefix_length
from ..model.transformer import Transformer
from .cache_attention import Forwards
from .history import HistoryStore
from .kv_cache import KVCache
from .routes import RouteRecorder


def _right_padded(token_lists: Sequence[Sequence[int]]) -> np.ndarray:
    """[len(token_lists), longest] int64 ids, zero-padded on the right (the padding is masked)."""
    ids = np.zeros((len(token_lists), max(map(len, token_lists))), np.int64)
    for i, tokens in enumerate(token_lists):
        ids[i, : len(tokens)] = tokens
    return ids


class Prefiller:
    """Runs the engine's prefills into `cache` (see the module doc); owns the kept prefix.
    forwards: the engine's `Forwards` over `cache` (default: one of its own). routes: records
    each forward's routing into the cache (agents/engine/routes.py), or None."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        *,
        share_prefixes: bool = True,
        forwards: Forwards | None = None,
        routes: RouteRecorder | None = None,
    ) -> None:
        self.model, self.cache, self.share_prefixes = model, cache, share_prefixes
        self.routes = routes
        self.forwards = forwards if forwards is not None else Forwards(cache, model.config)
        self.device = model.lm_head.weight.device
        self.stored: list[int] = []  # the tokens whose k/v the cache's prefix store holds
        # Gated DeltaNet layers keep the prefix's state at its end: only the whole of it is reusable.
        self.whole_prefix_only = model.config.linear_attention
        self.history = HistoryStore(cache.history_capacity)

    def forget(self) -> None:
        """Drop the kept prefix and histories (their k/v came from weights being replaced)."""
        self.stored = []
        self.history.clear()

    def park(self, slot: int, tokens: list[int]) -> None:
        """Keep running `slot`'s k/v, which cover `tokens`, for a prompt that continues them."""
        start = self.history.place(tokens)
        if start is not None:
            self.cache.park(slot, start, len(tokens))

    def continue_(self, prompts: Sequence[list[int]], claims: Sequence[tuple[int, int]], first_slot: int):
        """Prefill prompt i into slot first_slot + i, where claims[i] = (pool start, length)
        from `self.history.claim(prompts[i])`: copy that history back and run only the rest.
        Returns (logits [len(prompts), vocab], prompt tokens not recomputed)."""
        lengths = [length for _, length in claims]
        for i, (start, length) in enumerate(claims):
            self.cache.unpark(start, first_slot + i, length)
            self.history.release(start)
        own = [len(p) - length for p, length in zip(prompts, lengths, strict=True)]
        ids = _right_padded([prompt[length:] for prompt, length in zip(prompts, lengths, strict=True)])
        last = torch.tensor([n - 1 for n in own], device=self.device)
        forward = self.forwards.continue_(first_slot, lengths, own)
        hidden = self.model.model(
            torch.from_numpy(ids).to(self.device),
            cache=forward,
            rope=forward.rope,
            rope_local=forward.rope_local,
            keep=last,
        )
        if self.routes is not None:
            self.routes.continue_(first_slot, lengths, own)
        return self.model.lm_head(hidden), sum(lengths)

    def __call__(self, prompts: Sequence[list[int]], counts: Sequence[int], first_slot: int) -> tuple:
        """Prefill `prompts` into slots first_slot.. (prompt i fills counts[i] consecutive slots).
        Returns (logits [sum(counts), vocab] of each slot's first token, prompt tokens not
        recomputed thanks to a shared or kept prefix)."""
        lengths = [len(p) for p in prompts]
        width, rows, slots = max(lengths), len(prompts), sum(counts)
        ids = _right_padded(prompts)
        source_rows = None
        if any(c != 1 for c in counts):
            source_rows = torch.repeat_interleave(torch.arange(rows), torch.tensor(counts)).to(self.device)
        prefix = shared_prefix_length(prompts) if self.share_prefixes else 0
        stored = reusable_prefix_length(self.stored, prompts)
        if self.whole_prefix_only and stored != len(self.stored):
            stored = 0  # a recurrent state is kept at the stored prefix's end only
        saved = 0
        if prefix > stored:  # computed once, as one row whose k/v fill every slot, then kept
            every_slot = torch.zeros(slots, dtype=torch.long, device=self.device)
            # Only its k/v are wanted: the last layer's query and MLP run at one position.
            keep = torch.tensor([prefix - 1], device=self.device)
            forward = self.forwards.prefill(prefix, first_slot, every_slot, keep=keep)
            self.model.model(
                torch.from_numpy(ids[:1, :prefix]).to(self.device),
                cache=forward,
                rope=forward.rope,
                rope_local=forward.rope_local,
                keep=keep,
            )
            if self.routes is not None:
                self.routes.prefill(first_slot, every_slot, 1, 0, prefix, keep)
            self.cache.store_prefix(first_slot, prefix)
            self.stored, saved = list(prompts[0][:prefix]), (rows - 1) * prefix
        elif stored:  # what an earlier prefill computed (a system prompt, a conversation so far)
            self.cache.load_prefix(first_slot, slots, stored)
            prefix, saved = stored, rows * stored
        last = torch.tensor([n - 1 - prefix for n in lengths], device=self.device)
        forward = self.forwards.prefill(width - prefix, first_slot, source_rows, prefix_len=prefix, keep=last)
        hidden = self.model.model(
            torch.from_numpy(ids[:, prefix:]).to(self.device),
            cache=forward,
            rope=forward.rope,
            rope_local=forward.rope_local,
            keep=last,
        )  # [rows, hidden]: each row's last prompt position
        if self.routes is not None:
            self.routes.prefill(first_slot, source_rows, rows, prefix, width - prefix, last)
        logits = self.model.lm_head(hidden)
        return (logits if source_rows is None else logits[source_rows]), saved


__all__ = ["Prefiller"]
