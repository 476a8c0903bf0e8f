"""The text a `ToolEnv` writes for the policy: the finish line and instructions of its system
prompt, its error lines, the lines that end an episode on a limit, and the verdict on an answer.

Tests and recordings compare these strings exactly: a change here changes every transcript.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from ..tools.call_formats import ToolCallFormat
from ..tools.typed import Tool
from .grading import Grade

STOP_TOOL_LIMIT: Final = "STOP: tool call limit reached."
STOP_ERROR_STREAK: Final = "STOP: too many errors in a row."
STOP_TURN_LIMIT: Final = "STOP: turn limit reached."

# A refused call whose message is shown as it is; other refusals are prefixed `ERROR: `.
_SHOWN_AS_IS: Final = ("tool_error", "empty_argument", "tool_timeout")


def finish_line(answer_tool: Tool | None, grader: Any) -> str:
    """How to end the episode: call the answer tool, or `[ANSWER] <the grader's hint>`."""
    hint = getattr(grader, "hint", "<answer>") if grader is not None else "<answer>"
    if answer_tool is not None:
        return f"Finish by calling {answer_tool.name} with the answer."
    return f"Finish with [ANSWER] {hint}."


def instructions_text(instructions: str, finish: str, example: str) -> str:
    """The system prompt without the format's description of the tools (reset info
    `instructions`, for a chat template that writes the tools block itself)."""
    return "\n".join([instructions.strip(), finish, *(["Example:", example.strip()] if example else [])])


def error_lines(format: ToolCallFormat, tools: Sequence[Tool], finish: str) -> dict[str, str]:
    """The observation for each error an action as a whole can make (no call's own error)."""
    first = tools[0] if tools else None
    call_or = "Call a tool or f" if tools else "F"
    nothing = "no tool call and no answer" if tools else "no answer"
    finish = call_or + finish[1:]
    return {
        "empty_action": f"ERROR: empty action. {finish}",
        "no_call_no_answer": f"ERROR: {nothing}. {finish}",
        "malformed_call": malformed_call(format, first),
        "mixed_call_and_answer": "ERROR: tool calls and an answer in one turn. Call the tools, "
        "wait for their results, then answer.",
    }


def malformed_call(format: ToolCallFormat, tool: Tool | None, reason: str = "") -> str:
    """The error for a malformed call; `reason` (what was wrong, where the format can tell) in
    parentheses. Without one it is the seed experiment's line, word for word."""
    why = f" ({reason})" if reason else ""
    return f"ERROR: malformed tool call{why}. Write it like {format.call_example(tool)}."


def malformed_answer(unreadable: Exception, finish: str = "") -> str:
    """The error for an answer the grader cannot read; `finish` follows it when given."""
    line = f"ERROR: malformed answer ({unreadable})."
    return f"{line} {finish}" if finish else line


def refused_call(kind: str, message: str) -> str:
    """The result text of a call that was refused (bad arguments) or failed."""
    return message if kind in _SHOWN_AS_IS else f"ERROR: {message}"


def verdict(grade: Grade, truth: str) -> str:
    """The last observation after a graded answer; `truth` is the answer as text."""
    if grade.correct:
        return "CORRECT"
    if grade.score > 0:
        return f"PARTLY CORRECT (score {grade.score:.2f}; answer: {truth})"
    return f"INCORRECT (answer: {truth})"


def with_stop(observation: str, stop: str | None) -> str:
    """The observation with the limit's STOP line after it."""
    if stop is None:
        return observation
    return f"{observation}\n{stop}" if observation else stop
