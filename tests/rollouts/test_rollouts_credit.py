"""Turn-level credit by hand: per-turn rewards and returns, the leave-one-out baseline per turn
index (ragged groups, the fallback, equal returns), std normalisation, and how per-turn
advantages reach exactly each turn's sampled tokens (several sequences, truncation, versions)."""

from __future__ import annotations

import random

import msgspec
import pytest

from toolgym.agents.types import Completion
from toolgym.envs.core.info import CREDIT_STATE
from toolgym.rollouts.batches import BatchAssembler, BatchConfig
from toolgym.rollouts.episodes import OverlongEpisodeRule, build_episodes, trajectory_to_episodes, turn_spans
from toolgym.rollouts.scoring.advantages import AdvantageConfig, AdvantageEstimator, Credit, OverlongShaping
from toolgym.rollouts.scoring.credit import (
    CREDIT_METRIC_TURNS,
    credit_metrics,
    past_reward_share,
    returns_to_go,
    turn_loo_advantages,
    turn_returns,
    turn_rewards,
    turn_states,
)
from toolgym.rollouts.scoring.scorer import is_informative, mean_abs_advantage, scale_advantage, score_group
from toolgym.rollouts.types import SEQUENCE_START, StopReason, Trajectory, Transition

DR = AdvantageEstimator.DR_GRPO


def trajectory(
    rewards: list[float],
    *,
    action_len: int = 2,
    versions: list[int] | None = None,
    restart_at: int | None = None,
    stop: StopReason = StopReason.ANSWERED,
) -> Trajectory:
    """Turn t: observation tokens [100 + t], action tokens [10 * (t + 1)] * action_len, sampled
    by policy version versions[t]."""
    transitions = []
    for t, reward in enumerate(rewards):
        version = versions[t] if versions else 0
        obs = [100 + t] if restart_at != t else [99, 98, 100 + t]
        action = Completion([10 * (t + 1)] * action_len, [-0.5] * action_len, "stop", policy_version=version)
        info = {SEQUENCE_START: True} if restart_at == t else {}
        transitions.append(Transition("", obs, action, reward=reward, info=info))
    return Trajectory(
        env_id="t", env_kwargs={}, task_seed=0, group_id=0, transitions=transitions, stop_reason=stop,
        total_reward=sum(rewards), policy_version=min(versions) if versions else 0,
    )  # fmt: skip


def turn_config(credit: Credit = Credit.TURN_LOO, **kw) -> AdvantageConfig:
    return AdvantageConfig(credit=credit, estimator=DR, **kw)


def score(group: list[Trajectory], config: AdvantageConfig) -> tuple[list, bool]:
    return score_group(group, config, train_on_infra_failures=False)


def test_returns_to_go():
    assert returns_to_go([1.0, 2.0, 3.0]) == [6.0, 5.0, 3.0]
    assert returns_to_go([1.0, 2.0, 3.0], gamma=0.5) == [1 + 0.5 * (2 + 0.5 * 3), 2 + 0.5 * 3, 3.0]
    assert returns_to_go([]) == []
    with pytest.raises(ValueError, match="gamma"):
        returns_to_go([1.0], gamma=0.0)
    with pytest.raises(ValueError, match="finite"):
        returns_to_go([float("nan")])


def test_turn_rewards_are_the_step_rewards_and_the_overlong_penalty_lands_on_the_last_turn():
    t = trajectory([0.1, -0.2, 1.0], action_len=6)  # 18 sampled tokens
    assert turn_rewards(t) == [0.1, -0.2, 1.0]
    shaped = turn_rewards(t, OverlongShaping(max_length=20, cache_length=5))  # 18: -0.6
    assert shaped == pytest.approx([0.1, -0.2, 0.4])
    assert turn_returns(t) == pytest.approx([0.9, 0.8, 1.0])


