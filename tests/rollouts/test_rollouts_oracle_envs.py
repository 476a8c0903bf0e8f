"""The oracle through the runner on every Zorplex tier and SumDigits reaches the oracle's reward."""

import gymnasium
import pytest

from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.metrics import batch_metrics
from toolgym.rollouts.scripted import OracleConfig, OraclePolicy, wrong_answer
from toolgym.rollouts.types import StopReason

ENVS = [
    ("toolgym/Zorplex-v0", {"tier": "simple"}),
    ("toolgym/Zorplex-v0", {"tier": "compositional", "difficulty": "easy"}),
    ("toolgym/Zorplex-v0", {"tier": "compositional", "difficulty": "medium"}),
    ("toolgym/Zorplex-v0", {"tier": "compositional", "difficulty": "hard"}),
    ("toolgym/Zorplex-v0", {"tier": "compositional"}),
    ("toolgym/Zorplex-v0", {"tier": "multi_step"}),
    ("toolgym/Zorplex-v0", {"tier": "recursive", "difficulty": "hard"}),
    ("toolgym/Zorplex-v0", {"tier": "recursive"}),
    ("toolgym/SumDigits-v0", {}),
]
SEEDS = [0, 1, 2, 3]


def oracle_reward(env_id, env_kwargs, seed) -> float:
    """Step the oracle's actions in a bare env, no runner, no tokens."""
    env = gymnasium.make(env_id, **env_kwargs)
    env.reset(seed=seed)
    total = 0.0
    for action in env.unwrapped.oracle_actions():
        _, reward, terminated, truncated, _ = env.step(action)
        total += reward
    assert terminated and not truncated
    return total


@pytest.mark.parametrize(("env_id", "env_kwargs"), ENVS, ids=lambda x: str(x))
def test_oracle_reaches_oracle_reward(renderer, env_id, env_kwargs):
    config = EnvRolloutConfig(env_id=env_id, env_kwargs=env_kwargs, group_size=2, max_turns=8)
    trajectories = RolloutRunner(OraclePolicy(renderer), renderer, config).run(SEEDS)
    assert len(trajectories) == 2 * len(SEEDS)
    for t in trajectories:
        assert t.stop_reason == StopReason.ANSWERED and t.error is None
        assert t.total_reward == pytest.approx(oracle_reward(env_id, env_kwargs, t.task_seed))
        assert t.transitions[-1].info["failure_mode"] == "success"
        assert t.total_reward == pytest.approx(sum(t.reward_components.values()))
    metrics = batch_metrics(trajectories)
    assert metrics["rollout/accuracy"] == metrics["rollout/tag_rate"] == 1.0
    assert metrics["rollout/failure_mode/success"] == 1.0


def test_oracle_knobs_on_zorplex(renderer):
    def play(**knobs):
        config = EnvRolloutConfig(env_id="toolgym/Zorplex-v0", env_kwargs={"tier": "multi_step"}, group_size=1)
        (t,) = RolloutRunner(OraclePolicy(renderer, OracleConfig(**knobs)), renderer, config).run([4])
        return t

    untagged = play(p_omit_tag=1.0)
    assert untagged.transitions[-1].action.text.startswith("The answer is ")
    assert untagged.transitions[-1].info["failure_mode"] == "wrong_format" and untagged.metrics["env"]["accuracy"]
    skipped = play(p_skip_lookup=1.0)
    assert len(skipped.transitions) == 1 and skipped.transitions[0].info["failure_mode"] == "wrong_answer"
    broken = play(p_malformed_call=1.0)
    texts = [tr.action.text for tr in broken.transitions]
    assert texts[0].startswith("GETKEY(") and texts[1].startswith("GETKEY[") and texts[2].startswith("FETCH(")
    assert broken.metrics["env"]["env_errors"] == 2 and broken.transitions[-1].info["failure_mode"] == "success"
    assert broken.stop_reason == StopReason.ANSWERED


def test_oracle_stops_a_see_chain_one_link_early(renderer):
    def play(seed, **knobs):
        config = EnvRolloutConfig(
            env_id="toolgym/Zorplex-v0", env_kwargs={"tier": "recursive", "difficulty": "medium"}, group_size=1
        )
        (t,) = RolloutRunner(OraclePolicy(renderer, OracleConfig(**knobs)), renderer, config).run([seed])
        return t

    full, short = play(3), play(3, p_stop_early=1.0)
    assert [tr.action.text for tr in full.transitions][:2] == [tr.action.text for tr in short.transitions][:2]
    assert len(full.transitions) == 4 and len(short.transitions) == 3
    assert "SEE:" in short.transitions[1].observation
    assert short.transitions[-1].action.text.startswith("[ANSWER] ")
    assert short.transitions[-1].info["failure_mode"] == "wrong_answer" and not short.metrics["env"]["accuracy"]
    assert full.transitions[-1].info["failure_mode"] == "success"
    fixed = play(3, p_stop_early=1.0, guess=50)
    assert fixed.transitions[-1].action.text in ("[ANSWER] 50", "[ANSWER] 51")
    assert fixed.transitions[-1].info["failure_mode"] == "wrong_answer"
    # one earlier action (simple tier): nothing to stop short of
    config = EnvRolloutConfig(env_id="toolgym/Zorplex-v0", env_kwargs={"tier": "simple"}, group_size=1)
    (simple,) = RolloutRunner(OraclePolicy(renderer, OracleConfig(p_stop_early=1.0)), renderer, config).run([3])
    assert simple.transitions[-1].info["failure_mode"] == "success"


def test_a_fixed_guess_is_never_the_answer():
    assert wrong_answer(50, offset=3, guess=50) == 51
    assert wrong_answer(17, offset=3, guess=50) == 50
    assert wrong_answer(17, offset=3) == 20
    assert wrong_answer("paris", offset=3, guess=50) == "not paris"
