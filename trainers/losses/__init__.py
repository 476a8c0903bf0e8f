"""Policy losses: a registry of per-token objectives, composed with corrections, KL and entropy.

    registry.py     Objective (name, defaults, per-token term, metrics), register_loss, LOSSES
    objectives.py   the shipped losses: reinforce, grpo, dapo, gspo, cispo
    terms.py        around any objective: token TIS, sequence masking, KL, the entropy bonus
    aggregation.py  per-token values -> the loss, over step-wide counts (LossNormaliser)
    config.py       LossConfig (names and defaults from the registry)
    metrics.py      the metrics every loss reports; combining them over micro-batches and ranks
    policy.py       policy_loss: the composition

A new loss is one Objective subclass and one `register_loss` call (registry.py).
"""

from .aggregation import AGGREGATIONS, Aggregation, LossNormaliser, aggregate
from .config import SEQ_MASK_DEFAULTS, SEQ_MASKS, KLEstimator, LossConfig, LossName, SeqMask
from .metrics import BATCH_METRICS, STALENESS_BUCKETS, combine_metrics, finish_metrics
from .objectives import SHIPPED_LOSSES
from .policy import policy_loss, token_terms
from .registry import (
    LOSSES,
    RATIO_METRICS,
    Objective,
    ObjectiveTerm,
    TokenInputs,
    get_loss,
    loss_names,
    loss_table,
    register_loss,
)
from .terms import EntropyBonus, KLPenalty, SequenceMask, TokenTerm, TokenTIS, TopKForwardKL

__all__ = [
    "AGGREGATIONS",
    "BATCH_METRICS",
    "LOSSES",
    "RATIO_METRICS",
    "SEQ_MASKS",
    "SEQ_MASK_DEFAULTS",
    "SHIPPED_LOSSES",
    "STALENESS_BUCKETS",
    "Aggregation",
    "EntropyBonus",
    "KLEstimator",
    "KLPenalty",
    "LossConfig",
    "LossName",
    "LossNormaliser",
    "Objective",
    "ObjectiveTerm",
    "SeqMask",
    "SequenceMask",
    "TokenInputs",
    "TokenTIS",
    "TokenTerm",
    "TopKForwardKL",
    "aggregate",
    "combine_metrics",
    "finish_metrics",
    "get_loss",
    "loss_names",
    "loss_table",
    "policy_loss",
    "register_loss",
    "token_terms",
]
