"""What every tool-call format shares: the parse outcomes, `ParsedCall` / `ParsedAction`, the
`ToolCallFormat` interface, and the `[ANSWER]` tag and near-miss helpers the formats use.

Every format: only the first `max_chars` characters of an action are parsed (the env cuts it);
parsing never raises on any str.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from ..typed import Call, Tool

# Parse outcomes (ParsedAction.kind).
ANSWER: Final = "answer"
CALLS: Final = "calls"
BAD_CALL: Final = "bad_call"
MIXED: Final = "mixed"
OTHER: Final = "other"  # no call and no tag: maybe an untagged answer (the env's grader decides)
EMPTY: Final = "empty"

ANSWER_TAG_RE: Final = re.compile(r"\[\s*answer\s*\]", re.IGNORECASE)
_AFTER_TAG_RE: Final = re.compile(r"[ \t]*[:=]?[ \t]*([^\n]*)")
SHOWN_NAME_CHARS: Final = 24
# Call markers of the family formats: one in an action of another format is a malformed call.
_FOREIGN_MARKERS: Final = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<function=", "<|python_tag|>")


class ParsedCall(NamedTuple):
    """One call as written: `name` as written, `arguments` (a raw str from brackets, a JSON value
    from the JSON dialects and pythonic, {name: text} from qwen3_coder; the format's `arguments`
    makes them a JSON object), `shown` (how an observation echoes it); `error` is set for a call
    that could not be read at all (kind malformed_call, with `message`); `fenced`: a bracket
    argument written in a fence (taken as written, no quotes stripped)."""

    name: str
    arguments: Any
    shown: str = ""
    error: str | None = None
    message: str = ""
    fenced: bool = False


class ParsedAction(NamedTuple):
    kind: str  # ANSWER, CALLS, BAD_CALL, MIXED, OTHER or EMPTY
    answer: str | None = None  # ANSWER: the text after the tag
    calls: list[ParsedCall] | None = None  # CALLS
    reason: str = ""  # BAD_CALL: what was wrong, where the format can tell ("" otherwise)


def clean_argument(raw: str) -> str:
    """Strip whitespace and one pair of matching quotes: ` 'apple' ` -> `apple`."""
    arg = raw.strip()
    if len(arg) >= 2 and arg[0] == arg[-1] and arg[0] in "'\"":
        arg = arg[1:-1].strip()
    return arg


def after_tag(text: str, end: int) -> str:
    """The answer after a tag: the rest of its line, up to another tag."""
    m = _AFTER_TAG_RE.match(text, end)
    answer = m.group(1) if m else ""
    again = ANSWER_TAG_RE.search(answer)
    return (answer[: again.start()] if again else answer).strip()


class ToolCallFormat:
    """How one family of policies writes tool calls; see the module doc. Stateless: one instance
    serves every env."""

    name: str = ""
    # Whether a chat template's own tools block (JSON function specs, `<tool_call>` JSON) teaches
    # this format's calls: only then does an env offer a template its `tools` (reset info).
    template_tools: bool = False

    def parse(self, text: str, near_miss: re.Pattern[str] | None) -> ParsedAction:
        """Classify an (already length-capped) action; `near_miss` is `self.near_miss(names)`."""
        raise NotImplementedError

    def arguments(self, tool: Tool, call: ParsedCall) -> tuple[Any, bool]:
        """(the call's arguments as a JSON object, whether types are checked strictly)."""
        raise NotImplementedError

    def render_call(self, tool: Tool | None, call: Call) -> str:
        """`call` as this format writes it (the oracle's actions)."""
        raise NotImplementedError

    def render_calls(self, tools: Mapping[str, Tool], calls: Sequence[Call]) -> str:
        return "\n".join(self.render_call(tools.get(c.name.upper()), c) for c in calls)

    def result(self, tool_name: str, call: ParsedCall, text: str) -> str:
        """One call's part of the observation."""
        raise NotImplementedError

    def join(self, parts: Sequence[str]) -> str:
        return "\n".join(parts)

    def describe(self, tools: Sequence[Tool], finish: str) -> list[str]:
        """The system prompt's lines about the tools and how to call them; `finish` says how to
        answer (`Finish with [ANSWER] <number>.`)."""
        raise NotImplementedError

    def call_example(self, tool: Tool | None) -> str:
        raise NotImplementedError

    def malformed(self, action: str) -> str | None:
        """`action`'s first call fumbled so that it parses as a malformed call, or None."""
        raise NotImplementedError

    def near_miss(self, tool_names: Iterable[str]) -> re.Pattern[str] | None:
        """A pattern that marks an action as a fumbled call attempt (computed once per env)."""
        return None

    def unknown_tool(self, call: ParsedCall, tools: Sequence[Tool]) -> str:
        """The observation part for a call of a tool the env does not have."""
        return self.result("", call, self.unknown_tool_text(call, tools))

    def unknown_tool_text(self, call: ParsedCall, tools: Sequence[Tool]) -> str:
        names = ", ".join(t.name for t in tools) or "none"
        return f"ERROR: unknown tool {call.name[:SHOWN_NAME_CHARS]!r}; the tools are: {names}."

    def mistakes(self, tools: Sequence[Tool]) -> tuple[str, ...]:
        """Actions with one typical mistake each (malformed call, unknown tool, empty action, ...)."""
        raise NotImplementedError


def near_miss_pattern(tool_names: Iterable[str], opening: str = r"\s*[\[(]") -> re.Pattern[str] | None:
    """A regex that finds a known tool name followed by `opening` (default `[` or `(`: a call
    attempt), case ignored."""
    names = sorted({n.upper() for n in tool_names}, key=len, reverse=True)
    if not names:
        return None
    return re.compile(
        r"(?<![A-Za-z0-9_])(?:" + "|".join(map(re.escape, names)) + ")" + opening, re.IGNORECASE
    )


def foreign_call(text: str) -> bool:
    """Whether `text` holds a family format's call marker (`<tool_call>`, `[TOOL_CALLS]`, ...)."""
    return any(marker in text for marker in _FOREIGN_MARKERS)


def schema_lines(tools: Sequence[Tool]) -> list[str]:
    """The heading and each tool's JSON Schema on a line, as every JSON-schema format's
    `describe` lists them (between the format's own tags, where it has them)."""
    return ["Tools (JSON Schema of each function):", *(json.dumps(t.spec, ensure_ascii=False) for t in tools)]
