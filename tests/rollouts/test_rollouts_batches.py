"""Batch collection: seed scheme, advantages end to end, DAPO dynamic sampling (hand-computed)."""

from collections import Counter

import pytest
from rollouts_fakes import TOY_ENV_ID, TextPolicy

from toolgym.rollouts.batches import (
    EVAL_SEED_COUNT,
    TRAIN_SEED_BASE,
    BatchConfig,
    TaskSeedStream,
    collect_batch_sync,
    eval_seeds,
)
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.evaluation import EvalConfig, evaluate_sync
from toolgym.rollouts.scoring.advantages import AdvantageConfig, AdvantageEstimator
from toolgym.rollouts.scripted import OracleConfig, OraclePolicy
from toolgym.rollouts.types import StopReason


class MixedPolicy:
    """Task index i % 3 == 2: the group's 2nd episode answers wrong (reward 0.2 vs 1.2);
    other tasks: every episode is the oracle (zero variance). `fail_second` makes the 2nd
    episode of every task a generation error instead."""

    max_seq_len = None

    def __init__(self, renderer, fail_second=False):
        self.oracle = OraclePolicy(renderer)
        self.guesser = OraclePolicy(renderer, OracleConfig(p_skip_lookup=1.0))
        self.failing = TextPolicy(renderer, fail=True)
        self.fail_second = fail_second
        self.seen = Counter()
        self.policy_version = 0

    def for_episode(self, env, seed):
        index = env.unwrapped.seed - TRAIN_SEED_BASE
        self.seen[index] += 1
        second = self.seen[index] == 2
        if second and self.fail_second:
            return self.failing
        return (self.guesser if second and index % 3 == 2 else self.oracle).for_episode(env, seed)


def runner(policy, renderer):
    return RolloutRunner(policy, renderer, EnvRolloutConfig(env_id=TOY_ENV_ID, group_size=2, max_turns=4))


def test_seed_scheme_is_disjoint_and_rank_split():
    one = TaskSeedStream(stream=0)
    seeds, ids = one.take(6)
    assert seeds == [TRAIN_SEED_BASE + i for i in range(6)] and ids == list(range(6))
    ranks = [TaskSeedStream(stream=0, rank=r, world_size=3) for r in range(3)]
    split = [r.take(2)[0] for r in ranks]
    assert sorted(s for part in split for s in part) == seeds  # together: what one process draws
    assert split[1] == [TRAIN_SEED_BASE + 1, TRAIN_SEED_BASE + 4]
    assert min(TaskSeedStream(stream=5).take(1)[0]) > max(eval_seeds(EVAL_SEED_COUNT))
    resumed = TaskSeedStream()
    resumed.load_state_dict(one.state_dict())
    assert resumed.take(1)[0] == [TRAIN_SEED_BASE + 6]
    assert eval_seeds(3) == [0, 1, 2]
    with pytest.raises(ValueError, match="rank"):
        TaskSeedStream(rank=2, world_size=2)


def test_batch_without_dynamic_sampling(renderer):
    config = BatchConfig(groups_per_batch=3)
    batch = collect_batch_sync(runner(MixedPolicy(renderer), renderer), TaskSeedStream(), config)
    # tasks 0, 1: zero variance (advantage 0, kept); task 2: rewards [1.2, 0.2] -> +-0.7071 (GRPO)
    assert len(batch.trajectories) == 6 and all(batch.kept) and len(batch.episodes) == 6
    assert batch.advantages[:4] == [0.0] * 4
    assert batch.advantages[4:] == pytest.approx([0.70710678, -0.70710678], abs=1e-5)
    assert batch.episodes[4].advantages[-1] == pytest.approx(0.70710678, abs=1e-5)
    assert batch.metrics["dynamic_sampling/rounds"] == 1.0
    assert batch.metrics["dynamic_sampling/zero_variance_frac"] == pytest.approx(2 / 3)
    assert batch.metrics["dynamic_sampling/dropped_frac"] == 0.0 and batch.metrics["batch/fill"] == 1.0


def test_dr_grpo_batch(renderer):
    config = BatchConfig(groups_per_batch=3, advantage=AdvantageConfig(estimator=AdvantageEstimator.DR_GRPO))
    batch = collect_batch_sync(runner(MixedPolicy(renderer), renderer), TaskSeedStream(), config)
    assert batch.advantages[4:] == pytest.approx([0.5, -0.5])


def test_dynamic_sampling_hand_computed(renderer):
    # Round 1 asks 2 tasks (0, 1): both zero variance, dropped. Keep rate so far 0 -> floor 0.1,
    # so round 2 asks min(4 * 2, ceil(2 / 0.1)) = 8 tasks (2..9): informative 2, 5, 8; the batch
    # keeps 2 and 5, task 8 is surplus. Rolled out 10 groups, dropped 2 + 5 = 7.
    config = BatchConfig(groups_per_batch=2, dynamic_sampling=True)
    stream = TaskSeedStream()
    batch = collect_batch_sync(runner(MixedPolicy(renderer), renderer), stream, config)
    kept_ids = sorted({t.group_id for t, k in zip(batch.trajectories, batch.kept, strict=True) if k})
    assert kept_ids == [2, 5] and len(batch.episodes) == 4 and stream.position == 10
    m = batch.metrics
    assert m["dynamic_sampling/rounds"] == 2.0 and m["dynamic_sampling/groups_rolled_out"] == 10.0
    assert m["dynamic_sampling/dropped_frac"] == pytest.approx(0.7)
    assert m["dynamic_sampling/surplus_groups"] == 1.0 and m["batch/fill"] == 1.0
    assert m["rollout/episodes"] == 20.0  # rollout metrics cover everything rolled out


