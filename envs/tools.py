"""Tools, tasks, and the parser that finds tool calls and answers in an action string.

The action grammar (what `ToolEnv` understands), in the order it is checked:

1. `[ANSWER] <int>`: a tagged final answer. The tag is case-insensitive, may be followed by `:`
   or `=`, and the integer may be negative (`[ANSWER] -12`). The FIRST tag in the action counts.
   A tag with no integer right after it (`[ANSWER]`, `[ANSWER] -`, `[ANSWER] ten`) is a
   malformed answer. A bracket right after a tool NAME is a call's, not a tag: `LOOKUP[answer]`
   is a call with the argument `answer`.
2. `NAME[arg]`: a tool call. NAME is an identifier matched case-insensitively against the tools;
   nothing may stand between NAME and `[`; the argument may not contain brackets or a newline;
   surrounding whitespace and one pair of matching quotes are stripped (`lookup[ 'apple' ]` is
   `LOOKUP[apple]`). Every call in the action is returned, in order.
3. A known tool name followed by `[` or `(` that did not parse as a call (`LOOKUP[`,
   `LOOKUP [apple]`, `LOOKUP(apple)`) is a malformed call.
4. Otherwise, with untagged answers accepted, the LAST integer in the text is an untagged answer
   ("The answer is 42." answers 42).
5. Otherwise the action has neither a call nor an answer (empty when it is only whitespace).

Only the first `max_chars` characters of an action are parsed.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, NamedTuple

_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CALL_RE: Final = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)\[([^\[\]\n]*)\]")
_ANSWER_TAG_RE: Final = re.compile(r"\[\s*answer\s*\]", re.IGNORECASE)
_ANSWER_INT_RE: Final = re.compile(r"\s*[:=]?\s*(-?)([0-9]+)")
_INT_RE: Final = re.compile(r"(?<![0-9])(-?)([0-9]+)")
_IDENTIFIER_CHARS: Final = frozenset(string.ascii_letters + string.digits + "_")

# Answers are compared as ints; anything longer cannot equal a task's answer (and Python refuses
# int() on strings over 4300 digits), so longer digit strings are kept as "unrepresentable".
MAX_ANSWER_DIGITS: Final = 18

# One typical mistake each (malformed call, unknown tool, empty action, empty argument, malformed
# answer, no call and no answer, a call without brackets): `ToolEnv.mistaken_actions()`.
MISTAKEN_ACTIONS: Final = ("LOOKUP[", "FOO[x]", "", "LOOKUP[]", "[ANSWER]", "I am not sure.", "lookup apple")

# Parse outcomes (ParsedAction.kind).
ANSWER: Final = "answer"
BAD_ANSWER: Final = "bad_answer"
CALLS: Final = "calls"
BAD_CALL: Final = "bad_call"
UNTAGGED: Final = "untagged"
NOTHING: Final = "nothing"
EMPTY: Final = "empty"


class ToolError(Exception):
    """Raised by a tool function to reject its argument.

    The message becomes the call's result (`NAME[arg] = <message>`) and the call counts as an
    error (info `errors`, the error penalty, the consecutive-error limit). A tool that wants a
    "not found" to be an ordinary result simply returns a string instead.
    """


@dataclass(frozen=True, slots=True)
class Tool:
    """A named function the policy can call as `NAME[arg]`.

    name: an identifier; calls match it case-insensitively; it is shown upper-case.
    description: one line for the system prompt, e.g. "the zorplex value of a word".
    fn: str -> str; gets the argument (stripped, quotes removed, never empty) and returns the
        result text. Raise `ToolError` (or ValueError) to reject the argument.
    arg: what the argument is, for the prompt: `LOOKUP[word]: the zorplex value of a word`.
    """

    name: str
    description: str
    fn: Callable[[str], str]
    arg: str = "x"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"Tool name must be an identifier like LOOKUP, got {self.name!r}")
        if self.name.upper() == "ANSWER":
            raise ValueError("Tool name ANSWER is reserved for the [ANSWER] tag")
        if not self.description or "\n" in self.description:
            raise ValueError(f"Tool {self.name}: description must be one non-empty line")
        if not callable(self.fn):
            raise TypeError(f"Tool {self.name}: fn must be callable str -> str, got {self.fn!r}")
        object.__setattr__(self, "name", self.name.upper())

    @property
    def usage(self) -> str:
        return f"{self.name}[{self.arg}]"


@dataclass(frozen=True, slots=True)
class Task:
    """One episode's task, made by `ToolEnv.new_task`.

    question: the first observation. answer: the ground truth. oracle_actions: the ideal action
    strings, ending with `[ANSWER] <answer>`. needed_tool_calls: calls beyond this many are
    penalised; by default, the number of oracle actions before the answer.
    """

    question: str
    answer: int
    oracle_actions: tuple[str, ...]
    needed_tool_calls: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.answer, int) or isinstance(self.answer, bool):
            # numpy ints sneak in from rng draws; they are not JSON-serialisable.
            object.__setattr__(self, "answer", int(self.answer))
        object.__setattr__(self, "oracle_actions", tuple(self.oracle_actions))
        final = answer_action(self.answer)
        if not self.oracle_actions or self.oracle_actions[-1] != final:
            raise ValueError(f"Task.oracle_actions must end with '{final}', got {self.oracle_actions!r}")
        if self.needed_tool_calls < 0:
            object.__setattr__(self, "needed_tool_calls", len(self.oracle_actions) - 1)


class ParsedAction(NamedTuple):
    kind: str  # one of ANSWER, BAD_ANSWER, CALLS, BAD_CALL, UNTAGGED, NOTHING, EMPTY
    answer: int | None = None  # ANSWER/UNTAGGED: the int, or None when it has too many digits
    calls: list[tuple[str, str]] | None = None  # CALLS: (NAME as written, raw argument)


def _to_int(sign: str, digits: str) -> int | None:
    digits = digits.lstrip("0") or "0"
    if len(digits) > MAX_ANSWER_DIGITS:
        return None
    return -int(digits) if sign else int(digits)


def answer_action(answer: int, tagged: bool = True) -> str:
    """The action that answers `answer`: `[ANSWER] 42`, or untagged `The answer is 42.`."""
    return f"[ANSWER] {answer}" if tagged else f"The answer is {answer}."


def malformed_call(action: str) -> str | None:
    """`action`'s first tool call with parentheses for brackets (`LOOKUP[cat]` -> `LOOKUP(cat)`,
    which the parser reads as a malformed call), or None when it has no call."""
    broken = _CALL_RE.sub(r"\1(\2)", action, count=1)
    return None if broken == action else broken


def clean_argument(raw: str) -> str:
    """Strip whitespace and one pair of matching quotes: ` 'apple' ` -> `apple`."""
    arg = raw.strip()
    if len(arg) >= 2 and arg[0] == arg[-1] and arg[0] in "'\"":
        arg = arg[1:-1].strip()
    return arg


def near_miss_pattern(tool_names: Iterable[str]) -> re.Pattern[str] | None:
    """A regex that finds a known tool name followed by `[` or `(` (a call attempt)."""
    names = sorted({n.upper() for n in tool_names}, key=len, reverse=True)
    if not names:
        return None
    return re.compile(r"(?<![A-Za-z0-9_])(?:" + "|".join(names) + r")\s*[\[(]", re.IGNORECASE)


def _answer_tag(text: str) -> re.Match[str] | None:
    """The first `[ANSWER]` tag whose bracket does not open a tool call's argument.

    The bracket is a call's when a NAME that `_CALL_RE` would match ends right before it: a run of
    identifier characters that does not start with a digit (`42[ANSWER] 42` is still tagged).
    Each scan stops at the previous non-identifier character, so all scans together are linear.
    """
    for tag in _ANSWER_TAG_RE.finditer(text):
        start = tag.start()
        while start > 0 and text[start - 1] in _IDENTIFIER_CHARS:
            start -= 1
        if start == tag.start() or text[start].isdigit():
            return tag
    return None


def parse_action(text: str, near_miss: re.Pattern[str] | None, accept_untagged: bool = True) -> ParsedAction:
    """Classify an (already length-capped) action string. Never raises on any `str`."""
    if "[" in text:
        tag = _answer_tag(text)
        if tag is not None:
            number = _ANSWER_INT_RE.match(text, tag.end())
            if number is None:
                return ParsedAction(BAD_ANSWER)
            return ParsedAction(ANSWER, _to_int(number.group(1), number.group(2)))
        calls = _CALL_RE.findall(text)
        if calls:
            return ParsedAction(CALLS, None, calls)
    if near_miss is not None and near_miss.search(text):
        return ParsedAction(BAD_CALL)
    if accept_untagged:
        number = None
        for number in _INT_RE.finditer(text):  # noqa: B007 (keep the last one)
            pass
        if number is not None:
            return ParsedAction(UNTAGGED, _to_int(number.group(1), number.group(2)))
    if not text.strip():
        return ParsedAction(EMPTY)
    return ParsedAction(NOTHING)
