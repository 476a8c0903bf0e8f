"""Cutting rows of different widths into padded chunks: shared by the engine's prefills and the
trainer's micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

Item = TypeVar("Item")


def padded_chunks(
    items: Iterable[Item], width: Callable[[Item], int], max_tokens: int, *, longest_first: bool = False
) -> list[list[Item]]:
    """`items` sorted by `width` (stably) and cut into chunks that are run together, each padded
    to its widest item: a chunk grows while its rows x its widest <= max_tokens (an item wider
    than that goes alone). Similar widths share a chunk, so little of it is padding. The engine
    groups its prefills this way, the trainer its micro-batches (trainers/batching.py)."""
    chunks: list[list[Item]] = []
    chunk: list[Item] = []
    widest = 0
    for item in sorted(items, key=width, reverse=longest_first):
        grown = max(widest, width(item))
        if chunk and grown * (len(chunk) + 1) > max_tokens:
            chunks.append(chunk)
            chunk, grown = [], width(item)
        chunk.append(item)
        widest = grown
    if chunk:
        chunks.append(chunk)
    return chunks
