"""Turn-level credit in the async path: per-turn advantages cross the generators' msgpack channel
unchanged, and an over-stale group's are down-weighted turn by turn (take_batch, through the
batch assembler)."""

from __future__ import annotations

import msgspec

from toolgym.agents.types import Completion
from toolgym.rollouts.batches import BatchConfig, ScoredGroup, oldest_version
from toolgym.rollouts.scoring.advantages import AdvantageConfig, AdvantageEstimator, Credit
from toolgym.rollouts.scoring.scorer import OverStale, score_group
from toolgym.rollouts.types import StopReason, Trajectory, Transition
from toolgym.trainers.loop.staleness import take_batch


def trajectory(rewards: list[float], versions: list[int]) -> Trajectory:
    transitions = [
        Transition("", [100 + t], Completion([10 + t], [-0.1], "stop", policy_version=v), reward=r)
        for t, (r, v) in enumerate(zip(rewards, versions, strict=True))
    ]
    return Trajectory(
        env_id="t", env_kwargs={}, task_seed=0, group_id=0, transitions=transitions,
        stop_reason=StopReason.ANSWERED, total_reward=sum(rewards), policy_version=min(versions),
    )  # fmt: skip


class Buffer:
    def __init__(self, groups: list[ScoredGroup]) -> None:
        self.groups = list(groups)

    def take(self, timeout_s: float | None = None) -> ScoredGroup:
        return self.groups.pop(0)

    @property
    def buffered(self) -> int:
        return len(self.groups)


CONFIG = BatchConfig(
    groups_per_batch=1,
    advantage=AdvantageConfig(estimator=AdvantageEstimator.DR_GRPO, credit=Credit.TURN_LOO),
)


def scored(trajectories: list[Trajectory]) -> ScoredGroup:
    advantages, informative = score_group(trajectories, CONFIG.advantage, train_on_infra_failures=False)
    return ScoredGroup(0, trajectories, advantages, informative, oldest_version(trajectories), 0.0)


def test_per_turn_advantages_survive_msgpack():
    group = scored([trajectory([0.0, 1.0], [3, 4]), trajectory([0.5], [4])])
    # turn 1 is reached by no other episode: its baseline is the other's last return-to-go, 0.5
    assert group.advantages == [[0.5, 0.5], [-0.5]]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(group), type=ScoredGroup)
    assert decoded.advantages == group.advantages
    mixed = ScoredGroup(1, [], [0.5, [1.0]], True, 3, 0.0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(mixed), type=ScoredGroup).advantages == [0.5, [1.0]]


def test_over_stale_group_is_downweighted_on_every_turn():
    # turns sampled by versions 3 and 4: the group's staleness is by its oldest token (3)
    group = scored([trajectory([0.0, 1.0], [3, 4]), trajectory([0.5], [4])])
    batch = take_batch(
        Buffer([group]), CONFIG, trainer_version=5, over_stale=OverStale(1, "downweight", 0.5)
    )
    assert batch.metrics["async/over_stale_downweighted"] == 1.0
    assert batch.advantages == [[0.25, 0.25], [-0.25]]
    first, second = batch.episodes
    assert first.advantages == [0.0, 0.25, 0.0, 0.25] and first.token_versions == [3, 3, 4, 4]
    assert second.advantages == [0.0, -0.25]
    assert batch.metrics["credit/return_turn0_mean"] == 0.75
