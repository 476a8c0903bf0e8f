"""Collecting one training batch: task seeds -> groups of episodes -> advantages -> Episodes.

Seed scheme (task seeds are what `env.reset(seed=...)` gets):
- Eval seeds are [EVAL_SEED_BASE, EVAL_SEED_BASE + EVAL_SEED_COUNT) = [0, 2**20): the fixed
  held-out set is its first n (`eval_seeds(n)`).
- Training seeds are TRAIN_SEED_BASE + stream * 2**32 + i with TRAIN_SEED_BASE = 2**31, for task
  index i = 0, 1, 2, ... of the run's stream (`TaskSeedStream(stream=run seed)`); they are never
  below 2**31, so never eval seeds. With several ranks, rank r of W takes the indices
  i = k * W + r: disjoint streams, and together the same tasks as one process would draw.
The group id of a training task is its index i: unique across ranks and steps.
`TaskSeedStream.position` is the data position to checkpoint for resume.

DAPO dynamic sampling (`BatchConfig.dynamic_sampling`): a group whose (shaped) rewards are all
equal has zero advantage everywhere and is dropped; more task seeds are rolled out until
`groups_per_batch` informative groups are kept, for at most `max_extra_rounds` extra rounds.
An extra round asks for the missing groups divided by the keep rate seen so far (so it usually
finishes in one more round), at most `max_groups_per_round`; informative groups beyond the batch
are discarded (counted as surplus). When the cap is hit the batch is returned SHORT (fewer
groups, possibly none) rather than padded with zero-advantage groups, and `batch/fill` says so.

Episodes that ended with env_error or timeout are infrastructure failures: they are left out of
their group's advantage statistics and of the Episodes (counted), unless
`train_on_infra_failures`.

Credit (`AdvantageConfig.credit`, rollouts/credit.py): "outcome" gives each episode one advantage
(a float), "turn_loo" and "turn_state" one per turn (a list); `score_group` returns whichever, and a group is
informative when its rewards differ (outcome) or when some turn's advantage is not 0 (turn-level).
The batch metrics add `credit/`: the kept, trained episodes' mean return-to-go per turn index.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from .advantages import AdvantageConfig, Credit, group_advantages, is_zero_variance, shaped_rewards
from .credit import credit_metrics, group_turn_advantages, is_informative, mean_abs_advantage, turn_rewards
from .episodes import INFRA_STOP_REASONS, Advantage, OverlongEpisodeRule, build_episodes, sampled_length
from .metrics import batch_metrics
from .runner import RolloutRunner
from .types import Episode, Trajectory

EVAL_SEED_BASE = 0
EVAL_SEED_COUNT = 2**20
TRAIN_SEED_BASE = 2**31
_STREAM_STRIDE = 2**32


def eval_seeds(n: int) -> list[int]:
    """The fixed held-out task seeds: the first n of the eval range."""
    if not 0 <= n <= EVAL_SEED_COUNT:
        raise ValueError(f"eval seed count must be in [0, {EVAL_SEED_COUNT}], got {n}")
    return list(range(EVAL_SEED_BASE, EVAL_SEED_BASE + n))


class TaskSeedStream:
    """This rank's stream of training task seeds (see the module doc for the scheme)."""

    def __init__(self, stream: int = 0, rank: int = 0, world_size: int = 1, position: int = 0):
        if stream < 0 or position < 0:
            raise ValueError(f"stream and position must be >= 0, got {stream}, {position}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.stream, self.rank, self.world_size, self.position = stream, rank, world_size, position

    def take(self, n: int) -> tuple[list[int], list[int]]:
        """The next n (task seeds, group ids) of this rank."""
        indices = [(self.position + k) * self.world_size + self.rank for k in range(n)]
        self.position += n
        return [TRAIN_SEED_BASE + self.stream * _STREAM_STRIDE + i for i in indices], indices

    def seed_of(self, index: int) -> int:
        """The task seed of task index `index` (its group id), drawn or not, on any rank."""
        return TRAIN_SEED_BASE + self.stream * _STREAM_STRIDE + index

    def state_dict(self) -> dict[str, int]:
        return {"stream": self.stream, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.stream, self.position = int(state["stream"]), int(state["position"])


class BatchConfig(msgspec.Struct, frozen=True, kw_only=True):
    groups_per_batch: int = 8  # task seeds per step on this rank (x group_size episodes)
    advantage: AdvantageConfig = msgspec.field(default_factory=AdvantageConfig)
    dynamic_sampling: bool = False
    max_extra_rounds: int = 4
    max_groups_per_round: int | None = None  # None: 4 x groups_per_batch
    max_seq_len: int | None = None  # the trainer's sequence limit (see episodes.py)
    overlong_rule: OverlongEpisodeRule = OverlongEpisodeRule.TRUNCATE_TURNS
    train_on_infra_failures: bool = False

    def __post_init__(self) -> None:
        if self.groups_per_batch < 1:
            raise ValueError(f"BatchConfig.groups_per_batch must be >= 1, got {self.groups_per_batch}")
        if self.max_extra_rounds < 0:
            raise ValueError(f"BatchConfig.max_extra_rounds must be >= 0, got {self.max_extra_rounds}")
        # None means "the default"; a number below 1 would otherwise be taken as given: a negative
        # round size rewinds the seed stream, and max_seq_len <= 0 drops every episode.
        for name in ("max_groups_per_round", "max_seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"BatchConfig.{name} must be >= 1 (or unset), got {value}")
        eps = self.advantage.eps
        if not (eps >= 0 and math.isfinite(eps)):  # std + eps must not be 0 or nan
            raise ValueError(f"BatchConfig.advantage.eps must be a finite number >= 0, got {eps}")


class RolloutBatch(msgspec.Struct):
    """One step's rollouts. `trajectories` holds every episode rolled out (kept or not), with
    `advantages` (each a float, or one per turn: rollouts/episodes.py's `Advantage`) and `kept`
    aligned to it; `episodes` are the kept, trainable ones."""

    episodes: list[Episode]
    trajectories: list[Trajectory]
    advantages: list[Advantage]
    kept: list[bool]
    metrics: dict[str, float]


def _trainable(trajectory: Trajectory, config: BatchConfig) -> bool:
    return config.train_on_infra_failures or trajectory.stop_reason not in INFRA_STOP_REASONS


def build_kept_batch(
    kept_trajectories: Sequence[Trajectory],
    kept_advantages: Sequence[Advantage],
    groups: int,
    needed: int,
    config: BatchConfig,
) -> tuple[list[Episode], dict[str, float]]:
    """The kept groups' training Episodes and the batch metrics every way of filling a batch
    reports: the episode builder's counts, the groups kept, the fill against `needed`, the
    episodes' tokens and sampled tokens, the mean |advantage| of the kept trajectories that
    are trained on (a per-turn advantage counts as its mean over the turns), and their per-turn
    returns and reward shares (`credit_metrics`)."""
    episodes, stats = build_episodes(
        kept_trajectories,
        kept_advantages,
        config.max_seq_len,
        config.overlong_rule,
        skip_infra_failures=not config.train_on_infra_failures,
    )
    pairs = [(t, a) for t, a in zip(kept_trajectories, kept_advantages, strict=True) if _trainable(t, config)]
    trained = [a for _, a in pairs]
    rewards = [turn_rewards(t, config.advantage.overlong) for t, _ in pairs]
    return episodes, {
        **stats.as_metrics(),
        "batch/groups": float(groups),
        "batch/fill": groups / needed,
        "batch/tokens": float(sum(len(e.tokens) for e in episodes)),
        "batch/sampled_tokens": float(sum(sum(e.loss_mask) for e in episodes)),
        "advantage/mean_abs": sum(mean_abs_advantage(a) for a in trained) / len(trained) if trained else 0.0,
        **credit_metrics(rewards, config.advantage.gamma),
    }


def score_group(group: Sequence[Trajectory], config: BatchConfig) -> tuple[list[Advantage], bool]:
    """Advantages for one group (0.0 for untrainable members; with turn-level credit a list per
    member, one per turn) and whether it carries signal."""
    members = [i for i, t in enumerate(group) if _trainable(t, config)]
    if config.advantage.credit != Credit.OUTCOME:
        return _score_turns(group, members, config)
    rewards = shaped_rewards(
        [group[i].total_reward for i in members],
        [sampled_length(group[i]) for i in members],
        config.advantage,
    )
    advantages: list[Advantage] = [0.0] * len(group)
    for i, a in zip(
        members, group_advantages(rewards, config.advantage.estimator, config.advantage.eps), strict=True
    ):
        advantages[i] = a
    return advantages, bool(members) and not is_zero_variance(rewards)


def _score_turns(
    group: Sequence[Trajectory], members: list[int], config: BatchConfig
) -> tuple[list[Advantage], bool]:
    """Turn-level credit ("turn_loo", "turn_state"): the members' per-turn returns, leave-one-out
    baselines."""
    advantages: list[Advantage] = [0.0] * len(group)
    scored = group_turn_advantages([group[i] for i in members], config.advantage)
    for i, a in zip(members, scored, strict=True):
        advantages[i] = a
    return advantages, is_informative(advantages)


def _split_groups(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    groups: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    return list(groups.values())


class GroupRunner(Protocol):
    """What `collect_batch` needs of a runner: G episodes per task seed, group-major. The env
    runner (runner.py) and the agent programs' (rollouts/endpoint/agent_runner.py) are ones."""

    async def run_groups(
        self,
        task_seeds: Sequence[int],
        group_ids: Sequence[int] | None = None,
        on_episode: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]: ...


async def collect_batch(
    runner: RolloutRunner | GroupRunner, seeds: TaskSeedStream, config: BatchConfig
) -> RolloutBatch:
    """Roll out, grade, compute advantages and build Episodes for one training step."""
    started = time.perf_counter()
    needed = config.groups_per_batch
    max_per_round = config.max_groups_per_round or 4 * needed
    kept_groups: list[tuple[list[Trajectory], list[Advantage]]] = []
    other_groups: list[tuple[list[Trajectory], list[Advantage]]] = []
    rolled = zero_variance = dropped = no_trainable = surplus = rounds = 0
    while True:
        rounds += 1
        missing = needed - len(kept_groups)
        if rounds == 1:
            ask = needed
        else:  # ask for what is missing at the keep rate seen so far, so one more round usually does
            keep_rate = max(len(kept_groups) / rolled, 0.1)
            ask = min(max_per_round, math.ceil(missing / keep_rate))
        task_seeds, group_ids = seeds.take(ask)
        trajectories = await runner.run_groups(task_seeds, group_ids)
        rolled += ask
        for group in _split_groups(trajectories):
            advantages, informative = score_group(group, config)
            if not any(_trainable(t, config) for t in group):
                no_trainable += 1
            elif not informative and config.dynamic_sampling:
                zero_variance += 1
                dropped += 1
            elif len(kept_groups) >= needed:
                surplus += 1
            else:
                zero_variance += not informative
                kept_groups.append((group, advantages))
                continue
            other_groups.append((group, advantages))
        if not config.dynamic_sampling or len(kept_groups) >= needed or rounds > config.max_extra_rounds:
            break

    kept_trajectories = [t for group, _ in kept_groups for t in group]
    kept_advantages = [a for _, advs in kept_groups for a in advs]
    episodes, kept_metrics = build_kept_batch(kept_trajectories, kept_advantages, len(kept_groups), needed, config)
    everything = kept_groups + other_groups
    all_trajectories = [t for group, _ in everything for t in group]
    elapsed = time.perf_counter() - started
    metrics = batch_metrics(all_trajectories, elapsed)
    metrics.update(kept_metrics)
    metrics.update(
        {
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/groups_rolled_out": float(rolled),
            "dynamic_sampling/dropped_frac": dropped / rolled,
            "dynamic_sampling/zero_variance_frac": zero_variance / rolled,
            "dynamic_sampling/surplus_groups": float(surplus),
            "batch/groups_without_trainable": float(no_trainable),
        }
    )
    return RolloutBatch(
        episodes=episodes,
        trajectories=all_trajectories,
        advantages=[a for _, advs in everything for a in advs],
        kept=[i < len(kept_trajectories) for i in range(len(all_trajectories))],
        metrics=metrics,
    )


def collect_batch_sync(runner: RolloutRunner, seeds: TaskSeedStream, config: BatchConfig) -> RolloutBatch:
    """`collect_batch` for synchronous training loops (starts its own event loop)."""
    return asyncio.run(collect_batch(runner, seeds, config))
