"""Which finished conversations the torch engine keeps k/v for, so their next turn skips them.

A multi-turn episode sends its whole history as each turn's prompt: the last prompt, the tokens
it sampled, then the new observation. When a sample finishes, the engine copies its slot's k/v
(the prompt and every sampled token but the last, which was never fed back) into the KV cache's
history pool and files the tokens here. A later prompt that starts with those tokens claims the
entry: the engine copies the k/v back into the prompt's slot and prefills only the new tokens
(agents/engine/prefill.py, `Prefiller.continue_`). This is what vLLM's automatic prefix caching gives
its backend; here the unit is a whole finished sample, not a block.

The pool is a ring of `capacity` token positions: an entry takes as many positions as it has
tokens (not a whole max_seq_len slot), each new entry goes after the last, and the oldest entries
it runs over are evicted. A claimed entry leaves the index at once; its positions are not reused
until `release`, once its k/v have been copied out. `clear()` drops everything when the weights
change or a prefill fails. Bookkeeping only: the tensors are in agents/engine/kv_cache.py.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

_KEY_TOKENS = 4  # the lookup key: an entry's length and its last few tokens (verified in full)


class HistoryStore:
    """Maps ranges [start, start + len(tokens)) of a `capacity`-position pool to the tokens whose
    k/v they hold."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"history capacity must be >= 0 positions, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # start -> tokens, oldest first
        self._by_key: dict[tuple[int, tuple[int, ...]], set[int]] = {}
        self._length_count: dict[int, int] = {}
        self._claimed: dict[int, int] = {}  # start -> length, until released
        self._head = 0  # where the next entry goes

    def __len__(self) -> int:
        return len(self._entries)

    def place(self, tokens: Sequence[int]) -> int | None:
        """The start of a range to park `tokens` in, evicting the oldest entries it overlaps; None
        when it does not fit (longer than the pool, or over a claimed range not yet released).
        The caller copies the k/v there; the entry is filed already."""
        length = len(tokens)
        if not 0 < length <= self.capacity:
            return None
        wrapped = self._head + length > self.capacity
        start = 0 if wrapped else self._head
        end = start + length
        if any(s < end and start < s + n for s, n in self._claimed.items()):
            return None
        # Entries sit in placement order around the ring, so those to evict are the oldest:
        # the ones the new range overlaps, and on a wrap those in the skipped tail.
        while self._entries:
            oldest, oldest_tokens = next(iter(self._entries.items()))
            skipped = wrapped and oldest >= self._head
            if not (skipped or (oldest < end and start < oldest + len(oldest_tokens))):
                break
            self._drop(oldest)
        self._head = end
        key = tuple(tokens)
        self._entries[start] = key
        self._by_key.setdefault(self._key(key, length), set()).add(start)
        self._length_count[length] = self._length_count.get(length, 0) + 1
        return start

    def claim(self, prompt: Sequence[int]) -> tuple[int, int] | None:
        """The longest entry `prompt` starts with that leaves it at least one token of its own,
        as (start, length), removed from the index; None when no entry fits. Its range is kept
        until `release(start)`, which the caller calls once it has copied the k/v out."""
        for length in sorted(self._length_count, reverse=True):
            if length >= len(prompt):
                continue
            for start in self._by_key.get(self._key(prompt, length), ()):
                if self._entries[start] == tuple(prompt[:length]):
                    self._drop(start)
                    self._claimed[start] = length
                    return start, length
        return None

    def release(self, start: int) -> None:
        """A claimed range's k/v have been copied out: its positions may be reused."""
        del self._claimed[start]

    def clear(self) -> None:
        """Drop every entry and every claim (new weights; or a failed prefill, whose claims were
        never copied out and released)."""
        self._entries.clear()
        self._by_key.clear()
        self._length_count.clear()
        self._claimed.clear()
        self._head = 0

    @staticmethod
    def _key(tokens: Sequence[int], length: int) -> tuple[int, tuple[int, ...]]:
        return length, tuple(tokens[max(0, length - _KEY_TOKENS) : length])

    def _drop(self, start: int) -> None:
        tokens = self._entries.pop(start)
        key = self._key(tokens, len(tokens))
        self._by_key[key].discard(start)
        if not self._by_key[key]:
            del self._by_key[key]
        self._length_count[len(tokens)] -= 1
        if not self._length_count[len(tokens)]:
            del self._length_count[len(tokens)]


__all__ = ["HistoryStore"]
