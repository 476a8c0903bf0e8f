"""Per-token values [B, T] to one scalar, divided by step-wide counts.

Aggregation modes (`LossConfig.aggregation`), each divided by step-wide counts (a
`LossNormaliser`) so that summing the losses of micro-batches and data-parallel ranks gives exactly
the loss of the whole batch:
- token-mean: sum over all valid tokens / number of valid tokens in the step (DAPO).
- seq-mean-token-mean: each sequence's token mean, summed, / number of sequences (GRPO paper).
- seq-mean-token-sum: each sequence's token sum, summed, / number of sequences.
- seq-mean-token-sum-norm: token sum / (number of sequences x a constant), the Dr. GRPO
  normaliser (the constant is usually the episode token budget).
"Number of sequences" counts sequences with at least one valid token.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


class LossNormaliser(NamedTuple):
    """Step-wide counts that the aggregation divides by (all micro-batches, all ranks)."""

    num_tokens: float
    num_sequences: float

    @classmethod
    def from_mask(cls, loss_mask: Tensor) -> LossNormaliser:
        """The counts of this one batch (use when the batch is the whole step)."""
        mask = loss_mask.bool()
        return cls(float(mask.sum()), float(mask.any(dim=-1).sum()))


def aggregate(
    values: Tensor,
    loss_mask: Tensor,
    aggregation: str,
    normaliser: LossNormaliser,
    constant_normaliser: float | None = None,
) -> Tensor:
    """Reduce per-token values [B, T] to a scalar according to `aggregation` (module doc)."""
    mask = loss_mask.bool()
    values = torch.where(mask, values, torch.zeros_like(values))
    num_sequences = max(normaliser.num_sequences, 1.0)
    if aggregation == "token-mean":
        return values.sum() / max(normaliser.num_tokens, 1.0)
    per_sequence_sum = values.sum(dim=-1)
    if aggregation == "seq-mean-token-mean":
        tokens_per_sequence = mask.sum(dim=-1).clamp(min=1).to(values.dtype)
        return (per_sequence_sum / tokens_per_sequence).sum() / num_sequences
    if aggregation == "seq-mean-token-sum":
        return per_sequence_sum.sum() / num_sequences
    if aggregation == "seq-mean-token-sum-norm":
        if not constant_normaliser:
            raise ValueError("seq-mean-token-sum-norm needs a constant_normaliser")
        return per_sequence_sum.sum() / (num_sequences * constant_normaliser)
    raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
