"""The scorer: a group's advantages, whether it carries signal, and what becomes of it in a batch.

Every advantage in toolgym is made here, by `score_group`, whoever asks: the batch assembler of
the sync collector and of the async taker (rollouts/batches.py, through `roll_group` for a group
producer), replay's offline policy gradient and the viewer (`score_recorded`, with the config the
recording's header records: rollouts/recording/format.py `recorded_scoring`).

- Members: an episode that ended with env_error or timeout is an infrastructure failure; it is
  left out of its group's statistics and gets advantage 0.0, unless `train_on_infra_failures`
  (`trainable`).
- Outcome credit: each member's group advantage (advantages.py) of its total reward, plus the
  overlong penalty when on; one float per episode. The group carries signal when it has members
  and their (shaped) rewards are not all equal.
- Turn-level credit ("turn_loo", "turn_state"): one advantage per turn (credit.py); the group
  carries signal when some turn's advantage is not 0 (`is_informative`).
- On-policy distillation (`distill`, a `DistillConfig` with a teacher): each member's advantage
  becomes per token, reward_weight x the above + weight x the teacher's log-ratio on each sampled
  token (distill.py); the trajectories must carry the teacher's logprobs (teacher.py).
- Fate (`group_fate`): a group whose teacher scoring failed (`scoring_failed`) is an
  infrastructure failure and not trained on; a group whose episodes all failed (infra) neither; with DAPO
  dynamic sampling neither is one without signal; an async group staler than the over-stale rule
  allows (`OverStale`) is dropped, or kept with its advantages scaled by the rule's weight, every
  turn alike (`OverStale.scale`). Staleness is the trainer's policy version minus the oldest
  version that sampled one of the group's tokens.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Literal

import msgspec

from ..episodes import INFRA_STOP_REASONS, Advantage, TurnAdvantage, sampled_length
from ..types import Trajectory
from .advantages import AdvantageConfig, Credit, group_advantages, is_zero_variance, shaped_rewards
from .credit import group_turn_advantages
from .distill import DistillConfig, distill_advantage


def trainable(trajectory: Trajectory, train_on_infra_failures: bool) -> bool:
    """Whether an episode is a member of its group's statistics and trained on: not an
    infrastructure failure (env_error, timeout), or those are trained on too."""
    return train_on_infra_failures or trajectory.stop_reason not in INFRA_STOP_REASONS


def score_group(
    group: Sequence[Trajectory],
    config: AdvantageConfig,
    *,
    train_on_infra_failures: bool,
    distill: DistillConfig | None = None,
) -> tuple[list[Advantage], bool]:
    """Advantages for one group (0.0 for members that are not `trainable`; with turn-level credit a
    list per member, one per turn; with `distill` on, per token) and whether it carries signal
    (module doc)."""
    if distill is not None and distill.enabled:
        advantages, _ = score_group(group, config, train_on_infra_failures=train_on_infra_failures)
        for i, t in enumerate(group):
            if trainable(t, train_on_infra_failures):
                advantages[i] = distill_advantage(t, advantages[i], distill)
        return advantages, is_informative(advantages)
    members = [i for i, t in enumerate(group) if trainable(t, train_on_infra_failures)]
    if config.credit != Credit.OUTCOME:
        return _score_turns(group, members, config)
    rewards = shaped_rewards(
        [group[i].total_reward for i in members],
        [sampled_length(group[i]) for i in members],
        config,
    )
    advantages: list[Advantage] = [0.0] * len(group)
    for i, a in zip(members, group_advantages(rewards, config.estimator, config.eps), strict=True):
        advantages[i] = a
    return advantages, bool(members) and not is_zero_variance(rewards)


def _score_turns(
    group: Sequence[Trajectory], members: list[int], config: AdvantageConfig
) -> tuple[list[Advantage], bool]:
    """Turn-level credit ("turn_loo", "turn_state"): the members' per-turn returns, leave-one-out
    baselines."""
    advantages: list[Advantage] = [0.0] * len(group)
    scored = group_turn_advantages([group[i] for i in members], config)
    for i, a in zip(members, scored, strict=True):
        per_turn: list[TurnAdvantage] = list(a)
        advantages[i] = per_turn
    return advantages, is_informative(advantages)


def score_recorded(
    trajectories: Sequence[Trajectory],
    config: AdvantageConfig,
    *,
    train_on_infra_failures: bool,
    distill: DistillConfig | None = None,
) -> list[Advantage]:
    """Each trajectory's advantage, scored (`score_group`) within its recorded group: the
    trajectories with its group id, in the order given (groups may interleave)."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trajectories):
        groups.setdefault(t.group_id, []).append(i)
    advantages: list[Advantage] = [0.0] * len(trajectories)
    for members in groups.values():
        scored, _ = score_group(
            [trajectories[i] for i in members],
            config,
            train_on_infra_failures=train_on_infra_failures,
            distill=distill,
        )
        for i, a in zip(members, scored, strict=True):
            advantages[i] = a
    return advantages


