"""`TextEnv`: the Gymnasium interface of every toolgym env (Unicode text in, text out), the oracle
methods scripted policies and corpora use, and the wrapping that keeps un-encodable text (lone
surrogates) from ever crossing the env boundary.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

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

    def mistaken_actions(self) -> tuple[str, ...]:
        """Actions with one typical mistake each (malformed, empty, unknown tool, no answer), so
        that corpora and tests can show the env's error observations."""
        return ()
