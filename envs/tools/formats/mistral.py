"""The "mistral" format (Mistral's `[TOOL_CALLS]`): after the `[TOOL_CALLS]` marker, a JSON list
of calls,
    [TOOL_CALLS][{"name": "convert", "arguments": {"value": 1.5, "unit": "km"}}]
(Mistral 7B v0.3, Nemo, Small up to 3.1), or, from tokenizer v11 on (Small 3.2, Devstral,
Magistral), one marker per call, the name, then `[ARGS]` and the arguments object:
    [TOOL_CALLS]convert[ARGS]{"value": 1.5, "unit": "km"}
(a `[CALL_ID]<id>` between the name and `[ARGS]` is skipped). Both forms may repeat in a message;
every call counts, in order. Text before the first marker is the model's prose and ignored.
Arguments are typed JSON, checked strictly; a JSON string holding the object is read too; an
`"id"` in a list entry is ignored.

- What follows a marker that is not one of these forms (not valid JSON, not a list of
  `{"name": <str>, "arguments": {...}}`, a name without `[ARGS]`, text after the JSON) is a
  malformed call (one error per marker; the other calls still run).
- A `[ANSWER]` tag outside the calls is the answer; calls together with a tag are an error
  (`mixed_call_and_answer`), not a guess. Without a marker, a JSON call object, `[ARGS]`,
  another format's call or a known tool's name followed by `(` or `[` is a malformed call.
- Results come back as one `[TOOL_RESULTS]<result>[/TOOL_RESULTS]` per call, in order (the v11
  template's form; a template that renders tools writes its own).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from ..typed import Call, Tool
from .base import (
    ANSWER,
    ANSWER_TAG_RE,
    BAD_CALL,
    CALLS,
    EMPTY,
    MIXED,
    OTHER,
    ParsedAction,
    ParsedCall,
    ToolCallFormat,
    after_tag,
    foreign_call,
    near_miss_pattern,
    schema_lines,
)
from .json_calls import BARE_CALL_RE, JsonSyntaxError, call_from_object, decode_at, malformed, skip_space

TOOL_CALLS: Final = "[TOOL_CALLS]"
_NAMED_RE: Final = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]\s*")
_SHAPE: Final = 'a tool call is [TOOL_CALLS][{"name": <tool name>, "arguments": {<arguments>}}]'
_SHOWN_REST_CHARS: Final = 40


def _shown(text: str) -> str:
    return json.dumps(text[:_SHOWN_REST_CHARS], ensure_ascii=False)


class MistralFormat(ToolCallFormat):
    name = "mistral"
    template_tools = True  # Mistral's own templates teach [TOOL_CALLS] calls

    def near_miss(self, tool_names: Iterable[str]) -> re.Pattern[str] | None:
        return near_miss_pattern(tool_names, r"[\[(]")

    def parse(self, text: str, near_miss: re.Pattern[str] | None) -> ParsedAction:
        if TOOL_CALLS not in text:
            tag = ANSWER_TAG_RE.search(text) if "[" in text else None
            if tag is not None:
                return ParsedAction(ANSWER, after_tag(text, tag.end()))
            if "[ARGS]" in text or BARE_CALL_RE.search(text):
                return ParsedAction(BAD_CALL, reason=f"a tool call starts with {TOOL_CALLS}")
            if foreign_call(text) or (near_miss is not None and near_miss.search(text)):
                return ParsedAction(BAD_CALL)
            return ParsedAction(EMPTY if not text.strip() else OTHER)
        pieces = text.split(TOOL_CALLS)
        outside = [pieces[0]]  # the prose before the first marker, then any text after a call
        calls: list[ParsedCall] = []
        for piece in pieces[1:]:
            found, rest = self._piece(piece)
            calls += found
            outside.append(rest)
        if any(ANSWER_TAG_RE.search(part) for part in outside):
            return ParsedAction(MIXED)
        return ParsedAction(CALLS, calls=calls)

    @staticmethod
    def _piece(piece: str) -> tuple[list[ParsedCall], str]:
        """The calls after one marker, and the text after them ("" when they end the piece)."""
        named = _NAMED_RE.match(piece)
        at = named.end() if named is not None else skip_space(piece, 0)
        if named is None and not piece.startswith(("[", "{"), at):
            if not piece[at:]:
                return [malformed(f"ERROR: {TOOL_CALLS} with no call after it; {_SHAPE}.")], ""
            return [malformed(f"ERROR: {TOOL_CALLS} is followed by {_shown(piece[at:])}; {_SHAPE}.")], ""
        try:
            value, end = decode_at(piece, at)
        except JsonSyntaxError as exc:
            return [malformed(f"ERROR: the tool call is not valid JSON ({exc}).")], ""
        if named is not None:
            arguments = {"name": named.group(1), "arguments": value}
            calls = [call_from_object(arguments, ("arguments",), _SHAPE)]
        elif isinstance(value, list):
            calls = [call_from_object(entry, ("arguments", "parameters"), _SHAPE) for entry in value]
        else:
            calls = [call_from_object(value, ("arguments", "parameters"), _SHAPE)]
        rest = piece[end:]
        if rest.strip() and not ANSWER_TAG_RE.search(rest):
            calls.append(malformed(f"ERROR: text after the tool call ({_shown(rest.strip())})."))
        return calls, rest

    def arguments(self, tool: Tool, call: ParsedCall) -> tuple[Any, bool]:
        return call.arguments, True

    def render_call(self, tool: Tool | None, call: Call) -> str:
        return f"{TOOL_CALLS}[{self._entry(tool, call)}]"

    def render_calls(self, tools: Mapping[str, Tool], calls: Sequence[Call]) -> str:
        entries = ", ".join(self._entry(tools.get(c.name.upper()), c) for c in calls)
        return f"{TOOL_CALLS}[{entries}]"

    @staticmethod
    def _entry(tool: Tool | None, call: Call) -> str:
        name = tool.name if tool is not None else call.name
        return json.dumps({"name": name, "arguments": call.arguments}, ensure_ascii=False)

    def result(self, tool_name: str, call: ParsedCall, text: str) -> str:
        return f"[TOOL_RESULTS]{text}[/TOOL_RESULTS]"

    def describe(self, tools: Sequence[Tool], finish: str) -> list[str]:
        if not tools:
            return [finish]
        heading, *schemas = schema_lines(tools)
        lines = [heading, "[AVAILABLE_TOOLS]", *schemas]
        lines += [
            "[/AVAILABLE_TOOLS]",
            "Call tools by writing [TOOL_CALLS] and a JSON list of calls:",
            '[TOOL_CALLS][{"name": <tool name>, "arguments": <JSON object>}]',
            "Several entries are several calls; each result comes back in a [TOOL_RESULTS] block, "
            f"in order. {finish}",
        ]
        return lines

    def call_example(self, tool: Tool | None) -> str:
        name = tool.name if tool is not None else "name"
        return f'{TOOL_CALLS}[{{"name": "{name}", "arguments": {{...}}}}]'

    def malformed(self, action: str) -> str | None:
        """The first call's JSON list without its closing bracket."""
        marker = action.find(TOOL_CALLS)
        if marker < 0:
            return None
        start = marker + len(TOOL_CALLS)
        named = _NAMED_RE.match(action, start)
        at = named.end() if named is not None else skip_space(action, start)
        try:
            _, end = decode_at(action, at)
        except JsonSyntaxError:
            return None
        return action[: end - 1] + action[end:]

    def mistakes(self, tools: Sequence[Tool]) -> tuple[str, ...]:
        if not tools:
            return ("", "[ANSWER]", "I am not sure.")
        name = tools[0].name
        return (
            f'{TOOL_CALLS}[{{"name": "{name}", "arguments": {{',
            f'{TOOL_CALLS}[{{"name": "foo", "arguments": {{}}}}]',
            "",
            f'{TOOL_CALLS}[{{"name": "{name}", "arguments": {{"nonexistent": 1}}}}]',
            "[ANSWER]",
            "I am not sure.",
            f'[{{"name": "{name}", "arguments": {{}}}}]',
        )
