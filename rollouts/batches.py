"""Collecting one training batch: task seeds -> groups of episodes -> scored groups -> Episodes.

Seed scheme (task seeds are what `env.reset(seed=...)` gets):
- Eval seeds are [EVAL_SEED_BASE, EVAL_SEED_BASE + EVAL_SEED_COUNT) = [0, 2**20): the fixed
  held-out set is its first n (`eval_seeds(n)`).
- Training seeds are TRAIN_SEED_BASE + stream * 2**32 + i with TRAIN_SEED_BASE = 2**31, for task
  index i = 0, 1, 2, ... of the run's stream (`TaskSeedStream(stream=run seed)`); they are never
  below 2**31, so never eval seeds. With several ranks, rank r of W takes the indices
  i = k * W + r: disjoint streams, and together the same tasks as one process would draw.
The group id of a training task is its index i: unique across ranks and steps.
`TaskSeedStream.position` is the data position to checkpoint for resume.

Every group is scored by the scorer (rollouts/scoring/scorer.py `score_group`: its advantages, a
float per episode or one per turn under turn-level credit, and whether it carries signal) and
offered to ONE assembler, `BatchAssembler`, which both ways of filling a batch feed: the sync
collector (`collect_batch`, below) and the async taker (trainers/loop/staleness.py `take_batch`,
from groups a producer rolled out and scored with `roll_group`). The assembler decides each
group's fate (`group_fate`: no trainable episode, no signal under dynamic sampling, over-stale),
keeps the first `groups_per_batch`, scales an over-stale group's advantages when the over-stale
rule says so, and builds the kept groups' Episodes and the batch metrics.

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

The batch metrics add `credit/`: the kept, trained episodes' mean return-to-go per turn index.

On-policy distillation (a `teacher`, rollouts/scoring/teacher.py): each group is scored by the
teacher before the scorer turns its log-ratios into per-token advantages (rollouts/scoring/
distill.py); a group whose teacher scoring raised is dropped as an infrastructure failure
(`batch/groups_scoring_failed`), never trained with a zero log-ratio. The metrics add
`distill/`: the kept, trained episodes' reverse KL per token (mean and per turn index) and the
teacher's scoring time (`distill/teacher_s`, summed over the groups offered).

Rewards from a judge (a `judge`, rollouts/scoring/judge.py): each group is judged first, its
criteria's scores written into the trajectories as reward components, so the teacher and the
scorer see the judged rewards; a group the judge could not score is dropped the same way
(`batch/groups_scoring_failed`), never trained with reward 0. The metrics add `judge/`: calls,
cache hits, seconds and usage tokens, summed over the groups offered.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from .episode.runner import RolloutRunner
from .episodes import Advantage, OverlongEpisodeRule, build_episodes
from .metrics import batch_metrics, component_variation
from .scoring.advantages import AdvantageConfig
from .scoring.credit import credit_metrics, turn_rewards
from .scoring.distill import TeacherScorer, reverse_kl_metrics
from .scoring.judge import Judge, JudgeStats
from .scoring.scorer import Fate, OverStale, group_fate, mean_abs_advantage, score_group, trainable
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
    groups_per_batch: int = 8  # groups per step on this rank (each group_size episodes; a game of seats: one per (task, seat))
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


class ScoredGroup(msgspec.Struct):
    """One finished group: its G trajectories, their advantages (each a float, or one per turn
    under turn-level credit), whether it carries signal (rewards not all equal; under turn-level
    credit, some turn's advantage not 0), and the oldest policy version among its sampled tokens."""

    group_id: int
    trajectories: list[Trajectory]
    advantages: list[Advantage]
    informative: bool
    oldest_version: int
    finished_at: float  # time.perf_counter() when it was scored
    failure: str = ""  # why its scoring failed (the teacher or judge): dropped as an infra failure
    teacher_s: float = 0.0  # the teacher's scoring time for this group
    judge_stats: JudgeStats | None = None  # the judge's calls for this group (None: no judge)


def oldest_version(trajectories: Sequence[Trajectory]) -> int:
    """The oldest policy version that sampled a token of these trajectories."""
    versions = [t.action.policy_version for tr in trajectories for t in tr.transitions]
    return min(versions, default=min((tr.policy_version for tr in trajectories), default=0))


class BatchAssembler:
    """One batch from scored groups, offered in the order they are considered (the sync
    collector's rounds, the async taker's buffer). Each group's fate is the scorer's
    (`group_fate`); of the groups to keep, the first `groups_per_batch` are kept (an over-stale one
    with its advantages scaled by `over_stale`'s weight) and the rest counted as surplus.
    `result` builds the kept groups' Episodes and the batch metrics; every group offered is in
    it, kept or not, so the caller records each exactly once."""

    def __init__(
        self,
        config: BatchConfig,
        over_stale: OverStale | None = None,
        distill: bool = False,
        judge: bool = False,
    ) -> None:
        """over_stale: the async rule for groups too far behind the trainer (None: sync, the
        groups were sampled by the current weights); distill: a teacher scores the groups (the
        `distill/` metrics); judge: a judge scores them (the `judge/` metrics)."""
        self.config, self.over_stale, self.distill = config, over_stale, distill
        self.judge, self.judge_stats = judge, JudgeStats()
        self.scoring_failed, self.teacher_s = 0, 0.0
        self._kept: list[tuple[Sequence[Trajectory], list[Advantage]]] = []
        self._other: list[tuple[Sequence[Trajectory], list[Advantage]]] = []
        self._staleness: list[int] = []  # of each kept group
        self.no_trainable = self.zero_variance = self.dropped = self.surplus = 0
        self.stale_dropped = self.stale_downweighted = 0

    @property
    def kept(self) -> int:
        """Groups kept so far."""
        return len(self._kept)

    def offer(
        self,
        group: Sequence[Trajectory],
        advantages: Sequence[Advantage],
        informative: bool,
        staleness: int = 0,
        *,
        failure: str = "",
        teacher_s: float = 0.0,
        judge_stats: JudgeStats | None = None,
    ) -> None:
        """One scored group (`score_group`'s advantages and signal); `staleness`: the trainer's
        policy version minus the group's oldest (0 when sampled by the current weights);
        `failure`: why its scoring failed ("" when it did not); `teacher_s`: its teacher time;
        `judge_stats`: its judge's calls."""
        config = self.config
        self.teacher_s += teacher_s
        if judge_stats is not None:
            self.judge_stats.add(judge_stats)
        fate = group_fate(
            group,
            informative,
            train_on_infra_failures=config.train_on_infra_failures,
            dynamic_sampling=config.dynamic_sampling,
            staleness=staleness,
            over_stale=self.over_stale,
            scoring_failed=bool(failure),
        )
        if fate == Fate.SCORING_FAILED:
            self.scoring_failed += 1
        elif fate == Fate.NO_TRAINABLE:
            self.no_trainable += 1
        elif fate == Fate.NO_SIGNAL:
            self.zero_variance += 1
            self.dropped += 1
        elif fate == Fate.OVER_STALE:
            self.stale_dropped += 1
        elif self.kept >= config.groups_per_batch:
            self.surplus += 1
        else:
            if self.over_stale is not None and self.over_stale.applies(staleness):
                self.stale_downweighted += 1
                advantages = self.over_stale.scale(advantages)
            self.zero_variance += not informative
            self._kept.append((group, list(advantages)))
            self._staleness.append(staleness)
            return
        self._other.append((group, list(advantages)))

    def result(self, rolled: int, *, started: float | None = None, rounds: int | None = None) -> RolloutBatch:
        """The batch: the kept groups' Episodes, every group's trajectories and advantages (kept
        first), and the metrics: `batch_metrics` over every episode (with the rates when
        `started`, the perf_counter() at which rolling out began, is given), the kept batch's
        (`_kept_episodes`), the dynamic-sampling fractions over the `rolled` groups, the groups
        without a trainable episode; with `rounds` (the sync collector's rounds of rollouts), the
        rounds and the surplus groups; with the over-stale rule, the kept groups' staleness (mean,
        max) and the over-stale groups dropped and down-weighted."""
        config = self.config
        kept_trajectories = [t for group, _ in self._kept for t in group]
        kept_advantages = [a for _, advs in self._kept for a in advs]
        episodes, kept_metrics = _kept_episodes(kept_trajectories, kept_advantages, self.kept, config)
        everything = self._kept + self._other
        trajectories = [t for group, _ in everything for t in group]
        elapsed = None if started is None else time.perf_counter() - started
        # the policy's episodes: the oracle's guided ones would count its wins as the policy's
        metrics = batch_metrics([t for t in trajectories if not t.guided], elapsed)
        metrics.update(kept_metrics)
        if any(t.guided for t in trajectories):
            metrics["batch/guided_episodes"] = float(sum(t.guided for t in kept_trajectories))
        infra = config.train_on_infra_failures
        metrics.update(component_variation([[t for t in g if trainable(t, infra)] for g, _ in self._kept]))
        if rounds is not None:
            metrics["dynamic_sampling/rounds"] = float(rounds)
        metrics["dynamic_sampling/groups_rolled_out"] = float(rolled)
        metrics["dynamic_sampling/dropped_frac"] = self.dropped / max(rolled, 1)
        metrics["dynamic_sampling/zero_variance_frac"] = self.zero_variance / max(rolled, 1)
        if rounds is not None:
            metrics["dynamic_sampling/surplus_groups"] = float(self.surplus)
        metrics["batch/groups_without_trainable"] = float(self.no_trainable)
        if self.distill:
            metrics.update(reverse_kl_metrics([t for t in kept_trajectories if trainable(t, infra)]))
            metrics["distill/teacher_s"] = self.teacher_s
        if self.judge:
            metrics.update(self.judge_stats.metrics())
        if self.distill or self.judge:
            metrics["batch/groups_scoring_failed"] = float(self.scoring_failed)
        if self.over_stale is not None:
            staleness = self._staleness
            metrics["async/staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
            metrics["async/staleness_max"] = float(max(staleness, default=0))
            metrics["async/over_stale_dropped"] = float(self.stale_dropped)
            metrics["async/over_stale_downweighted"] = float(self.stale_downweighted)
        return RolloutBatch(
            episodes=episodes,
            trajectories=trajectories,
            advantages=[a for _, advs in everything for a in advs],
            kept=[i < len(kept_trajectories) for i in range(len(trajectories))],
            metrics=metrics,
        )


def _kept_episodes(
    kept_trajectories: Sequence[Trajectory],
    kept_advantages: Sequence[Advantage],
    groups: int,
    config: BatchConfig,
) -> tuple[list[Episode], dict[str, float]]:
    """The kept groups' training Episodes and their metrics: the episode builder's counts, the
    groups kept, the fill against `groups_per_batch`, the episodes' tokens and sampled tokens, the
    mean |advantage| of the kept trajectories that are trained on (a per-turn advantage counts as
    its mean over the turns), and their per-turn returns and reward shares (`credit_metrics`)."""
    episodes, stats = build_episodes(
        kept_trajectories,
        kept_advantages,
        config.max_seq_len,
        config.overlong_rule,
        skip_infra_failures=not config.train_on_infra_failures,
    )
    infra = config.train_on_infra_failures
    pairs = [(t, a) for t, a in zip(kept_trajectories, kept_advantages, strict=True) if trainable(t, infra)]
    trained = [a for _, a in pairs]
    rewards = [turn_rewards(t, config.advantage.overlong) for t, _ in pairs]
    return episodes, {
        **stats.as_metrics(),
        "batch/groups": float(groups),
        "batch/fill": groups / config.groups_per_batch,
        "batch/tokens": float(sum(len(e.tokens) for e in episodes)),
        "batch/sampled_tokens": float(sum(sum(e.loss_mask) for e in episodes)),
        "advantage/mean_abs": sum(mean_abs_advantage(a) for a in trained) / len(trained) if trained else 0.0,
        **credit_metrics(rewards, config.advantage.gamma),
    }


def _split_groups(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    groups: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    return list(groups.values())


class GroupRunner(Protocol):
    """What `collect_batch` needs of a runner: G episodes per task seed, group-major. The env
    runner (rollouts/episode/runner.py) and the agent programs'
    (rollouts/endpoint/agent_runner.py) are ones."""

    async def run_groups(
        self,
        task_seeds: Sequence[int],
        group_ids: Sequence[int] | None = None,
        on_episode: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]: ...


class _Scored(msgspec.Struct):
    advantages: list[Advantage]
    informative: bool
    failure: str = ""
    teacher_s: float = 0.0
    judge_stats: JudgeStats | None = None


def _score(
    group: Sequence[Trajectory],
    config: BatchConfig,
    teacher: TeacherScorer | None = None,
    judge: Judge | None = None,
) -> _Scored:
    """The group scored: by the judge first (its criteria's rewards written into the
    trajectories), then by the teacher (its logprobs written into them; a failure of either gives
    no advantages and the cause), then by the scorer."""
    stats = None
    if judge is not None:
        failure, stats = judge.annotate(group)
        if failure is not None:
            return _Scored([0.0] * len(group), False, failure, 0.0, stats)
    teacher_s = 0.0
    if teacher is not None:
        started = time.perf_counter()
        failure = teacher.annotate(group)
        teacher_s = time.perf_counter() - started
        if failure is not None:
            return _Scored([0.0] * len(group), False, failure, teacher_s, stats)
    advantages, informative = score_group(
        group,
        config.advantage,
        train_on_infra_failures=config.train_on_infra_failures,
        distill=teacher.config if teacher is not None else None,
    )
    return _Scored(advantages, informative, "", teacher_s, stats)


async def roll_group(
    runner: RolloutRunner | GroupRunner,
    seed: int,
    index: int,
    config: BatchConfig,
    teacher: TeacherScorer | None = None,
    judge: Judge | None = None,
) -> ScoredGroup:
    """Task `index`'s group (task seed `seed`) rolled out and scored (by `judge` and `teacher`
    too, when given): what a group producer buffers for the async taker."""
    trajectories = await runner.run_groups([seed], [index])
    scored = _score(trajectories, config, teacher, judge)
    return ScoredGroup(
        group_id=index,
        trajectories=trajectories,
        advantages=scored.advantages,
        informative=scored.informative,
        oldest_version=oldest_version(trajectories),
        finished_at=time.perf_counter(),
        failure=scored.failure,
        teacher_s=scored.teacher_s,
        judge_stats=scored.judge_stats,
    )


async def collect_batch(
    runner: RolloutRunner | GroupRunner,
    seeds: TaskSeedStream,
    config: BatchConfig,
    teacher: TeacherScorer | None = None,
    judge: Judge | None = None,
) -> RolloutBatch:
    """Roll out, score and assemble one training step's batch (module doc: dynamic sampling, the
    teacher, the judge)."""
    started = time.perf_counter()
    needed = config.groups_per_batch
    max_per_round = config.max_groups_per_round or 4 * needed
    assembler = BatchAssembler(config, distill=teacher is not None, judge=judge is not None)
    # a match runner's task gives a group per learning seat (rollouts/episode/match.py)
    per_task = getattr(runner, "groups_per_task", 1)
    rolled = rounds = 0
    while True:
        rounds += 1
        missing = needed - assembler.kept
        if rounds == 1:
            ask = math.ceil(needed / per_task)
        else:  # ask for what is missing at the keep rate seen so far, so one more round usually does
            keep_rate = max(assembler.kept / rolled, 0.1)
            ask = min(max_per_round, math.ceil(missing / keep_rate))
        task_seeds, group_ids = seeds.take(ask)
        trajectories = await runner.run_groups(task_seeds, group_ids)
        rolled += ask * per_task
        for group in _split_groups(trajectories):
            scored = _score(group, config, teacher, judge)
            assembler.offer(
                group,
                scored.advantages,
                scored.informative,
                failure=scored.failure,
                teacher_s=scored.teacher_s,
                judge_stats=scored.judge_stats,
            )
        if not config.dynamic_sampling or assembler.kept >= needed or rounds > config.max_extra_rounds:
            break
    batch = assembler.result(rolled, started=started, rounds=rounds)
    runner_metrics = getattr(runner, "step_metrics", None)  # a match runner's pool: its ratings
    if runner_metrics is not None:
        batch.metrics.update(runner_metrics())
    return batch


def collect_batch_sync(runner: RolloutRunner, seeds: TaskSeedStream, config: BatchConfig) -> RolloutBatch:
    """`collect_batch` for synchronous training loops (starts its own event loop)."""
    return asyncio.run(collect_batch(runner, seeds, config))
