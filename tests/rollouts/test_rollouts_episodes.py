"""Trajectory -> Episode invariants on random multi-turn trajectories (hypothesis)."""

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolgym.agents.types import Completion, Message
from toolgym.rollouts.episodes import (
    EpisodeStats,
    OverlongEpisodeRule,
    build_episodes,
    sampled_length,
    trajectory_to_episode,
)
from toolgym.rollouts.types import StopReason, Trajectory, Transition

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
turn = st.tuples(text, text, st.booleans())  # (action text, next observation, action closed?)
trajectory_spec = st.tuples(text, text, st.lists(turn, min_size=1, max_size=5), st.floats(-3, 3))


def make_trajectory(renderer, spec):
    """A trajectory rendered the way the runner renders one, and the env/prompt texts the
    masked spans must decode to."""
    system, question, turns, advantage = spec
    obs_tokens = renderer.render_prompt([Message("system", system), Message("user", question)])
    expected = [
        f"{IM_START}system\n{system}{IM_END}\n{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n"
    ]
    transitions, observation = [], question
    for i, (action, next_obs, closed) in enumerate(turns):
        tokens = renderer.encode(action) + ([renderer.im_end_id] if closed else [])
        logprobs = [-0.01 * (i + 1) * (j + 1) for j in range(len(tokens))]
        completion = Completion(tokens, logprobs, "stop" if closed else "length", action)
        transitions.append(Transition(observation, obs_tokens, completion, reward=0.0))
        obs_tokens = renderer.render_observation(Message("tool", next_obs), tokens)
        if i + 1 < len(turns):
            expected.append(
                ("" if closed else IM_END) + f"\n{IM_START}tool\n{next_obs}{IM_END}\n{IM_START}assistant\n"
            )
        observation = next_obs
    trajectory = Trajectory(
        env_id="test", env_kwargs={}, task_seed=3, group_id=9, transitions=transitions,
        stop_reason=StopReason.ANSWERED, total_reward=1.0, policy_version=4,
    )  # fmt: skip
    return trajectory, expected, advantage


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=trajectory_spec)
def test_episode_invariants(renderer, spec):
    trajectory, expected_texts, advantage = make_trajectory(renderer, spec)
    episode = trajectory_to_episode(trajectory, advantage)
    n = len(episode.tokens)
    assert len(episode.loss_mask) == len(episode.sampler_logprobs) == len(episode.advantages) == n
    assert n == sum(len(t.observation_tokens) + len(t.action.tokens) for t in trajectory.transitions)

    sampled = [t for tr in trajectory.transitions for t in tr.action.tokens]
    sampled_lps = [lp for tr in trajectory.transitions for lp in tr.action.logprobs]
    unmasked = [i for i in range(n) if episode.loss_mask[i] == 1]
    masked = [i for i in range(n) if episode.loss_mask[i] == 0]
    # unmasked positions: exactly the sampled tokens, in order, with their logprobs and the advantage
    assert [episode.tokens[i] for i in unmasked] == sampled
    assert [episode.sampler_logprobs[i] for i in unmasked] == sampled_lps
    assert all(episode.advantages[i] == advantage for i in unmasked)
    assert all(episode.sampler_logprobs[i] == 0.0 and episode.advantages[i] == 0.0 for i in masked)
    # masked positions: exactly the prompt / env text, turn by turn
    pos = 0
    for tr, expected in zip(trajectory.transitions, expected_texts, strict=True):
        span = episode.tokens[pos : pos + len(tr.observation_tokens)]
        assert all(m == 0 for m in episode.loss_mask[pos : pos + len(span)])
        assert renderer.decode(span) == expected
        pos += len(span) + len(tr.action.tokens)
    assert renderer.decode([episode.tokens[i] for i in masked]) == "".join(expected_texts)
    # a truncated last turn ends the episode with its sampled tokens, nothing invented after them
    last = trajectory.transitions[-1].action
    assert episode.tokens[n - len(last.tokens) :] == last.tokens
    assert (episode.group_id, episode.policy_version, episode.reward, episode.task_seed) == (9, 4, 1.0, 3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=trajectory_spec, limit=st.integers(1, 200))
