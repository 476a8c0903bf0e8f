"""The limits that end a `ToolEnv` episode without an answer, checked after each step in this
order: the tool budget, the error streak, `max_turns`."""

from __future__ import annotations

from dataclasses import dataclass

from .prompts import STOP_ERROR_STREAK, STOP_TOOL_LIMIT, STOP_TURN_LIMIT


@dataclass(frozen=True, slots=True)
class Ending:
    """How a limit ended the episode: info `end_reason` and `failure_mode`, and the STOP line the
    observation ends with."""

    end_reason: str
    failure_mode: str
    stop: str


def limit_reached(
    *,
    out_of_calls: bool,
    consecutive_errors: int,
    consecutive_no_call: int,
    max_consecutive_errors: int | None,
    turn: int,
    max_turns: int,
    no_call: bool,
    errored: bool,
) -> Ending | None:
    """The limit this step reached, or None.

    out_of_calls: a call would have exceeded `max_tool_calls` (failure_mode tool_spam). An error
    streak of `max_consecutive_errors` ends as no_tool_call when every action in it had neither a
    call nor an answer, else parse_error. At `max_turns`, a single-turn env's one step that had no
    call (`no_call`) or an error (`errored`) ends as no_tool_call or parse_error.
    """
    if out_of_calls:
        return Ending("max_turns", "tool_spam", STOP_TOOL_LIMIT)
    limit = max_consecutive_errors
    if limit is not None and consecutive_errors >= limit:
        reason = "no_tool_call" if consecutive_no_call >= limit else "parse_error"
        return Ending(reason, "no_answer", STOP_ERROR_STREAK)
    if turn >= max_turns:
        if max_turns == 1 and no_call:
            reason = "no_tool_call"
        elif max_turns == 1 and errored:
            reason = "parse_error"
        else:
            reason = "max_turns"
        return Ending(reason, "no_answer", STOP_TURN_LIMIT)
    return None
