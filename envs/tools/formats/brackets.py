"""The "brackets" format (Zorplex's, the seed experiment's), read left to right:
1. `NAME[arg]`: a tool call. NAME is an identifier matched case-insensitively; nothing may stand
   between NAME and `[`. The argument runs to the `]` that pairs with that `[` on the same line:
   balanced brackets inside it are part of it (`PYTHON[print([1, 2])]`), a newline is not. A
   fence takes any text instead: `NAME[```text```]`, a run of three or more backticks right after
   the `[` and the same run right before the `]` that ends it; the text between (newlines,
   unbalanced brackets, anything; a longer run holds a shorter one) is the argument. A tool with
   one parameter takes the whole text, commas included: stripped of whitespace and, outside a
   fence, of one pair of matching quotes. A tool with several takes them comma-separated, in
   order (`CONVERT[1.5, km]`), or by name, each value stripped of both (fenced or not). Every
   call in the action counts, in order; whatever is inside a call's argument is text, not a call
   or a tag.
   A `[` that never closes opens nothing (a call after it still counts); a fence that never
   closes takes the rest of the action.
2. `[ANSWER] <answer>` outside any call: a tagged final answer: the rest of the line after the
   tag, up to another tag (an optional `:` or `=` skipped); the grader reads it strictly
   (`[ANSWER] 28 or 29` is no number). The tag is case-insensitive and the FIRST one counts; the
   action's calls are then ignored. A bracket right after a tool NAME is a call's:
   `LOOKUP[answer]` is a call.
3. No call and no tag, but a known tool name followed by `[` or `(`, or a JSON `<tool_call>`
   block (the other format): a malformed call. A fault of what an argument may hold says what
   was wrong and where (`ParsedAction.reason`, shown in the error): brackets inside that do not
   pair up (`unbalanced '[' at column 7`), an argument that runs past its line, a fence that
   never closes. The seed grammar's own faults, a shape (`LOOKUP(cat)`, `LOOKUP [cat]`, a JSON
   block) or a `[` with no bracket after it on its line (`LOOKUP[`, `LOOKUP[apple`), keep its
   line, `Write it like LOOKUP[word].`, word for word: scripted demonstrations fumble calls that
   way and the shipped tokenizer is built from these texts.
4. Otherwise the action has no call and no tag (empty when it is only whitespace).
`render_call` fences a one-parameter tool's value that the plain form would not read back as it
is (a newline, unbalanced brackets, a pair of quotes around it, a leading fence).
"""

from __future__ import annotations

import inspect
import re
import string
from collections.abc import Iterable, Sequence
from typing import Any, Final, NamedTuple

from ...core.grading import answer_text
from ..typed import Call, Tool
from .base import (
    ANSWER,
    ANSWER_TAG_RE,
    BAD_CALL,
    CALLS,
    EMPTY,
    OTHER,
    SHOWN_NAME_CHARS,
    ParsedAction,
    ParsedCall,
    ToolCallFormat,
    after_tag,
    clean_argument,
    near_miss_pattern,
)

_CALL_RE: Final = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)\[([^\[\]\n]*)\]")
_BRACKET_EVENT_RE: Final = re.compile(r"[\[\]\n]")
_FENCE_RE: Final = re.compile(r"`{3,}")
_IDENTIFIER_CHARS: Final = frozenset(string.ascii_letters + string.digits + "_")
_SHOWN_ARG_CHARS: Final = 40  # arguments echoed in bracket observations are cut to this


def _name_before(text: str, at: int) -> int:
    """Where the tool NAME that ends right before `text[at]` starts, or -1 when there is none (no
    identifier characters, or they start with a digit: `42[ANSWER]` is no call). Each scan stops
    at the previous non-identifier character, so the scans of all brackets together are linear."""
    start = at
    while start > 0 and text[start - 1] in _IDENTIFIER_CHARS:
        start -= 1
    return -1 if start == at or text[start].isdigit() else start


def _bracket_pairs(text: str) -> tuple[list[int], dict[int, int]]:
    """Every `[` in order, and each `[` -> the `]` that pairs with it on the same line."""
    opens: list[int] = []
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for event in _BRACKET_EVENT_RE.finditer(text):
        at, char = event.start(), event.group()
        if char == "[":
            opens.append(at)
            stack.append(at)
        elif char == "]":
            if stack:
                pairs[stack.pop()] = at
        else:  # a newline: the brackets still open on this line never close
            stack.clear()
    return opens, pairs


def _where(text: str, at: int) -> str:
    """`column 7`, or `line 2, column 7` past the first line (1-based)."""
    line = text.count("\n", 0, at) + 1
    column = at - (text.rfind("\n", 0, at) + 1) + 1
    return f"column {column}" if line == 1 else f"line {line}, column {column}"


