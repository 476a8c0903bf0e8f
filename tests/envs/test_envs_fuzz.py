"""Hypothesis fuzzing: >= 10,000 random actions per env never raise from `step`, every episode ends
within its turn limit, and the info/reward bookkeeping stays consistent throughout."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolgym.envs import SumDigitsEnv, ZorplexEnv
from toolgym.envs.zorplex import DIFFICULTIES, WORDS

ACTIONS_PER_EXAMPLE = 25
EXAMPLES = 400  # 400 x 25 = 10,000 actions per env
FAILURE_MODES = {"success", "wrong_format", "wrong_answer", "tool_spam", "no_answer"}
END_REASONS = {"answered", "no_tool_call", "max_turns", "parse_error"}

NEAR_MISSES = [
    "LOOKUP[", "lookup['apple']", 'LOOKUP["cat"]', "LOOKUP[]", "LOOKUP[ ]", "LOOKUP [dog]", "LOOKUP(sun)",
    "LOOKUP[[ice]]", "GETKEY[", "getkey[moon]", "FETCH[ZK_ABCDEF]", "FETCH[", "FETCH[zk_", "SEARCH[x]",
    "[ANSWER]", "[ANSWER] -", "[ANSWER] 42", "[answer]:", "[ANSWER] -7", "[ ANSWER ]", "ANSWER[3]",
    "[", "]", "'", '"', "\n", " ", "-", "0", "99999999999999999999999", "\x00", "\ud800", "\ufffd",
    "SEE: ", "ZK_", "=", "UNKNOWN",
]  # fmt: skip
fragment = st.one_of(
    st.sampled_from(NEAR_MISSES),
    st.sampled_from(WORDS),
    st.integers(-(10**6), 10**6).map(str),
    st.text(max_size=6),
)
action = st.one_of(
    st.text(max_size=40),  # random Unicode
    st.lists(fragment, max_size=8).map("".join),  # near-miss tool syntax soup
    st.tuples(fragment, st.integers(300, 3000)).map(lambda t: t[0] * t[1]),  # huge strings
    st.binary(max_size=40).map(lambda b: b.decode("utf-8", "replace")),  # binary junk
)

ENVS = {
    "Zorplex": [ZorplexEnv(tier=t, difficulty=d) for t, levels in DIFFICULTIES.items() for d in levels]
    + [ZorplexEnv(max_consecutive_errors=None, max_tool_calls=3)],
    "SumDigits": [SumDigitsEnv(), SumDigitsEnv(max_turns=4), SumDigitsEnv(incorrect_reward=-1.0)],
}


def check_step(env, result, total):
    obs, reward, terminated, truncated, info = result
    assert obs in env.observation_space
    assert type(reward) is float and math.isfinite(reward)
    assert type(terminated) is bool and type(truncated) is bool and not (terminated and truncated)
    json.dumps(info)
    assert total == pytest.approx(sum(info["reward_components"].values()), abs=1e-9)
    assert 1 <= info["turn"] <= env.max_turns
    assert info["tool_calls"] <= env.max_tool_calls
    done = terminated or truncated
    if info["turn"] == env.max_turns:
        assert done, "the episode must end within its turn limit"
    if done:
        assert info["failure_mode"] in FAILURE_MODES and info["end_reason"] in END_REASONS
    return done


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ENVS))
def test_random_actions_never_raise(name):
    counted = {"actions": 0, "episodes": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )
    @given(
        config=st.integers(0, len(ENVS[name]) - 1),
        seed=st.integers(0, 2**32 - 1),
        actions=st.lists(action, min_size=ACTIONS_PER_EXAMPLE, max_size=ACTIONS_PER_EXAMPLE),
    )
    def run(config, seed, actions):
        env = ENVS[name][config]
        env.reset(seed=seed)
        total = 0.0
        for text in actions:
            result = env.step(text)
            counted["actions"] += 1
            total += result[1]
            if check_step(env, result, total):
                counted["episodes"] += 1
                with pytest.raises(RuntimeError, match="call reset"):
                    env.step(text)
                env.reset()
                total = 0.0

    run()
    assert counted["actions"] >= 10_000
    assert counted["episodes"] >= 100