def test_leave_one_out_baseline_per_turn_index_by_hand():
    # episode 0 reaches turn 2, which no other episode reaches: the fallback is the mean of the
    # others' last turn's return-to-go, (1 + 0) / 2
    adv = turn_loo_advantages([[3.0, 2.0, 1.0], [1.0, 1.0], [0.0]], DR)
    assert adv == [[3 - 0.5, 2 - 1.0, 1 - 0.5], [1 - 1.5, 1 - 2.0], [0 - 2.0]]
    assert turn_loo_advantages([[2.0, 1.0]], DR) == [[2.0, 1.0]]  # no other episode: baseline 0
    assert turn_loo_advantages([], DR) == []


def test_an_episode_baseline_does_not_depend_on_its_own_returns():
    base = [[1.0, 0.5], [0.0, 2.0, 1.0], [2.0], [0.3, 0.3]]
    before = turn_loo_advantages(base, DR)
    for i in range(len(base)):
        changed = [list(r) for r in base]
        changed[i] = [g + 7.0 for g in changed[i]]
        after = turn_loo_advantages(changed, DR)
        assert after[i] == pytest.approx([a + 7.0 for a in before[i]])  # only its own return moved


def test_equal_returns_give_exactly_zero():
    adv = turn_loo_advantages([[0.1, 0.1, 0.1], [0.1, 0.1, 0.1], [0.1, 0.1, 0.1]], DR)
    assert adv == [[0.0] * 3] * 3
    assert not is_informative(adv)
    assert is_informative([0.0, [0.0, 1e-3]])


def test_grpo_divides_by_the_turn_index_std():
    returns = [[2.0, 1.0], [0.0, 1.0], [1.0]]
    adv = turn_loo_advantages(returns, AdvantageEstimator.GRPO, eps=0.0)
    # turn 0: values 2, 0, 1: sample std 1; turn 1: values 1, 1: all equal, no division
    assert adv == [[2 - 0.5, 1 - 1.0], [0 - 1.5, 0.0], [1 - 1.0]]


def test_score_group_turn_loo_leaves_infra_failures_out():
    group = [
        trajectory([0.0, 1.0]),
        trajectory([0.5, 0.0]),
        trajectory([9.0, 9.0], stop=StopReason.ENV_ERROR),
    ]
    advantages, informative = score(group, turn_config())
    assert advantages == [[1.0 - 0.5, 1.0 - 0.0], [0.5 - 1.0, 0.0 - 1.0], 0.0]
    assert informative
    # the same rewards under outcome credit: one number each, as before
    outcome, _ = score(group, AdvantageConfig(estimator=DR))
    assert outcome == [0.25, -0.25, 0.0]  # totals 1.0 and 0.5


def test_dense_rewards_with_equal_totals_still_carry_turn_signal():
    group = [trajectory([1.0, 0.0]), trajectory([0.0, 1.0])]
    advantages, informative = score(group, turn_config())
    assert informative and advantages == [[0.0, -1.0], [0.0, 1.0]]
    _, outcome_informative = score(group, AdvantageConfig(estimator=DR))
    assert not outcome_informative


def test_gamma_discounts_the_returns_before_the_baseline():
    group = [trajectory([0.0, 0.0, 1.0]), trajectory([0.0, 0.0, 0.0])]
    advantages, _ = score(group, turn_config(gamma=0.5))
    assert advantages == [[0.25, 0.5, 1.0], [-0.25, -0.5, -1.0]]