def _closes_later(text: str, at: int) -> bool:
    """Whether the `[` at `at` would pair with a `]` if its argument could run past its line."""
    depth = 0
    for event in _BRACKET_EVENT_RE.finditer(text, at):
        if event.group() == "[":
            depth += 1
        elif event.group() == "]":
            depth -= 1
            if depth == 0:
                return True
    return False


def _shown_argument(arg: str) -> str:
    """An argument as a bracket observation echoes it: newlines written `\\n`, cut to a length."""
    arg = arg.replace("\n", "\\n")
    return arg if len(arg) <= _SHOWN_ARG_CHARS else arg[: _SHOWN_ARG_CHARS - 3] + "..."


class _Fault(NamedTuple):
    """A `NAME[` that did not close: where NAME starts, its `[`, and whether a fence was open."""

    start: int
    bracket: int
    fence: str = ""


class _BracketScan(NamedTuple):
    tag: re.Match[str] | None  # the first `[ANSWER]` outside any call
    calls: list[ParsedCall]
    faults: list[_Fault]


def _scan_brackets(text: str) -> _BracketScan:
    """The action's calls and its first tag, left to right (see the module doc, "brackets").
    Linear in the text: each `[` is looked at once, each call's text skipped once."""
    opens, pairs = _bracket_pairs(text)
    calls: list[ParsedCall] = []
    faults: list[_Fault] = []
    done = 0  # where the last call ended: brackets before it are inside it
    for at in opens:
        if at < done:
            continue
        start = _name_before(text, at)
        if start < 0:
            tag = ANSWER_TAG_RE.match(text, at)
            if tag is not None:
                return _BracketScan(tag, calls, faults)
            continue
        name, shown_name = text[start:at], text[start:at][:SHOWN_NAME_CHARS]
        fence = _FENCE_RE.match(text, at + 1)
        if fence is not None:
            run = fence.group()
            end = text.find(run + "]", fence.end())
            if end < 0:  # the rest of the action is the unclosed fence's text
                faults.append(_Fault(start, at, run))
                break
            raw, done = text[fence.end() : end], end + len(run) + 1
            shown = f"{shown_name}[{run}{_shown_argument(raw.strip())}{run}]"
            calls.append(ParsedCall(name, raw, shown, fenced=True))
            continue
        end = pairs.get(at, -1)
        if end < 0:
            faults.append(_Fault(start, at))
            continue
        raw, done = text[at + 1 : end], end + 1
        calls.append(ParsedCall(name, raw, f"{shown_name}[{_shown_argument(clean_argument(raw))}]"))
    return _BracketScan(None, calls, faults)


def _fault_reason(text: str, fault: _Fault) -> str:
    """What was wrong with a `NAME[` that did not close, and where (the error's parenthesis):
    an unclosed fence, a `]` on a later line, brackets inside that do not pair up. "" for the
    seed grammar's own fault, a `[` with no bracket after it on its line (`LOOKUP[apple`): its
    error line stays word for word (the shipped tokenizer's corpus and scripted demonstrations
    hold it)."""
    if fault.fence:
        where = _where(text, fault.bracket + 1)
        return f"the fence {fault.fence} at {where} is never closed: end the argument with {fault.fence}]"
    fenced = f"{text[fault.start : fault.bracket]}[```...```]"
    if _closes_later(text, fault.bracket):
        return (
            f"the '[' at {_where(text, fault.bracket)} closes on a later line: an argument is one "
            f"line; fence text with newlines: {fenced}"
        )
    line_end = text.find("\n", fault.bracket)
    rest = text[fault.bracket + 1 : line_end if line_end >= 0 else len(text)]
    if "[" not in rest and "]" not in rest:
        return ""
    return (
        f"unbalanced '[' at {_where(text, fault.bracket)}: brackets inside an argument must pair "
        f"up; fence any other text: {fenced}"
    )


def _needs_fence(value: str) -> bool:
    """Whether the plain form `NAME[value]` would not read `value` back as it is."""
    quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""
    if quoted or "\n" in value or value.startswith("```"):
        return True
    text = f"X[{value}]"
    return _bracket_pairs(text)[1].get(1) != len(text) - 1


def _fenced(value: str) -> str:
    """`value` in a fence longer than any run of backticks in it (a space between the fence and
    a backtick at either end, which the reader strips)."""
    longest = max((len(m.group()) for m in re.finditer(r"`+", value)), default=0)
    fence = "`" * max(3, longest + 1)
    pad = " " if value[:1] == "`" or value[-1:] == "`" else ""
    return f"{fence}{pad}{value}{pad}{fence}"


def _keyword_arguments(raw: str, names: Sequence[str]) -> dict[str, str] | None:
    """`name=value, ...` where every name is a parameter's: those arguments by name; None for
    positional text (a value that merely holds `=` is not a keyword)."""
    if "=" not in raw:
        return None
    pairs = [piece.split("=", 1) for piece in raw.split(",")]
    if any(len(pair) != 2 or pair[0].strip() not in names for pair in pairs):
        return None
    return {key.strip(): clean_argument(value) for key, value in pairs}


