"""The env hooks the rollout runner calls (envs/core/text_env.py): declared on TextEnv with their
defaults, overridden by ToolEnv, and read off a plain gymnasium.Env by name through `env_hooks`."""

from typing import ClassVar

import gymnasium
import numpy as np
import pytest

from toolgym.envs import SumDigitsEnv, ZorplexEnv
from toolgym.envs.core.text_env import PlainEnvHooks, TextEnv, env_hooks


class Bare(TextEnv):
    """A TextEnv that overrides no hook."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "q", {}

    def step(self, action):
        return "done", 0.0, True, False, {}


def test_a_text_env_gets_the_declared_defaults():
    env = Bare()
    assert env.step_waits is False and env.context_policy is None and env.abandon() is None
    assert env.malformed_action("x") is None and env.wrong_note_actions(None) is None
    assert env.wrong_lookup_actions(None, 0.5) is None
    with pytest.raises(NotImplementedError):
        env.oracle_actions()


def test_tool_envs_override_them_and_env_hooks_unwraps():
    env = gymnasium.make("toolgym/Zorplex-v0", tier="recursive", notes=True, max_turns=10)
    hooks = env_hooks(env)  # gymnasium.make wraps the env
    assert hooks is env.unwrapped
    assert hooks.context_policy == {"policy": "notes"} and hooks.step_waits is False
    env.reset(seed=0)
    reward, info = hooks.abandon()  # settled as unanswered
    assert isinstance(reward, float) and info["failure_mode"] == "no_answer"
    assert env_hooks(ZorplexEnv(tier="simple")).context_policy is None
    lookups = SumDigitsEnv()
    lookups.reset(seed=0)
    assert lookups.wrong_lookup_actions(np.random.default_rng(0), 1.0) is None  # no such script


class Plain(gymnasium.Env):
    """A plain gymnasium.Env with some hooks of its own."""

    metadata = {"render_modes": []}  # noqa: RUF012
    step_waits = True
    answer = 7

    def oracle_actions(self):
        return ["[ANSWER] 7"]

    def answer_action(self, answer, tagged=True):
        return f"[ANSWER] {answer}" if tagged else str(answer)

    def abandon(self):
        return -1.0, {"why": "cut"}


def test_a_plain_env_has_its_own_hooks_by_name_else_the_defaults():
    hooks = env_hooks(Plain())
    assert isinstance(hooks, PlainEnvHooks)
    assert hooks.step_waits is True and hooks.context_policy is None
    assert hooks.abandon() == (-1.0, {"why": "cut"})
    assert hooks.oracle_actions() == ["[ANSWER] 7"] and hooks.answer == 7
    assert hooks.answer_action(3, tagged=False) == "3"
    assert hooks.malformed_action("x") is None and hooks.wrong_note_actions(None) is None

    bare = env_hooks(gymnasium.make("CartPole-v1"))
    assert bare.step_waits is False and bare.abandon() is None
    with pytest.raises(TypeError, match="CartPoleEnv has no oracle_actions"):
        bare.oracle_actions()
    with pytest.raises(TypeError, match="has no answer"):
        _ = bare.answer


class WindowedZorplex(ZorplexEnv):
    """docs/context.md's way: the env sets its policy in __init__, from its own knob."""

    def __init__(self, window: int = 2, **knobs):
        super().__init__(**knobs)
        self.context_policy = {"policy": "window", "turns": window}


class PlainWindowed(Bare):
    def __init__(self, turns: int = 3):
        super().__init__()
        self.context_policy = {"policy": "window", "turns": turns}


def test_an_env_sets_its_context_policy_in_init_from_its_knobs():
    # it raised "property 'context_policy' of ... object has no setter"
    assert WindowedZorplex(window=3, tier="recursive").context_policy == {"policy": "window", "turns": 3}
    assert WindowedZorplex(window=2, tier="recursive", notes=True, max_turns=10).context_policy == {"policy": "window", "turns": 2}
    assert PlainWindowed(4).context_policy == {"policy": "window", "turns": 4}
    assert env_hooks(WindowedZorplex(window=5, tier="simple")).context_policy["turns"] == 5
    assert ZorplexEnv(tier="recursive", notes=True, max_turns=10).context_policy == {"policy": "notes"}  # the derived one stays

    class Declared(ZorplexEnv):
        context_policy: ClassVar[dict] = {"policy": "window", "turns": 1}  # a class attribute still works

    assert Declared(tier="simple").context_policy == {"policy": "window", "turns": 1}
