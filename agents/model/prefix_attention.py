"""Attention for rows that continue one shared prefix, so the prefix is computed once.

Both sides of the project meet prompts that share a long start: every Zorplex episode begins with
the same system prompt, and the G episodes of a group with the same whole prompt. The trainer
computes such a prefix once per micro-batch (trainers/shared_prefix.py), the torch engine once
per prefill and keeps it for later ones (agents/engine/prefill.py). Either way the rows then hold only
their own positions P.., and each of their queries attends to every prefix key and causally to
the row's own keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .attention import scaled_dot_product_attention


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all of `sequences` have in common."""
    if not sequences:
        return 0
    first, shortest = sequences[0], min(len(s) for s in sequences)
    common = 0
    while common < shortest and all(s[common] == first[common] for s in sequences):
        common += 1
    return common


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens a prefill of `prompts` computes once for all of them: their common
    prefix, leaving each prompt at least one token of its own (its last position gives the first
    sampled token's logits), or 0 when sharing would save less than a quarter of the padded work
    (the prefix's extra forward and the rows' wider attention are not free)."""
    if len(prompts) < 2:
        return 0
    common = min(common_prefix_length(prompts), min(len(p) for p in prompts) - 1)
    padded = len(prompts) * max(len(p) for p in prompts)
    return common if (len(prompts) - 1) * common * 4 >= padded else 0


def reusable_prefix_length(stored: Sequence[int], prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens of `stored` (a prefix whose k/v are kept) every prompt starts
    with, leaving each at least one token of its own; 0 when that is under a quarter of the
    padded prefill (the rows' wider attention is not free)."""
    if not stored or not prompts:
        return 0
    common = min(common_prefix_length([stored, *prompts]), min(len(p) for p in prompts) - 1)
    return common if common * 4 >= max(len(p) for p in prompts) else 0


def prefix_mask(prefix_len: int, width: int, device: torch.device | str) -> Tensor:
    """bool [width, prefix_len + width]: query t sees all prefix keys and its own keys 0..t."""
    own = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(width, prefix_len, dtype=torch.bool, device=device), own], dim=1)


def attend_after_prefix(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_prefix: Tensor,
    v_prefix: Tensor,
    mask: Tensor,
    matmul: bool | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """q [B, H, W, D] and k/v [B, Hkv, W, D] (the rows' own positions, RoPE applied), k_prefix /
    v_prefix [1, Hkv, P, D] (one copy, shared by every row), mask from `prefix_mask(P, W)`
    -> [B, H, W, D]. matmul, sinks: as `scaled_dot_product_attention`'s."""
    rows = q.shape[0]
    keys = torch.cat([k_prefix.expand(rows, -1, -1, -1), k], dim=2)
    values = torch.cat([v_prefix.expand(rows, -1, -1, -1), v], dim=2)
    return scaled_dot_product_attention(q, keys, values, matmul=matmul, sinks=sinks, attn_mask=mask)


__all__ = [
    "attend_after_prefix",
    "common_prefix_length",
    "prefix_mask",
    "reusable_prefix_length",
    "shared_prefix_length",
]