def test_dynamic_sampling_round_cap_returns_short_batch(renderer):
    config = BatchConfig(groups_per_batch=2, dynamic_sampling=True, max_extra_rounds=0)
    batch = collect_batch_sync(runner(MixedPolicy(renderer), renderer), TaskSeedStream(), config)
    assert batch.episodes == [] and not any(batch.kept)
    assert batch.metrics["batch/fill"] == 0.0 and batch.metrics["dynamic_sampling/rounds"] == 1.0


def test_infra_failures_are_left_out_of_group_statistics(renderer):
    config = BatchConfig(groups_per_batch=3)
    batch = collect_batch_sync(
        runner(MixedPolicy(renderer, fail_second=True), renderer), TaskSeedStream(), config
    )
    failed = [t for t in batch.trajectories if t.stop_reason == StopReason.TIMEOUT]
    assert len(failed) == 3 and len(batch.episodes) == 3  # one trainable episode per group
    assert batch.advantages == [0.0] * 6  # a group of one: no signal
    assert batch.metrics["episodes/dropped_infra"] == 3.0 and batch.metrics["rollout/errors"] == 3.0


def test_sequence_limit_is_applied(renderer):
    config = BatchConfig(groups_per_batch=1, max_seq_len=10)
    batch = collect_batch_sync(runner(MixedPolicy(renderer), renderer), TaskSeedStream(), config)
    assert batch.episodes == [] and batch.metrics["episodes/dropped_overlong"] == 2.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"groups_per_batch": 0}, "groups_per_batch"),
        ({"max_extra_rounds": -1}, "max_extra_rounds"),
        ({"max_groups_per_round": -2}, "max_groups_per_round"),  # rewound the seed stream
        ({"max_groups_per_round": 0}, "max_groups_per_round"),  # silently meant the default
        ({"max_seq_len": 0}, "max_seq_len"),  # dropped every episode
        ({"max_seq_len": -5}, "max_seq_len"),
        ({"advantage": AdvantageConfig(eps=-1e-6)}, "advantage.eps"),
        ({"advantage": AdvantageConfig(eps=float("nan"))}, "advantage.eps"),
    ],
)
def test_batch_config_rejects_values_that_cannot_work(kwargs, field):
    with pytest.raises(ValueError, match=rf"^BatchConfig\.{field} must be"):
        BatchConfig(**kwargs)


def test_batch_config_keeps_none_as_the_default():
    config = BatchConfig(max_groups_per_round=None, max_seq_len=None, advantage=AdvantageConfig(eps=0.0))
    assert config.max_groups_per_round is None and config.max_seq_len is None
    assert BatchConfig(max_groups_per_round=1).max_groups_per_round == 1


def test_guided_samples_are_the_oracles_in_training_groups_only(renderer):
    """rollout.guided_samples = 1: each group's last sample is the env oracle's episode (a win where
    the policy, which always guesses, loses), marked guided, at the policy's version; the batch's
    rollout metrics are the policy's alone; eval plays no oracle."""
    policy = OraclePolicy(renderer, OracleConfig(p_skip_lookup=1.0), policy_version=3)
    rollout = EnvRolloutConfig(env_id=TOY_ENV_ID, group_size=2, max_turns=4, guided_samples=1)
    batch = collect_batch_sync(
        RolloutRunner(policy, renderer, rollout), TaskSeedStream(), BatchConfig(groups_per_batch=2)
    )
    assert [t.guided for t in batch.trajectories] == [False, True, False, True]
    assert [t.total_reward for t in batch.trajectories] == pytest.approx([0.2, 1.2, 0.2, 1.2])
    assert batch.advantages == pytest.approx([-0.70710678, 0.70710678] * 2, abs=1e-5)
    guided = [t for t in batch.trajectories if t.guided]
    assert all(
        tr.action.policy_version == 3 and set(tr.action.logprobs) == {0.0}
        for t in guided
        for tr in t.transitions
    )
    assert [e.guided for e in batch.episodes] == [False, True, False, True]
    m = batch.metrics
    assert m["rollout/episodes"] == 2.0 and m["rollout/reward_mean"] == pytest.approx(0.2)
    assert m["batch/guided_episodes"] == 2.0
    report = evaluate_sync(
        policy, renderer, rollout, EvalConfig(num_tasks=2, greedy=False, samples_per_task=2, num_examples=0)
    )
    assert len(report.trajectories) == 4 and not any(t.guided for t in report.trajectories)
    assert report.metrics["eval/reward_mean"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="guided_samples must be in"):
        EnvRolloutConfig(env_id=TOY_ENV_ID, group_size=2, guided_samples=2)