class BracketFormat(ToolCallFormat):
    name = "brackets"

    def near_miss(self, tool_names: Iterable[str]) -> re.Pattern[str] | None:
        return near_miss_pattern(tool_names)

    def unknown_tool(self, call: ParsedCall, tools: Sequence[Tool]) -> str:
        return f"{call.shown} = {self.unknown_tool_text(call, tools)}"

    def unknown_tool_text(self, call: ParsedCall, tools: Sequence[Tool]) -> str:
        # The seed experiment's grammar, kept as it is: the system prompt lists the tools, and the
        # shipped tokenizer is built from the envs' own texts (tools/build_tokenizer.py).
        return "UNKNOWN_TOOL"

    def mistakes(self, tools: Sequence[Tool]) -> tuple[str, ...]:
        if not tools:
            return ("", "[ANSWER]", "I am not sure.")
        name = tools[0].name.upper()
        return (f"{name}[", "FOO[x]", "", f"{name}[]", "[ANSWER]", "I am not sure.", f"{name.lower()} x")

    def parse(self, text: str, near_miss: re.Pattern[str] | None) -> ParsedAction:
        faults: list[_Fault] = []
        if "[" in text:
            scan = _scan_brackets(text)
            if scan.tag is not None:
                return ParsedAction(ANSWER, after_tag(text, scan.tag.end()))
            if scan.calls:
                return ParsedAction(CALLS, calls=scan.calls)
            faults = scan.faults
        if near_miss is not None and near_miss.search(text):
            for fault in faults:  # the first `[` right after a known tool's name that did not close
                known = near_miss.match(text, fault.start)
                if known is not None and known.end() == fault.bracket + 1:
                    return ParsedAction(BAD_CALL, reason=_fault_reason(text, fault))
            return ParsedAction(BAD_CALL)  # a shape fault (`LOOKUP(cat)`): the seed's line
        if "<tool_call>" in text:
            return ParsedAction(BAD_CALL)
        return ParsedAction(EMPTY if not text.strip() else OTHER)

    def arguments(self, tool: Tool, call: ParsedCall) -> tuple[Any, bool]:
        names = tool.param_names
        raw = call.arguments.strip()
        if tool.params is None:
            return {names[0]: raw if call.fenced else clean_argument(call.arguments)}, False
        required = [p.name for p in tool.params if p.default is inspect.Parameter.empty]
        if not raw and required:  # `BALANCE[]`: never an empty string for a required argument
            raise ValueError(f"{tool.name.upper()} needs {', '.join(required)}: write {tool.usage}")
        if call.fenced and len(names) == 1:  # a fence's text as written
            return {names[0]: raw}, False
        keywords = _keyword_arguments(raw, names)
        if keywords is not None:  # `BALANCE[account=ana]`, `CONVERT[value=3, unit=km]`
            return keywords, False
        # one parameter takes the whole text: a word or an expression may hold commas
        values = (
            [clean_argument(raw)]
            if len(names) == 1
            else [clean_argument(v) for v in raw.split(",")]
            if raw
            else []
        )
        if len(values) > len(names):
            raise ValueError(
                f"{tool.name.upper()} takes {len(names)} argument(s) ({', '.join(names)}), got {len(values)}"
            )
        return dict(zip(names, values, strict=False)), False

    def render_call(self, tool: Tool | None, call: Call) -> str:
        name = (tool.name if tool is not None else call.name).upper()
        order = tool.param_names if tool is not None else tuple(call.arguments)
        values = [answer_text(call.arguments[k]) for k in order if k in call.arguments]
        if len(order) == 1 and len(values) == 1 and _needs_fence(values[0]):
            return f"{name}[{_fenced(values[0])}]"
        return f"{name}[{', '.join(values)}]"

    def result(self, tool_name: str, call: ParsedCall, text: str) -> str:
        shown = call.shown
        if tool_name:  # a known tool is echoed by its own name
            shown = tool_name.upper() + shown[shown.index("[") :]
        return f"{shown} = {text}"

    def describe(self, tools: Sequence[Tool], finish: str) -> list[str]:
        if not tools:
            return [finish]
        lines = ["Tools:"]
        lines += [f"{t.usage}: {t.description}" for t in tools]
        lines.append(f"Call one tool per turn and wait for its result. {finish}")
        return lines

    def call_example(self, tool: Tool | None) -> str:
        return tool.usage if tool is not None else "NAME[x]"

    def malformed(self, action: str) -> str | None:
        """The first call with parentheses for brackets: `LOOKUP[cat]` -> `LOOKUP(cat)`."""
        broken = _CALL_RE.sub(r"\1(\2)", action, count=1)
        return None if broken == action else broken
