"""take_batch: one training batch from a GroupProducer's buffer (or the generator ranks'), with the staleness bound.

A group's staleness is the trainer's policy version minus the oldest version that sampled one of
its tokens. Groups are taken in the order they finished and offered, with their staleness and the
over-stale rule (`max_staleness`, `over_stale`, `stale_weight`), to the same assembler the sync
collector feeds (rollouts/batches.py `BatchAssembler`), which decides what is kept, drops or
down-weights an over-stale group, and builds the Episodes: this module makes and scales no
advantage. Taking stops when `groups_per_batch` groups are kept, or after as many groups as a
synchronous step could roll out at most (groups_per_batch + max_extra_rounds x
max_groups_per_round; then the batch is short, as a sync batch would be), not counting the
over-stale groups dropped: the generator, on newer weights, replaces them. Every group taken is
in the batch, kept or not, so the caller records each exactly once.

The metrics have the names `collect_batch` gives them (no rollout rates: the groups were rolled
out while the trainer worked), plus async/*: staleness (mean and max over the kept groups),
over-stale counts (the assembler's), the turns whose tokens more than one policy version sampled
(weights loaded in flight), the buffer's depth, how long the trainer waited.
"""

from __future__ import annotations

import time

from ...rollouts.batches import BatchAssembler, BatchConfig, RolloutBatch
from ...rollouts.scoring.scorer import OverStale
from .producer import GroupSource


def take_batch(
    producer: GroupSource,
    config: BatchConfig,
    trainer_version: int,
    over_stale: OverStale,
    distill: bool = False,
    judge: bool = False,
) -> RolloutBatch:
    """Take groups until the batch is full (module doc); the assembler builds its Episodes and
    metrics. A group whose teacher scoring failed is dropped and waited out like a stale one;
    `distill`: a teacher scored the groups (the assembler's `distill/` metrics); `judge`: a judge
    did (its `judge/` metrics)."""
    started = time.perf_counter()
    buffered = producer.buffered
    needed = config.groups_per_batch
    limit = needed + config.max_extra_rounds * (config.max_groups_per_round or 4 * needed)
    if not config.dynamic_sampling:
        limit = needed
    assembler = BatchAssembler(config, over_stale, distill=distill, judge=judge)
    taken = 0
    # wait out stale groups and groups whose teacher failed
    while assembler.kept < needed and taken - assembler.stale_dropped - assembler.scoring_failed < limit:
        group = producer.take()
        taken += 1
        staleness = trainer_version - group.oldest_version
        assembler.offer(
            group.trajectories,
            group.advantages,
            group.informative,
            staleness,
            failure=group.failure,
            teacher_s=group.teacher_s,
            judge_stats=group.judge_stats,
        )
    waited = time.perf_counter() - started

    batch = assembler.result(taken)
    kept = [t for t, k in zip(batch.trajectories, batch.kept, strict=True) if k]
    batch.metrics.update(
        {
            "async/mixed_version_turns": float(
                sum(len(set(tr.action.token_versions)) > 1 for t in kept for tr in t.transitions)
            ),
            "async/buffered_groups": float(buffered),
            "time/wait_s": waited,
        }
    )
    return batch
