"""Group-relative advantages (GRPO, Dr. GRPO) and DAPO overlong reward shaping.

Pure functions of plain numbers, called by the scorer (scorer.py, `score_group`), the only caller
in the library that turns rewards into advantages.

GRPO (DeepSeekMath): A_i = (r_i - mean(r)) / (std(r) + eps) over the G samples of one task.
Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): A_i = r_i - mean(r); it drops
the std division, which up-weights near-solved and near-failed tasks.

std is the SAMPLE standard deviation (ddof=1), as `torch.std` computes it by default and as TRL
and verl use, so advantages match those libraries number for number. A group of one sample has
advantage 0 (r - mean is 0; its std is defined as 0).

DAPO overlong shaping (Yu et al. 2025, eq. 13): with L_max and buffer L_cache, the length
penalty is 0 for |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache in the buffer, and
-1 for |y| > L_max. It is ADDED to the task reward before the group advantage.

Every function here raises ValueError, naming the reward, on a NaN or infinite reward: one would
make its whole group's advantages NaN (and `is_zero_variance` False, so DAPO would keep it). The
runner ends an episode whose env returns such a reward as env_error, so none reaches here from it.
Here |y| is the episode's number of SAMPLED (response) tokens: the sum of all its actions'
tokens, prompt and observation tokens excluded (in a multi-turn episode the model only controls
what it samples).

`AdvantageConfig.credit` chooses how the advantage is spread over an episode's turns: "outcome"
(the default) gives every turn the episode's group advantage computed here; "turn_loo" gives each
turn its own, from the turn's return-to-go and a leave-one-out baseline per turn index, and
"turn_state" the same with the baseline taken from the other episodes in the same state
(credit.py, which also documents each estimator's bias and variance).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import msgspec


class AdvantageEstimator(enum.StrEnum):
    GRPO = "grpo"  # (r - mean) / (std + eps)
    DR_GRPO = "dr_grpo"  # r - mean


class Credit(enum.StrEnum):
    """How an episode's reward becomes advantages on its turns (credit.py)."""

    OUTCOME = "outcome"  # the episode's group advantage on every turn
    TURN_LOO = "turn_loo"  # per turn: return-to-go minus the other episodes' mean at that turn
    TURN_STATE = "turn_state"  # ... minus the other episodes' mean in the same state (else turn_loo's)


class OverlongShaping(msgspec.Struct, frozen=True):
    """DAPO overlong reward shaping: penalty ramps from 0 at max_length - cache_length to -1 at
    max_length (lengths in sampled tokens per episode)."""

    max_length: int
    cache_length: int

    def __post_init__(self) -> None:
        if not 0 < self.cache_length <= self.max_length:
            raise ValueError(
                "OverlongShaping needs 0 < cache_length <= max_length, got "
                f"cache_length={self.cache_length}, max_length={self.max_length}"
            )


class AdvantageConfig(msgspec.Struct, frozen=True):
    """estimator: divide by the group's std ("grpo") or not ("dr_grpo"). credit: "outcome",
    "turn_loo" or "turn_state" (`Credit`). gamma: the discount of the per-turn returns-to-go, in (0, 1]; it
    applies to turn-level credit only ("outcome" uses the episode's total reward, so gamma must
    stay 1 there)."""

    estimator: AdvantageEstimator = AdvantageEstimator.GRPO
    eps: float = 1e-6
    overlong: OverlongShaping | None = None  # None: off
    credit: Credit = Credit.OUTCOME
    gamma: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma <= 1.0:  # also refuses nan
            raise ValueError(f"AdvantageConfig.gamma must be in (0, 1], got {self.gamma}")
        if self.credit == Credit.OUTCOME and self.gamma != 1.0:
            raise ValueError(
                f"AdvantageConfig.gamma must be 1 with credit = 'outcome' (it discounts per-turn "
                f"returns; 'turn_loo' uses it), got {self.gamma}"
            )


def overlong_penalty(length: int, shaping: OverlongShaping) -> float:
    """DAPO's soft overlong punishment for an episode of `length` sampled tokens (<= 0)."""
    threshold = shaping.max_length - shaping.cache_length
    if length <= threshold:
        return 0.0
    if length <= shaping.max_length:
        return (threshold - length) / shaping.cache_length
    return -1.0


def _check_finite(rewards: Sequence[float]) -> None:
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise ValueError(f"rewards must be finite numbers, got {r!r} at index {i} of {len(rewards)}")


def group_advantages(
    rewards: Sequence[float], estimator: AdvantageEstimator = AdvantageEstimator.GRPO, eps: float = 1e-6
) -> list[float]:
    """Advantages of one group's rewards (the G samples of one task)."""
    _check_finite(rewards)
    g = len(rewards)
    if g == 0:
        return []
    if max(rewards) == min(rewards):  # exactly 0, not float noise from the mean
        return [0.0] * g
    mean = math.fsum(rewards) / g
    centred = [r - mean for r in rewards]
    if estimator == AdvantageEstimator.DR_GRPO:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / (g - 1)) if g > 1 else 0.0
    return [c / (std + eps) for c in centred]


def shaped_rewards(
    rewards: Sequence[float], sampled_lengths: Sequence[int], config: AdvantageConfig
) -> list[float]:
    """Task rewards plus the overlong penalty when it is on."""
    if len(rewards) != len(sampled_lengths):
        raise ValueError(f"{len(rewards)} rewards but {len(sampled_lengths)} lengths")
    _check_finite(rewards)
    if config.overlong is None:
        return [float(r) for r in rewards]
    return [
        float(r) + overlong_penalty(n, config.overlong) for r, n in zip(rewards, sampled_lengths, strict=True)
    ]


def batch_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[int],
    config: AdvantageConfig,
    sampled_lengths: Sequence[int] | None = None,
) -> list[float]:
    """Per-sample advantages for a flat batch: samples are grouped by group id (any order).

    sampled_lengths is needed only when overlong shaping is on.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    _check_finite(rewards)
    if config.overlong is not None:
        if sampled_lengths is None:
            raise ValueError("overlong shaping is on: pass sampled_lengths")
        rewards = shaped_rewards(rewards, sampled_lengths, config)
    members: dict[int, list[int]] = {}
    for i, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(i)
    advantages = [0.0] * len(rewards)
    for idx in members.values():
        for i, a in zip(
            idx, group_advantages([rewards[i] for i in idx], config.estimator, config.eps), strict=True
        ):
            advantages[i] = a
    return advantages


def is_zero_variance(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """True when all rewards of a group are equal (GRPO gives it no signal; DAPO drops it)."""
    _check_finite(rewards)
    return len(rewards) == 0 or max(rewards) - min(rewards) <= tol
