"""`Task` (one episode's question, answer, ideal solution and state, made by `ToolEnv.new_task`)
and `Example` (a worked example for the system prompt)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ..tools.typed import Call


def _plain(value: Any) -> Any:
    """numpy scalars (from rng draws) as Python ones: `int64(3)` -> 3, `float64(1.864)` -> 1.864."""
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        return item()
    return value


@dataclass(frozen=True, slots=True)
class Task:
    """One episode's task, made by `ToolEnv.new_task`.

    question: the first observation. answer: the ground truth, any JSON value (a float is kept
    exactly; numpy scalars become Python ones). solution: the ideal steps before the answer, one
    entry per turn: a `Call`, a list of Calls (several in one turn) or a literal action string;
    the env writes them in its tool-call format and adds the answer (`env.oracle_actions()`).
    needed_tool_calls: calls beyond this many are penalised; by default the solution's calls.
    state: the episode's mutable state (`env.state`), which tools read and change and the grader
    and `final_reward` see.
    """

    question: str
    answer: Any
    solution: Sequence[Call | Sequence[Call] | str] = ()
    needed_tool_calls: int = -1
    state: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.question, str):
            raise TypeError(f"Task.question must be a str, got {type(self.question).__name__}")
        answer = _plain(self.answer)
        if isinstance(answer, float) and not math.isfinite(answer):
            raise ValueError(f"Task.answer must be finite, got {answer!r}")
        try:
            msgspec.json.encode(answer)
        except (TypeError, msgspec.EncodeError):
            raise TypeError(f"Task.answer must be a JSON value, got {type(answer).__name__}") from None
        object.__setattr__(self, "answer", answer)
        steps = [self.solution] if isinstance(self.solution, str | Call) else list(self.solution)
        calls = 0
        for step in steps:
            if isinstance(step, str | Call):
                calls += 1
            elif isinstance(step, Sequence) and step and all(isinstance(c, Call) for c in step):
                calls += len(step)
            else:
                raise TypeError(
                    f"Task.solution steps are Calls, lists of Calls or action strings, got {step!r:.80}"
                )
        object.__setattr__(self, "solution", tuple(steps))
        if self.needed_tool_calls < 0:
            object.__setattr__(self, "needed_tool_calls", calls)


class Example(msgspec.Struct, frozen=True):
    """A worked example for the system prompt, which the env writes in its own tool-call format:
    the question, the (call, result) steps, the answer."""

    question: str
    steps: Sequence[tuple[Call, Any]] = ()
    answer: Any = None
