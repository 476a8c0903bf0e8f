"""Batch sources: where the RL loop's batches come from, and where its new weights go.

The loop (rl.py) asks a source for the next batch, trains on it, and hands the source the
trainer after each applied update; a source owns its rollouts, its task stream(s), and the
weights' way back to whatever samples. Three sources, one per `loop.mode` / placement:

    SyncSource       sync: roll a batch out now (collect_batch), every rank its own share; the
                     weights go into this rank's policy (push_weights).
    ProducerSource   async in this process: a GroupProducer rolls out on a background thread
                     (the engine's worker thread, or vLLM) into a bounded buffer; take_batch
                     applies the staleness bound; the weights go into the policy in flight.
    GeneratorSource  async with generators of their own (spawned processes, or torchrun ranks):
                     trainer rank 0 takes their groups over the channel (RankGroups) and
                     broadcasts the batch to the other trainers; the weights go back over
                     shared memory or the channel.

Every method is collective where the source's ranks must agree (noted per method). A checkpoint's
data position is `position()`: the task stream(s)' positions and, for async sources, the task
indices drawn but not yet trained on, which a resumed source rolls out first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import msgspec

from ...agents.policy import Policy
from ...rollouts.batches import BatchConfig, GroupRunner, RolloutBatch, TaskSeedStream, collect_batch
from ...rollouts.scoring.distill import TeacherScorer
from ...rollouts.scoring.judge import Judge
from ...rollouts.scoring.scorer import OverStale
from ...rollouts.types import Episode, Trajectory
from ..distributed import all_gather_objects, all_reduce, broadcast_object
from ..trainer import Trainer
from ..weight_sync import gather_weights, load_and_check, push_weights
from .generators import RankGroups
from .producer import GroupProducer
from .staleness import take_batch

# the data position's key for a self-play opponent pool's state (rollouts/episode/opponents.py)
POOL_POSITION = "selfplay_pool"


class StepBatch(msgspec.Struct):
    """One step's batch as the loop sees it: this rank's `episodes` to train on, the
    `trajectories` this rank records (every one rolled out, kept or not), the step's rollout
    metrics over all ranks, and how many episodes the step trains on over all ranks."""

    episodes: list[Episode]
    trajectories: list[Trajectory]
    metrics: dict[str, float]
    total_episodes: float


class BatchSource(Protocol):
    """What the loop needs of a source (module doc)."""

    # True: each rank trains on its own episodes and the trainer all-reduces its counts;
    # False: every trainer rank holds the whole batch and trains on its share.
    sharded: bool

    def start(self, trainer: Trainer, positions: Sequence[int], pending: Sequence[int]) -> None:
        """Resume at the checkpoint's stream positions and pending task indices (empty: from the
        start), sampling with `trainer`'s weights. Called once, before the step-0 eval. Collective."""
        ...

    def next_batch(self, runner: asyncio.Runner, trainer_version: int) -> StepBatch:
        """The next batch (blocks). Collective."""
        ...

    def publish(self, trainer: Trainer) -> float:
        """The trainer's new weights to whatever samples; returns the wall time. Collective."""
        ...

    def position(self) -> dict[str, Any]:
        """The data position a checkpoint stores (module doc). Collective."""
        ...

    def close(self) -> None: ...


# Per-rank batch metrics that add up over ranks (the rest are means over episodes, or maxima).
_SUMMED = (
    "rollout/episodes",
    "rollout/tokens_generated",
    "rollout/errors",
    "rollout/episodes_per_s",
    "rollout/tokens_per_s",
    "batch/groups",
    "batch/tokens",
    "batch/sampled_tokens",
    "batch/groups_without_trainable",
    "batch/groups_scoring_failed",
    "distill/scored_tokens",
    "dynamic_sampling/groups_rolled_out",
    "dynamic_sampling/surplus_groups",
    "judge/calls",
    "judge/cache_hits",
    "judge/prompt_tokens",
    "judge/completion_tokens",
)
_MAXED = ("rollout/time_s", "dynamic_sampling/rounds", "distill/teacher_s", "judge/latency_s")