def _values(advantage: Advantage) -> list[float]:
    """Every number of an advantage: the one, each turn's, or each token's."""
    if not isinstance(advantage, list):
        return [advantage]
    out: list[float] = []
    for a in advantage:
        out += a if isinstance(a, list) else [a]
    return out


def is_informative(advantages: Sequence[Advantage], tol: float = 1e-9) -> bool:
    """Whether any turn (or token) of any episode has a non-zero advantage (the group carries signal)."""
    return any(abs(a) > tol for advantage in advantages for a in _values(advantage))


def scale_advantage(advantage: Advantage, weight: float) -> Advantage:
    """An episode's advantage (one number, one per turn, or one per token) times `weight`."""
    if isinstance(advantage, list):
        return [[x * weight for x in a] if isinstance(a, list) else a * weight for a in advantage]
    return advantage * weight


def mean_abs_advantage(advantage: Advantage) -> float:
    """|advantage| (one number), or its mean over the turns (or sampled tokens; 0 for an episode
    without a turn)."""
    values = _values(advantage)
    return math.fsum(abs(a) for a in values) / len(values) if values else 0.0


class OverStale(msgspec.Struct, frozen=True):
    """Async training's rule for a group more than `max_staleness` policy versions behind the
    trainer (loop.max_staleness, over_stale, stale_weight): "drop" it, or "downweight" its
    advantages by `weight`."""

    max_staleness: int
    rule: Literal["drop", "downweight"]
    weight: float

    def applies(self, staleness: int) -> bool:
        return staleness > self.max_staleness

    def scale(self, advantages: Sequence[Advantage]) -> list[Advantage]:
        """A down-weighted group's advantages, every turn alike."""
        return [scale_advantage(a, self.weight) for a in advantages]


class Fate(enum.StrEnum):
    """What becomes of a scored group offered to a batch (`group_fate`)."""

    KEEP = "keep"  # trained on (when the batch still has room)
    SCORING_FAILED = "scoring_failed"  # the teacher's scoring raised: an infrastructure failure
    NO_TRAINABLE = "no_trainable"  # every episode an infrastructure failure
    NO_SIGNAL = "no_signal"  # dropped by DAPO dynamic sampling: zero advantage everywhere
    OVER_STALE = "over_stale"  # dropped by the over-stale rule


def group_fate(
    group: Sequence[Trajectory],
    informative: bool,
    *,
    train_on_infra_failures: bool,
    dynamic_sampling: bool,
    staleness: int = 0,
    over_stale: OverStale | None = None,
    scoring_failed: bool = False,
) -> Fate:
    """A scored group's fate (module doc), checked in this order: its scoring failed, no trainable
    episode, no signal under dynamic sampling, over-stale under the "drop" rule; otherwise KEEP."""
    if scoring_failed:
        return Fate.SCORING_FAILED
    if not any(trainable(t, train_on_infra_failures) for t in group):
        return Fate.NO_TRAINABLE
    if not informative and dynamic_sampling:
        return Fate.NO_SIGNAL
    if over_stale is not None and over_stale.applies(staleness) and over_stale.rule == "drop":
        return Fate.OVER_STALE
    return Fate.KEEP