def test_sequence_limit_truncates_at_turn_boundaries(renderer, spec, limit):
    trajectory, _, advantage = make_trajectory(renderer, spec)
    full = trajectory_to_episode(trajectory, advantage)
    turn_ends, pos = [], 0
    for tr in trajectory.transitions:
        pos += len(tr.observation_tokens) + len(tr.action.tokens)
        turn_ends.append(pos)
    stats = EpisodeStats()
    cut = trajectory_to_episode(trajectory, advantage, max_seq_len=limit, stats=stats)
    fitting = [e for e in turn_ends if e <= limit]
    if len(full.tokens) <= limit:
        assert cut == full and stats.truncated == stats.dropped_overlong == 0
    elif not fitting:
        assert cut is None and stats.dropped_overlong == 1 and stats.tokens_dropped == len(full.tokens)
    else:
        keep = max(fitting)
        assert cut.tokens == full.tokens[:keep] and cut.loss_mask == full.loss_mask[:keep]
        assert cut.sampler_logprobs == full.sampler_logprobs[:keep]
        assert stats.truncated == 1 and stats.tokens_dropped == len(full.tokens) - keep
    dropped = trajectory_to_episode(trajectory, advantage, limit, OverlongEpisodeRule.DROP)
    assert (dropped is None) == (len(full.tokens) > limit)


def test_truncated_last_turn_is_kept_verbatim(renderer):
    spec = ("sys", "q?", [("LOOKUP[zorp]", "zorp = 17", True), ("[ANSWER] 4", "", False)], 0.5)
    trajectory, _, _ = make_trajectory(renderer, spec)
    episode = trajectory_to_episode(trajectory, 0.5)
    last = renderer.encode("[ANSWER] 4")
    assert episode.tokens[-len(last) :] == last and episode.tokens[-1] != renderer.im_end_id
    assert episode.loss_mask[-len(last) :] == [1] * len(last)
    assert sampled_length(trajectory) == len(renderer.encode("LOOKUP[zorp]")) + 1 + len(last)


def test_each_token_carries_the_version_that_sampled_its_turn(renderer):
    spec = ("sys", "q?", [("LOOKUP[zorp]", "zorp = 17", True), ("[ANSWER] 4", "", True)], 0.5)
    trajectory, _, _ = make_trajectory(renderer, spec)
    first, second = trajectory.transitions
    first.action.policy_version, second.action.policy_version = 3, 5  # new weights between turns
    episode = trajectory_to_episode(trajectory, 0.5)
    turn0 = len(first.observation_tokens) + len(first.action.tokens)
    assert episode.token_versions == [3] * turn0 + [5] * (len(episode.tokens) - turn0)
    # cut at the sequence limit: the versions are cut with the turns
    cut = trajectory_to_episode(trajectory, 0.5, max_seq_len=turn0)
    assert cut is not None and cut.token_versions == [3] * turn0
    with pytest.raises(ValueError, match="token_versions"):
        msgspec.structs.replace(episode, token_versions=[1])


def test_tokens_sampled_after_an_in_flight_update_carry_the_new_version(renderer):
    spec = ("sys", "q?", [("LOOKUP[zorp]", "zorp = 17", True), ("[ANSWER] 4", "", True)], 0.5)
    trajectory, _, _ = make_trajectory(renderer, spec)
    first, second = trajectory.transitions
    n1, n2 = len(first.action.tokens), len(second.action.tokens)
    first.action.policy_version = 3
    # weights 4 arrived after the first token of turn 1
    first.action.token_versions = [3] + [4] * (n1 - 1)
    second.action.policy_version = 4
    episode = trajectory_to_episode(trajectory, 0.5)
    expected = (
        [3] * len(first.observation_tokens) + [3] + [4] * (n1 - 1)
        + [4] * len(second.observation_tokens) + [4] * n2
    )  # fmt: skip
    assert episode.token_versions == expected
    with pytest.raises(ValueError, match="token_versions"):
        msgspec.structs.replace(first.action, token_versions=[3])


def test_build_episodes_skips_infra_failures_and_counts(renderer):
    spec = ("s", "q", [("a", "b", True)], 0.0)
    ok, _, _ = make_trajectory(renderer, spec)
    failed, _, _ = make_trajectory(renderer, spec)
    failed.stop_reason = StopReason.ENV_ERROR
    episodes, stats = build_episodes([ok, failed], [1.0, -1.0])
    assert len(episodes) == 1 and episodes[0].advantages[-1] == 1.0
    assert stats.built == 1 and stats.dropped_infra == 1
    assert stats.as_metrics()["episodes/dropped_infra"] == 1.0
    episodes, stats = build_episodes([ok, failed], [1.0, -1.0], skip_infra_failures=False)
    assert len(episodes) == 2
    with pytest.raises(ValueError, match="advantages"):
        build_episodes([ok], [])