def combine_rank_metrics(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One step's rollout metrics over all ranks: sums of counts, episode-weighted means of the rest."""
    if len(parts) == 1:
        return dict(parts[0])
    weights = [float(p.get("rollout/episodes", 0.0)) for p in parts]
    total = sum(weights)
    out: dict[str, float] = {}
    for key in sorted({k for p in parts for k in p}):
        values = [float(p.get(key, 0.0)) for p in parts]
        if key in _SUMMED or key.startswith(("rollout/errors/", "episodes/")):
            out[key] = sum(values)
        elif key in _MAXED:
            out[key] = max(values)
        elif total > 0:
            out[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / total
        else:
            out[key] = sum(values) / len(values)
    return out


def opponent_episodes(runner: GroupRunner) -> list[Trajectory]:
    """A match runner's untrained seats' episodes since the last call, for the step's recording
    (rollouts/episode/match.py `record_opponents`); [] from any other runner."""
    take = getattr(runner, "take_opponent_episodes", None)
    return take() if take is not None else []


class SyncSource:
    """Sync mode: each rank rolls out its share of the batch from its own (rank-disjoint) task
    stream, then trains on its own episodes; every rank's policy takes the new weights."""

    sharded = True

    def __init__(
        self,
        runner: GroupRunner,
        stream: TaskSeedStream,
        config: BatchConfig,
        policy: Policy,
        teacher: TeacherScorer | None = None,
        judge: Judge | None = None,
    ) -> None:
        """teacher: scores each group before the scorer (on-policy distillation); judge: writes
        its criteria's rewards into each group before both (rollouts/scoring/judge.py)."""
        self.runner, self.stream, self.config, self.policy = runner, stream, config, policy
        self.teacher, self.judge = teacher, judge

    def start(self, trainer: Trainer, positions: Sequence[int], pending: Sequence[int]) -> None:
        pass  # the stream's position is set where the stream is built, the policy's weights too

    def next_batch(self, runner: asyncio.Runner, trainer_version: int) -> StepBatch:
        batch = runner.run(collect_batch(self.runner, self.stream, self.config, self.teacher, self.judge))
        (total,) = all_reduce([float(len(batch.episodes))])
        metrics = combine_rank_metrics(all_gather_objects(batch.metrics))
        return StepBatch(batch.episodes, batch.trajectories + opponent_episodes(self.runner), metrics, total)

    def publish(self, trainer: Trainer) -> float:
        return push_weights(trainer, self.policy)

    def position(self) -> dict[str, Any]:
        position = {"stream": self.stream.stream, "positions": all_gather_objects(self.stream.position)}
        pool = getattr(self.runner, "pool", None)  # a self-play match runner's opponent pool
        if pool is not None:
            position[POOL_POSITION] = pool.state()
        return position

    def close(self) -> None:
        pass


class ProducerSource:
    """Async in this process (one rank): a GroupProducer over `runner`, started at the first
    batch, keeps up to `capacity` finished groups ahead of the trainer; `policy` takes the new
    weights in flight (the torch engine between decode steps, vLLM between requests)."""

    sharded = True

    def __init__(
        self,
        runner: GroupRunner,
        stream: TaskSeedStream,
        config: BatchConfig,
        policy: Policy,
        capacity: int,
        over_stale: OverStale,
        teacher: TeacherScorer | None = None,
        judge: Judge | None = None,
    ) -> None:
        """teacher: scores each group on the producer's thread (on-policy distillation); judge:
        judges each group there first (rollouts/scoring/judge.py)."""
        self.runner, self.stream, self.config, self.policy = runner, stream, config, policy
        self.capacity, self.over_stale, self.teacher = capacity, over_stale, teacher
        self.judge = judge
        self.producer: GroupProducer | None = None
        self.pending: list[int] = []

    def start(self, trainer: Trainer, positions: Sequence[int], pending: Sequence[int]) -> None:
        self.pending = sorted(pending)  # rolled out first, when the producer starts

    def next_batch(self, runner: asyncio.Runner, trainer_version: int) -> StepBatch:
        if self.producer is None:
            self.producer = GroupProducer(
                self.runner,
                self.stream,
                self.config,
                concurrent_groups=self.config.groups_per_batch,
                capacity=self.capacity,
                replay=self.pending,
                teacher=self.teacher,
                judge=self.judge,
            )
        batch = take_batch(
            self.producer,
            self.config,
            trainer_version,
            self.over_stale,
            distill=self.teacher is not None,
            judge=self.judge is not None,
        )
        return StepBatch(batch.episodes, batch.trajectories, batch.metrics, float(len(batch.episodes)))

    def publish(self, trainer: Trainer) -> float:
        return push_weights(trainer, self.policy)

    def position(self) -> dict[str, Any]:
        position, pending = (
            self.producer.position() if self.producer is not None else (self.stream.position, self.pending)
        )
        return {"stream": self.stream.stream, "positions": [position], "pending": pending}

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()


class GeneratorSource:
    """Async with generators of their own (trainers/loop/generators.py), spawned processes or
    torchrun ranks. Trainer rank 0 holds `groups` (RankGroups over the channel; None on the other
    trainer ranks), takes each batch from the generators under the staleness bound and broadcasts
    its episodes and metrics, so every trainer holds the whole batch; `policy` (this rank's, for
    evals) and the generators take the new weights."""

    sharded = False

    def __init__(
        self,
        groups: RankGroups | None,
        stream_id: int,
        config: BatchConfig,
        policy: Policy,
        over_stale: OverStale,
    ) -> None:
        self.groups, self.stream_id, self.config, self.policy = groups, stream_id, config, policy
        self.over_stale = over_stale
        self.started = False
        self.resume_positions: list[int] = []
        self.pending: list[int] = []

    def start(self, trainer: Trainer, positions: Sequence[int], pending: Sequence[int]) -> None:
        """Send the generators their stream positions and `trainer`'s weights, which starts their
        rollouts (collective: every trainer gathers the weights). Called before the step-0 eval,
        so the generators' warm-up (a CUDA engine compiles and captures graphs on its first
        requests) and first groups overlap it."""
        self.resume_positions, self.pending = list(positions), sorted(pending)
        weights = gather_weights(trainer, full=True)  # the generators' base is their own copy
        if self.groups is not None:
            self.groups.start(self.resume_positions, self.pending)
            self.groups.send_weights(weights, trainer.step)
        self.started = True

    def next_batch(self, runner: asyncio.Runner, trainer_version: int) -> StepBatch:
        batch: RolloutBatch | None = None
        if self.groups is not None:
            batch = take_batch(self.groups, self.config, trainer_version, self.over_stale)
        episodes, metrics = broadcast_object((batch.episodes, batch.metrics) if batch is not None else None)
        trajectories = batch.trajectories if batch is not None else []
        return StepBatch(episodes, trajectories, metrics, float(len(episodes)))

    def publish(self, trainer: Trainer) -> float:
        started = time.perf_counter()
        weights = gather_weights(trainer)
        load_and_check(self.policy, weights, trainer.step)
        if self.groups is not None:
            self.groups.send_weights(weights, trainer.step)
        return time.perf_counter() - started

    def position(self) -> dict[str, Any]:
        if self.groups is not None and self.started:
            positions, pending = self.groups.position()
        else:
            positions, pending = self.resume_positions, self.pending
        return {"stream": self.stream_id, "positions": positions, "pending": pending}

    def close(self) -> None:
        if self.groups is not None:
            self.groups.close()
