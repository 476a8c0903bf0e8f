"""SumDigits: single-turn digit summing with the documented reward table."""

import re
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from toolgym.envs import SumDigitsEnv
from toolgym.envs.tasks.sum_digits import digit_sum


@pytest.mark.parametrize(
    "kwargs", [{}, {"max_turns": 3}, {"min_count": 1, "max_count": 1, "max_value": 10**6}]
)
def test_check_env_without_warnings(kwargs):
    env = gymnasium.make("toolgym/SumDigits-v0", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)


def test_questions_follow_the_knobs_and_the_oracle_is_right():
    env = SumDigitsEnv()
    counts = set()
    for seed in range(100):
        question, info = env.reset(seed=seed)
        numbers = [
            int(n)
            for n in re.fullmatch(r"What is the total digit sum of \[(.*)\]\?", question)[1].split(", ")
        ]
        counts.add(len(numbers))
        assert all(10 <= n <= 99 for n in numbers)
        assert info["answer"] == digit_sum(numbers) == sum(int(c) for n in numbers for c in str(n))
        assert env.oracle_actions() == [f"[ANSWER] {info['answer']}"]
    assert counts == {2, 3, 4}
    env = SumDigitsEnv(min_count=5, max_count=5, min_value=100, max_value=999)
    question, _ = env.reset(seed=0)
    assert len(re.findall(r"\d{3}", question)) == 5


@pytest.mark.parametrize(
    ("template", "reward", "failure_mode", "end_reason"),
    [
        ("[ANSWER] {a}", 1.0, "success", "answered"),
        ("1+2 = 3 ... so [ANSWER] {a}", 1.0, "success", "answered"),
        ("[ANSWER] {wrong}", 0.2, "wrong_answer", "answered"),
        ("The sum is {a}.", 0.8, "wrong_format", "answered"),
        ("The sum is {wrong}.", 0.0, "wrong_answer", "answered"),
        ("no idea", 0.0, "no_answer", "no_tool_call"),
        ("", 0.0, "no_answer", "no_tool_call"),
        ("[ANSWER] ?", 0.0, "no_answer", "parse_error"),
    ],
)
def test_single_turn_reward_table(template, reward, failure_mode, end_reason):
    env = SumDigitsEnv()
    _, info = env.reset(seed=1)
    _obs, got, terminated, truncated, info = env.step(
        template.format(a=info["answer"], wrong=info["answer"] + 1)
    )
    # A single-turn episode always terminates: its one step is the whole episode.
    assert (terminated, truncated) == (True, False)
    assert got == pytest.approx(reward)
    assert (info["failure_mode"], info["end_reason"]) == (failure_mode, end_reason)
    with pytest.raises(RuntimeError):
        env.step("[ANSWER] 1")


def test_punishing_knob_and_multi_turn():
    env = SumDigitsEnv(incorrect_reward=-1.0)
    env.reset(seed=0)
    assert env.step("pass")[1] == pytest.approx(-1.0)
    env = SumDigitsEnv(max_turns=3)
    env.reset(seed=0)
    obs, reward, terminated, truncated, _info = env.step("hmm")
    assert obs == "ERROR: no answer. Finish with [ANSWER] <number>." and not (terminated or truncated)
    assert env.step("SUM[1]")[0] == "SUM[1] = UNKNOWN_TOOL"  # there are no tools
    obs, reward, terminated, *_ = env.step(f"[ANSWER] {env.answer}")
    assert terminated and reward == pytest.approx(1.0)


def test_system_prompt_has_a_worked_example():
    prompt = SumDigitsEnv().system_prompt
    assert "[ANSWER] <number>" in prompt and "1+2+3+4 = 10 [ANSWER] 10" in prompt


@pytest.mark.parametrize(
    "kwargs", [{"min_count": 0}, {"min_count": 3, "max_count": 2}, {"min_value": -1}, {"max_value": 5}]
)
def test_bad_knobs(kwargs):
    with pytest.raises(ValueError, match="must be an int"):
        SumDigitsEnv(**kwargs)