def test_per_turn_advantages_land_on_each_turn_sampled_tokens_only():
    t = trajectory([0.0, 0.0, 1.0], action_len=2, versions=[3, 4, 4])
    (episode,) = trajectory_to_episodes(t, [0.25, -0.5, 1.0])
    assert episode.tokens == [100, 10, 10, 101, 20, 20, 102, 30, 30]
    assert episode.loss_mask == [0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert episode.advantages == [0.0, 0.25, 0.25, 0.0, -0.5, -0.5, 0.0, 1.0, 1.0]
    # each token keeps the version that sampled its turn, beside its turn's advantage
    assert episode.token_versions == [3, 3, 3, 4, 4, 4, 4, 4, 4]
    # a float is every turn's advantage, exactly as before turn-level credit
    (flat,) = trajectory_to_episodes(t, 0.7)
    assert flat.advantages == [0.0, 0.7, 0.7, 0.0, 0.7, 0.7, 0.0, 0.7, 0.7]
    with pytest.raises(ValueError, match="2 per-turn advantages for an episode of 3 turns"):
        trajectory_to_episodes(t, [1.0, 2.0])


def test_per_turn_advantages_follow_their_turns_across_sequences():
    t = trajectory([0.0, 0.0, 1.0], action_len=1, restart_at=1)
    first, second = trajectory_to_episodes(t, [0.25, -0.5, 1.0])
    assert first.tokens == [100, 10] and first.advantages == [0.0, 0.25]
    assert second.tokens == [99, 98, 101, 20, 102, 30]
    assert second.advantages == [0.0, 0.0, 0.0, -0.5, 0.0, 1.0]


def test_truncated_episodes_keep_their_leading_turns_advantages():
    t = trajectory([0.0, 0.0, 1.0], action_len=2)
    episodes, stats = build_episodes(
        [t], [[0.25, -0.5, 1.0]], max_seq_len=6, rule=OverlongEpisodeRule.TRUNCATE_TURNS
    )
    assert stats.truncated == 1
    assert episodes[0].advantages == [0.0, 0.25, 0.25, 0.0, -0.5, -0.5]


def test_scaling_and_mean_abs_take_either_form():
    assert scale_advantage([1.0, -2.0], 0.5) == [0.5, -1.0]
    assert scale_advantage(-2.0, 0.5) == -1.0
    assert mean_abs_advantage([1.0, -3.0]) == 2.0
    assert mean_abs_advantage(-3.0) == 3.0
    assert mean_abs_advantage([]) == 0.0


def test_credit_metrics_have_fixed_keys():
    m = credit_metrics([[1.0, 1.0, 1.0], [0.0, 1.0]])  # returns-to-go [3, 2, 1] and [1, 1]
    fixed = [
        f"credit/{k}_turn{t}{s}"
        for t in range(CREDIT_METRIC_TURNS)
        for k, s in (("return", "_mean"), ("reached", ""))
    ]
    assert set(fixed) <= set(m)
    assert m["credit/return_turn0_mean"] == 2.0 and m["credit/reached_turn0"] == 1.0
    assert m["credit/return_turn2_mean"] == 1.0 and m["credit/reached_turn2"] == 0.5
    assert m["credit/return_turn5_mean"] == 0.0 and m["credit/reached_turn5"] == 0.0
    # the share is there only where two episodes reached the turn
    assert [k for k in m if "past_share" in k] == ["credit/past_share_turn0", "credit/past_share_turn1"]
    assert credit_metrics([])["credit/reached_turn0"] == 0.0
    assert credit_metrics([[1.0, 1.0]], gamma=0.5)["credit/return_turn0_mean"] == 1.5


def _var(values):
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def test_past_reward_share_is_the_variance_turn_level_credit_can_remove():
    # Two independent rewarded steps, then the grade: rewards before t are what turn t's
    # return-to-go leaves out.
    rewards = [[a, b, float(a and b)] for a in (0.0, 1.0) for b in (0.0, 1.0)]
    assert past_reward_share(rewards, 0) == 0.0  # nothing comes before the first turn
    later1 = _var([b + a * b for a in (0.0, 1.0) for b in (0.0, 1.0)])  # 11/16
    assert past_reward_share(rewards, 1) == pytest.approx(0.25 / (0.25 + later1))  # Var(a) = 1/4
    assert past_reward_share(rewards, 2) == pytest.approx(0.5 / (0.5 + 3 / 16))  # Var(a + b) = 1/2, Var(ab)
    m = credit_metrics(rewards)
    assert m["credit/past_share_turn2"] == pytest.approx(0.5 / (0.5 + 3 / 16))
    # uncorrelated before and after t: Var(rewards before t) / Var(episode reward)
    independent = [[a, b] for a in (0.0, 1.0) for b in (0.0, 2.0)]
    assert past_reward_share(independent, 1) == pytest.approx(0.25 / _var([sum(r) for r in independent]))
    # only the grade varies: nothing to remove
    assert past_reward_share([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], 2) == 0.0


def test_past_reward_share_is_a_share_even_when_later_rewards_cancel_earlier_ones():
    # Three episodes at turn 1 whose later rewards undo half the earlier ones: Var(before) = 2/3,
    # Var(total) = 1/6, so Var(before) / Var(total) would be 4.0.
    rewards = [[0.0, 0.0], [1.0, -0.5], [2.0, -1.0]]
    assert _var([r[0] for r in rewards]) / _var([sum(r) for r in rewards]) == pytest.approx(4.0)
    assert past_reward_share(rewards, 1) == pytest.approx((2 / 3) / (2 / 3 + 1 / 6))
    assert credit_metrics(rewards)["credit/past_share_turn1"] == pytest.approx(0.8)
    rng = random.Random(0)
    for _ in range(300):
        group = [
            [rng.choice((-1.0, 0.0, 0.5, 2.0)) for _ in range(rng.randint(1, 5))]
            for _ in range(rng.randint(2, 6))
        ]
        for t in range(5):
            share = past_reward_share(group, t)
            assert share is None or 0.0 <= share <= 1.0, (group, t, share)


def test_past_reward_share_is_absent_where_undefined():
    # fewer than two episodes at t, or no reward varies: undefined, and not in the metrics
    assert past_reward_share([[1.0, 0.0], [0.0]], 1) is None
    assert past_reward_share([[1.0, 1.0], [1.0, 1.0]], 1) is None
    assert past_reward_share([], 0) is None
    m = credit_metrics([[1.0, 1.0], [1.0, 1.0]])
    assert not [k for k in m if "past_share" in k]
    assert m["credit/return_turn1_mean"] == 1.0 and m["credit/reached_turn1"] == 1.0
    assert "credit/past_share_turn1" not in credit_metrics([[1.0, 0.0], [0.0]])


def test_kept_batch_reports_turn_returns_and_per_turn_mean_abs():
    group = [trajectory([0.0, 1.0]), trajectory([0.5, 0.0]), trajectory([9.0], stop=StopReason.TIMEOUT)]
    config = BatchConfig(groups_per_batch=1, advantage=turn_config())
    assembler = BatchAssembler(config)
    assembler.offer(group, *score(group, config.advantage))
    batch = assembler.result(1)
    episodes, metrics = batch.episodes, batch.metrics
    assert len(episodes) == 2  # the timed-out episode is not trained on, nor counted below
    assert metrics["credit/return_turn0_mean"] == pytest.approx(0.75)
    assert metrics["credit/return_turn1_mean"] == pytest.approx(0.5)
    assert metrics["advantage/mean_abs"] == pytest.approx((0.75 + 0.75) / 2)


def test_config_refuses_bad_gamma_and_gamma_with_outcome():
    with pytest.raises(ValueError, match=r"gamma must be in \(0, 1\]"):
        AdvantageConfig(credit=Credit.TURN_LOO, gamma=0.0)
    with pytest.raises(ValueError, match=r"gamma must be in \(0, 1\]"):
        AdvantageConfig(credit=Credit.TURN_LOO, gamma=float("nan"))
    with pytest.raises(ValueError, match="credit = 'outcome'"):
        AdvantageConfig(gamma=0.9)
    assert AdvantageConfig(credit=Credit.TURN_LOO, gamma=0.9).gamma == 0.9


def test_offline_policy_gradient_from_a_recording_takes_turn_level_credit():
    from toolgym.rollouts.recording.replay import OfflineMode, episodes_from_trajectories

    a, b, failed, other = (
        trajectory([0.0, 1.0]),
        trajectory([0.5, 0.0]),
        trajectory([9.0], stop=StopReason.ENV_ERROR),
        msgspec.structs.replace(trajectory([1.0]), group_id=1),
    )
    config = AdvantageConfig(credit=Credit.TURN_LOO, estimator=DR)
    episodes, stats = episodes_from_trajectories([a, b, failed, other], OfflineMode.PG, config)
    assert stats.dropped_infra == 1
    assert [e.advantages for e in episodes] == [
        [0.0, 0.5, 0.5, 0.0, 1.0, 1.0],
        [0.0, -0.5, -0.5, 0.0, -1.0, -1.0],
        [0.0, 1.0, 1.0],  # alone in its group: baseline 0
    ]


@pytest.mark.parametrize("restart_at", [None, 1, 2])
@pytest.mark.parametrize("max_seq_len", [None, 4, 6, 9])
@pytest.mark.parametrize("rule", list(OverlongEpisodeRule))
def test_turn_spans_locate_each_turn_sampled_tokens_in_the_built_episodes(restart_at, max_seq_len, rule):
    t = trajectory([0.0, 0.5, 1.0, -1.0], action_len=2, versions=[1, 2, 3, 4], restart_at=restart_at)
    per_turn = [0.25, -0.5, 1.0, 2.0]
    episodes = trajectory_to_episodes(t, per_turn, max_seq_len, rule)
    spans = turn_spans(t, max_seq_len, rule)
    assert len(spans) == len(t.transitions)
    covered = {i: set() for i in range(len(episodes))}
    for transition, advantage, span in zip(t.transitions, per_turn, spans, strict=True):
        if span is None:
            continue
        index, start, end = span
        episode = episodes[index]
        assert episode.tokens[start:end] == transition.action.tokens
        assert episode.loss_mask[start:end] == [1] * (end - start)
        assert episode.advantages[start:end] == [advantage] * (end - start)
        assert set(episode.token_versions[start:end]) == {transition.action.policy_version}
        covered[index] |= set(range(start, end))
    for index, episode in enumerate(episodes):  # every sampled token belongs to exactly one turn
        assert {k for k, m in enumerate(episode.loss_mask) if m} == covered[index]


def test_turn_state_baselines_a_turn_by_the_other_episodes_in_the_same_state():
    # A chain of two lookups then the answer (grade 1 at the end). Episodes 0-1 follow it; 2-3
    # break it at turn 0 (state "off"), then keep calling: their later turns have value 0, and
    # the episodes in their state say so, where the turn index's mean does not.
    def episode(states: list[str], grade: float) -> Trajectory:
        transitions = [
            Transition(f"obs{t}", [1], Completion([2], [-0.5], "stop"), reward=0.0, info={CREDIT_STATE: s})
            for t, s in enumerate(states)
        ]
        transitions[-1] = msgspec.structs.replace(transitions[-1], reward=grade, terminated=True)
        return Trajectory("env", {}, 0, 0, transitions, StopReason.ANSWERED, total_reward=grade)

    group = [episode(["1", "2", "end"], 1.0), episode(["1", "2", "end"], 1.0)]
    group += [episode(["off", "off", "end"], 0.0), episode(["off", "off", "end"], 0.0)]
    by_state, _ = score(group, turn_config(credit=Credit.TURN_STATE))
    by_index, _ = score(group, turn_config())
    assert by_state[2] == [pytest.approx(-2 / 3), 0.0, 0.0]  # turn 0: one state for all (the task)
    assert by_index[2] == [pytest.approx(-2 / 3), pytest.approx(-2 / 3), pytest.approx(-2 / 3)]
    assert by_state[0] == [pytest.approx(2 / 3), 0.0, 0.0]  # later: the other follower succeeded too
    assert turn_states(group[0])[0] == turn_states(group[2])[0] != turn_states(group[0])[1]
    # without a declared state, the exact history is the key: same observations and actions, same key
    bare = [
        msgspec.structs.replace(t, transitions=[msgspec.structs.replace(x, info={}) for x in t.transitions])
        for t in group
    ]
    assert turn_states(bare[0]) == turn_states(bare[2])  # identical texts here
    assert len(set(turn_states(bare[0]))) == 3
    # a dict state is one key whatever the order of its fields
    a, b = (
        msgspec.structs.replace(
            group[0],
            transitions=[msgspec.structs.replace(x, info={CREDIT_STATE: d}) for x in group[0].transitions],
        )
        for d in ({"followed": 1, "strayed": 0}, {"strayed": 0, "followed": 1})
    )
    assert turn_states(a) == turn_states(b)
