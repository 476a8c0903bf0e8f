"""take_batch: one training batch from a GroupProducer's buffer (or the generator ranks'), with the staleness bound.

A group's staleness is the trainer's policy version minus the oldest version that sampled one of
its tokens. Groups are taken in the order they finished, as `collect_batch` (rollouts/batches.py)
would keep them: a group whose episodes all failed (infra) or, with DAPO dynamic sampling, that
carries no signal (`ScoredGroup.informative`) is not trained on; a group staler than
`max_staleness` is dropped or has its advantages scaled by `stale_weight` (`over_stale`; every
turn's alike under turn-level credit). Taking stops when `groups_per_batch` groups are kept, or
after as many groups as a synchronous step could roll out at most (groups_per_batch +
max_extra_rounds x max_groups_per_round; then the batch is short, as a sync batch would be), not
counting the over-stale groups dropped: the generator, on newer weights, replaces them. Every
group taken is returned, kept or not, so the caller records each exactly once.

The metrics have the names `collect_batch` gives them (no rollout rates: the groups were rolled
out while the trainer worked), plus async/*: staleness (mean and max over
the kept groups), over-stale counts, the turns whose tokens more than one policy version sampled
(weights loaded in flight), the buffer's depth, how long the trainer waited.
"""

from __future__ import annotations

import time
from typing import Literal

from ...rollouts.batches import BatchConfig, RolloutBatch, build_kept_batch
from ...rollouts.credit import scale_advantage
from ...rollouts.episodes import INFRA_STOP_REASONS, Advantage
from ...rollouts.metrics import batch_metrics
from .producer import GroupSource, ScoredGroup


def _trainable(group: ScoredGroup, config: BatchConfig) -> bool:
    return config.train_on_infra_failures or any(
        t.stop_reason not in INFRA_STOP_REASONS for t in group.trajectories
    )


def take_batch(
    producer: GroupSource,
    config: BatchConfig,
    trainer_version: int,
    max_staleness: int,
    over_stale: Literal["drop", "downweight"],
    stale_weight: float,
) -> RolloutBatch:
    """Take groups until the batch is full (module doc); build its Episodes and metrics."""
    started = time.perf_counter()
    buffered = producer.buffered
    needed = config.groups_per_batch
    limit = needed + config.max_extra_rounds * (config.max_groups_per_round or 4 * needed)
    if not config.dynamic_sampling:
        limit = needed
    kept: list[tuple[ScoredGroup, list[Advantage]]] = []
    other: list[ScoredGroup] = []
    zero_variance = dropped = no_trainable = stale_dropped = stale_downweighted = taken = 0
    kept_staleness: list[int] = []
    while len(kept) < needed and taken - stale_dropped < limit:  # wait out stale groups for fresh ones
        group = producer.take()
        taken += 1
        staleness = trainer_version - group.oldest_version
        if not _trainable(group, config):
            no_trainable += 1
        elif not group.informative and config.dynamic_sampling:
            zero_variance += 1
            dropped += 1
        elif staleness > max_staleness and over_stale == "drop":
            stale_dropped += 1
        else:
            advantages = group.advantages
            if staleness > max_staleness:
                stale_downweighted += 1
                advantages = [scale_advantage(a, stale_weight) for a in advantages]
            zero_variance += not group.informative
            kept.append((group, advantages))
            kept_staleness.append(staleness)
            continue
        other.append(group)
    waited = time.perf_counter() - started

    kept_trajectories = [t for g, _ in kept for t in g.trajectories]
    kept_advantages = [a for _, advs in kept for a in advs]
    episodes, kept_metrics = build_kept_batch(kept_trajectories, kept_advantages, len(kept), needed, config)
    trajectories = kept_trajectories + [t for g in other for t in g.trajectories]
    metrics = batch_metrics(trajectories)  # no rate: the groups were rolled out while others trained
    metrics.update(kept_metrics)
    metrics.update(
        {
            "dynamic_sampling/groups_rolled_out": float(taken),
            "dynamic_sampling/dropped_frac": dropped / max(taken, 1),
            "dynamic_sampling/zero_variance_frac": zero_variance / max(taken, 1),
            "batch/groups_without_trainable": float(no_trainable),
            "async/staleness_mean": sum(kept_staleness) / len(kept_staleness) if kept_staleness else 0.0,
            "async/staleness_max": float(max(kept_staleness, default=0)),
            "async/over_stale_dropped": float(stale_dropped),
            "async/over_stale_downweighted": float(stale_downweighted),
            "async/mixed_version_turns": float(
                sum(len(set(tr.action.token_versions)) > 1 for t in kept_trajectories for tr in t.transitions)
            ),
            "async/buffered_groups": float(buffered),
            "time/wait_s": waited,
        }
    )
    return RolloutBatch(
        episodes=episodes,
        trajectories=trajectories,
        advantages=kept_advantages + [a for g in other for a in g.advantages],
        kept=[i < len(kept_trajectories) for i in range(len(trajectories))],
        metrics=metrics,
    )
