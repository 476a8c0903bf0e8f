"""Shop: JSON tool calls with a two-argument typed tool and a decimal answer."""

import json
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from toolgym.envs import ShopEnv


def call(**arguments):
    return f"<tool_call>\n{json.dumps({'name': 'price', 'arguments': arguments})}\n</tool_call>"


def test_shop_is_registered_and_passes_check_env():
    env = gymnasium.make("toolgym/Shop-v0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)


@pytest.mark.parametrize("seed", range(30))
def test_oracle_solves_it_with_a_decimal_answer(seed):
    env = ShopEnv()
    question, info = env.reset(seed=seed)
    assert question.startswith("What do") and isinstance(info["answer"], float)
    assert [t["function"]["name"] for t in info["tools"]] == ["price"]
    total = 0.0
    for action in env.oracle_actions():
        obs, reward, terminated, _truncated, info = env.step(action)
        total += reward
    assert (obs, terminated, info["failure_mode"], total) == ("CORRECT", True, "success", pytest.approx(1.2))


def test_prices_change_every_episode_and_the_tool_checks_its_arguments():
    env = ShopEnv()
    answers = set()
    for seed in range(20):
        env.reset(seed=seed)
        answers.add(env.answer)
    assert len(answers) > 15 and any(a != int(a) for a in answers)
    env.reset(seed=0)
    assert (
        env.step(call(item="dragon", quantity=1))[0]
        == "<tool_response>\nwe do not sell 'dragon'\n</tool_response>"
    )
    assert "quantity must be 1 to 9" in env.step(call(item="kite", quantity=12))[0]
    env.reset(seed=0)
    obs = env.step(call(item="kite", quantity="3"))[0]
    assert "argument `quantity`: expected `int`, got `str`" in obs
    env.reset(seed=0)
    exact = env.answer
    assert env.step(f"[ANSWER] {exact + 0.01:.2f}")[0].startswith("INCORRECT")
