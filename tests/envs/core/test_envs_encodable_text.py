"""Envs return only text UTF-8 can encode: surrogate code points in an action (or in what a
subclass returns) are replaced by U+FFFD and counted in info `replaced_chars`, in the TextEnv
base class, so every TextEnv and ToolEnv gets it."""

import warnings
from typing import Any

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from sandbox_testlib import make_env

from toolgym.envs import TextEnv, list_envs
from toolgym.envs.core.info import REPLACED_CHARS
from toolgym.envs.core.text_env import encodable_text

ACTION = "\ud800LOOKUP[\udfff]"


@pytest.mark.parametrize("env_id", sorted(list_envs()))
def test_lone_surrogates_in_an_action_are_replaced_and_counted(env_id):
    env = make_env(env_id)  # skipped where an env's code sandbox cannot start
    env.reset(seed=0)
    observation, _, _, _, info = env.step(ACTION)
    observation.encode("utf-8")  # was: UnicodeEncodeError, the action's surrogates echoed back
    assert "\ud800" not in observation and "\udfff" not in observation
    assert info[REPLACED_CHARS] == 2 and env.observation_space.contains(observation)
    env.reset(seed=0)
    _, _, _, _, info = env.step("LOOKUP[x]")
    assert REPLACED_CHARS not in info  # present only when something was replaced


class EchoEnv(TextEnv):
    """A plain TextEnv with its own step: echoes the action and adds a surrogate of its own."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        return "question \udc80", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        return f"you said {action} \udc81", 0.0, False, False, {}


class LoudEchoEnv(EchoEnv):
    """Overrides step again and calls super(): each character is still counted once."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        observation, reward, terminated, truncated, info = super().step(action)
        return observation.upper() + "\ud801", reward, terminated, truncated, info


def test_every_text_env_subclass_gets_it():
    env = EchoEnv()
    observation, info = env.reset(seed=0)
    assert observation == "question \ufffd" and info[REPLACED_CHARS] == 1
    observation, _, _, _, info = env.step(ACTION)
    assert observation == "you said \ufffdLOOKUP[\ufffd] \ufffd" and info[REPLACED_CHARS] == 3
    observation, _, _, _, info = LoudEchoEnv().step(ACTION)
    assert observation == "YOU SAID \ufffdLOOKUP[\ufffd] \ufffd\ufffd" and info[REPLACED_CHARS] == 4
    gymnasium.register("test/Echo-v0", entry_point=EchoEnv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_env(gymnasium.make("test/Echo-v0").unwrapped)
    finally:
        del gymnasium.registry["test/Echo-v0"]


def test_encodable_text():
    assert encodable_text("plain ünïcode 😀") == ("plain ünïcode 😀", 0)
    assert encodable_text("\ud83d\ude00") == ("\ufffd\ufffd", 2)  # a pair split into code points
