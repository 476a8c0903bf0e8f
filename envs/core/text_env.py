"""`TextEnv`: the Gymnasium interface of every toolgym env (Unicode text in, text out), the
optional hooks the rollout runner calls (declared here with their defaults), the oracle methods
scripted policies and corpora use, and the wrapping that keeps un-encodable text (lone
surrogates) from ever crossing the env boundary.

The hooks, each with the default an env that does not override it gets:
- `step_waits` (False): `step` may wait on something outside the process (a sandbox, a server),
  so the runner steps the env in a worker thread.
- `context_policy` (None): the context policy the env declares, a spec dict such as
  {"policy": "notes"} (rollouts/context.py), applied unless the run config sets one.
- `abandon()` (None: nothing to settle): the runner stopped the episode before the env ended it;
  returns (reward to add to the last step, info to merge into it), settled as the env's own
  limits would (envs/core/tool_env.py).
- the oracle: `oracle_actions()`, `malformed_action()`, `answer_action()`,
  `wrong_note_actions()`, `wrong_lookup_actions()` and `answer` (rollouts/scripted.py).

An env registered with Gymnasium need not be a TextEnv: `env_hooks(env)` is the one place that
reads these hooks off any env, a TextEnv's as declared, a plain `gymnasium.Env`'s by name (its own
method or attribute where it has one, else the default above).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import gymnasium

from .info import REPLACED_CHARS
from .spaces import UnicodeText

_SURROGATE = re.compile("[\ud800-\udfff]")


def encodable_text(text: str) -> tuple[str, int]:
    """`text` with every surrogate code point (which UTF-8 cannot encode, so no tokenizer or
    recording can take it) replaced by U+FFFD, and how many were replaced."""
    return _SURROGATE.subn("\ufffd", text)


def _encodable_reset(
    reset: Callable[..., tuple[Any, dict[str, Any]]],
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    @functools.wraps(reset)
    def wrapped(self: TextEnv, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        observation, info = reset(self, *args, **kwargs)
        if isinstance(observation, str):
            observation, replaced = encodable_text(observation)
            if replaced and isinstance(info, dict):
                info[REPLACED_CHARS] = info.get(REPLACED_CHARS, 0) + replaced
        return observation, info

    return wrapped


def _encodable_step(step: Callable[..., tuple[Any, ...]]) -> Callable[..., tuple[Any, ...]]:
    @functools.wraps(step)
    def wrapped(self: TextEnv, action: Any) -> tuple[Any, ...]:
        replaced = 0
        if isinstance(action, str):
            action, replaced = encodable_text(action)
        observation, reward, terminated, truncated, info = step(self, action)
        if isinstance(observation, str):
            observation, more = encodable_text(observation)
            replaced += more
        if replaced and isinstance(info, dict):  # an outer override's wrapper adds its own count
            info[REPLACED_CHARS] = info.get(REPLACED_CHARS, 0) + replaced
        return observation, reward, terminated, truncated, info

    return wrapped


class TextEnv(gymnasium.Env[str, str]):
    """A Gymnasium env whose observations and actions are Unicode strings.

    Subclasses provide `system_prompt`, `question`, `answer` (after `reset`) and the oracle:
    `oracle_actions()`, `malformed_action()`, `answer_action()` and `mistaken_actions()`, which
    the scripted policy (rollouts/scripted.py) and the tokenizer corpus (tools/build_tokenizer.py)
    use so that they know no env's action grammar. Randomness comes only from `self.np_random`
    (seeded by `reset(seed=...)`). The info keys the runner reads: envs/core/info.py.

    Only encodable text crosses the env boundary: every subclass's `step` and `reset` are wrapped
    (`__init_subclass__`) so that surrogate code points in the action (which a caller may pass,
    e.g. `"\\ud800LOOKUP[\\udfff]"`) and in the observation are replaced by U+FFFD before the env
    sees or returns them, counted in info `replaced_chars` (present only when > 0).
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (Gymnasium's class attribute)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "step" in cls.__dict__:
            cls.step = _encodable_step(cls.__dict__["step"])  # type: ignore[method-assign]
        if "reset" in cls.__dict__:
            cls.reset = _encodable_reset(cls.__dict__["reset"])  # type: ignore[method-assign]

    def __init__(self, *, max_action_chars: int = 4096, max_observation_chars: int = 8192):
        self.action_space = UnicodeText(max_action_chars)
        self.observation_space = UnicodeText(max_observation_chars)

    @property
    def system_prompt(self) -> str:
        raise NotImplementedError

    @property
    def question(self) -> str:
        raise NotImplementedError

    @property
    def answer(self) -> Any:
        raise NotImplementedError

    def oracle_actions(self) -> list[str]:
        """The ideal actions for the current task; the last one states the final answer
        (`answer_action(self.answer)`)."""
        raise NotImplementedError

    def malformed_action(self, action: str) -> str | None:
        """A fumbled version of one of the oracle's non-final actions, which the env answers with
        an error observation (a recoverable mistake), or None when the action has none."""
        return None

    def answer_action(self, answer: Any, tagged: bool = True) -> str:
        """The action that states `answer` as the final answer; `tagged=False`: stated without the
        env's answer format (graded for correctness, no format credit)."""
        raise NotImplementedError

    def wrong_note_actions(self, rng: Any) -> list[str] | None:
        """A fallible note-taker's script for the current task (an env with notes): one note
        written wrong and followed to the end, the last action the answer it reaches; `rng` a
        numpy Generator to draw where and how. None (the default) when the env takes no notes."""
        return None

    def wrong_lookup_actions(self, rng: Any, p: float) -> list[str] | None:
        """A demonstrator whose every lookup independently goes wrong with probability `p` (an env
        whose lookups are independent sub-tasks), answering what it looked up; `rng` a numpy
        Generator. None (the default) when the env has no such script, or no lookup went wrong."""
        return None

    def mistaken_actions(self) -> tuple[str, ...]:
        """Actions with one typical mistake each (malformed, empty, unknown tool, no answer), so
        that corpora and tests can show the env's error observations."""
        return ()

    # ---- the rollout runner's hooks (module doc) ------------------------------------------------

    @property
    def step_waits(self) -> bool:
        """Whether `step` may wait on something outside the process: the runner then steps this
        env in a worker thread. False unless a subclass says otherwise."""
        return False

    # The context policy this env declares (a spec dict, rollouts/context.py), or None: the runner
    # keeps the whole conversation unless the run config sets one. A plain attribute, so an env
    # sets it as a class attribute, in `__init__` (e.g. from its knobs), or as a property.
    context_policy: Mapping[str, Any] | None = None

    def abandon(self) -> tuple[float, dict[str, Any]] | None:
        """Settle an episode the runner stopped before the env ended it: (reward to add to the last
        step, info to merge into it), or None (the default) when there is nothing to settle."""
        return None


class EnvHooks(Protocol):
    """The hooks the rollout layer calls on an env (module doc); `TextEnv` declares them."""

    @property
    def step_waits(self) -> bool: ...

    @property
    def context_policy(self) -> Mapping[str, Any] | None: ...

    def abandon(self) -> tuple[float, dict[str, Any]] | None: ...

    @property
    def answer(self) -> Any: ...

    def oracle_actions(self) -> list[str]: ...

    def malformed_action(self, action: str) -> str | None: ...

    def answer_action(self, answer: Any, tagged: bool = True) -> str: ...

    def wrong_note_actions(self, rng: Any) -> list[str] | None: ...

    def wrong_lookup_actions(self, rng: Any, p: float) -> list[str] | None: ...


def env_hooks(env: gymnasium.Env) -> EnvHooks:
    """The hooks of `env` (wrapped or not): its unwrapped TextEnv itself, or, for a plain
    `gymnasium.Env`, `PlainEnvHooks` over it."""
    unwrapped = env.unwrapped
    return unwrapped if isinstance(unwrapped, TextEnv) else PlainEnvHooks(unwrapped)


class PlainEnvHooks:
    """A plain `gymnasium.Env`'s hooks, read by name: its own method or attribute of the hook's
    name where it has one, else TextEnv's default. The oracle's required methods (and `answer`)
    raise TypeError naming what the env lacks."""

    def __init__(self, env: gymnasium.Env) -> None:
        self.env = env

    def _own(self, name: str) -> Any:
        return getattr(self.env, name, None)

    def _call(self, name: str, *args: Any) -> Any:
        """The env's own method `name` called with `args`; None (the default) when it has none."""
        own = self._own(name)
        return own(*args) if callable(own) else None

    def _required(self, name: str) -> Any:
        member = self._own(name)
        if member is None:
            raise TypeError(
                f"{type(self.env).__name__} has no {name}; the oracle needs it (envs/core/text_env.py)"
            )
        return member

    @property
    def step_waits(self) -> bool:
        return bool(self._own("step_waits"))

    @property
    def context_policy(self) -> Mapping[str, Any] | None:
        return self._own("context_policy")

    def abandon(self) -> tuple[float, dict[str, Any]] | None:
        return self._call("abandon")

    @property
    def answer(self) -> Any:
        return self._required("answer")

    def oracle_actions(self) -> list[str]:
        return self._required("oracle_actions")()

    def malformed_action(self, action: str) -> str | None:
        return self._call("malformed_action", action)

    def answer_action(self, answer: Any, tagged: bool = True) -> str:
        return self._required("answer_action")(answer, tagged=tagged)

    def wrong_note_actions(self, rng: Any) -> list[str] | None:
        return self._call("wrong_note_actions", rng)

    def wrong_lookup_actions(self, rng: Any, p: float) -> list[str] | None:
        return self._call("wrong_lookup_actions", rng, p)
