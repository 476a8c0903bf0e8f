"""The "llama3_json" format (Llama 3.1 / 3.2's JSON tool calling): the whole assistant message is
the call,
    {"name": "convert", "parameters": {"value": 1.5, "unit": "km"}}
optionally after `<|python_tag|>`; several calls are objects separated by `;` (as vLLM's
llama3_json parser reads them). `"arguments"` is read in place of `"parameters"` (both in one
call is an error), and either may be a JSON string holding the object. Arguments are typed JSON,
checked strictly.

- A message that starts with `{` (after the tag and whitespace) is calls: an object that is not
  valid JSON, or not `{"name": <str>, "parameters": {...}}`, is a malformed call (one error each,
  the calls before it still run); text after the calls is a malformed call too, and with an
  `[ANSWER]` tag in it an error (`mixed_call_and_answer`), not a guess.
- Otherwise a `[ANSWER]` tag is the answer; a JSON call object elsewhere in the message, a tag
  with no JSON after it, another format's call (`<tool_call>`, `[TOOL_CALLS]`) or a known tool's
  name followed by `(` or `[` is a malformed call.
- Results: each call's result text as it is (Llama 3.1's template shows a tool message in the
  `ipython` role as its raw content), one after another, in order.
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

PYTHON_TAG: Final = "<|python_tag|>"
_SHAPE: Final = 'a tool call is {"name": <tool name>, "parameters": {<arguments>}}'
_SHOWN_REST_CHARS: Final = 40


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    template_tools = True  # Llama 3.1/3.2's own template teaches {"name", "parameters"} calls

    def near_miss(self, tool_names: Iterable[str]) -> re.Pattern[str] | None:
        return near_miss_pattern(tool_names, r"[\[(]")

    def parse(self, text: str, near_miss: re.Pattern[str] | None) -> ParsedAction:
        at = skip_space(text, 0)
        tagged = text.startswith(PYTHON_TAG, at)
        if tagged:
            at = skip_space(text, at + len(PYTHON_TAG))
        if text.startswith("{", at):
            return self._calls(text, at)
        if tagged:
            return ParsedAction(BAD_CALL, reason=f"{PYTHON_TAG} is followed by the JSON call")
        tag = ANSWER_TAG_RE.search(text) if "[" in text else None
        if tag is not None:
            return ParsedAction(ANSWER, after_tag(text, tag.end()))
        if BARE_CALL_RE.search(text):
            return ParsedAction(BAD_CALL, reason="a tool call is the whole message: the JSON object alone")
        if foreign_call(text) or (near_miss is not None and near_miss.search(text)):
            return ParsedAction(BAD_CALL)
        return ParsedAction(EMPTY if not text.strip() else OTHER)

    def _calls(self, text: str, at: int) -> ParsedAction:
        """The `;`-separated objects from `at` to the end of the message."""
        calls: list[ParsedCall] = []
        while at < len(text):
            if not text.startswith("{", at):
                rest = text[at:]
                if ANSWER_TAG_RE.search(rest):
                    return ParsedAction(MIXED)
                shown = json.dumps(rest[:_SHOWN_REST_CHARS], ensure_ascii=False)
                calls.append(
                    malformed(f"ERROR: text after the tool call ({shown}); a tool call is the whole message.")
                )
                break
            try:
                value, at = decode_at(text, at)
            except JsonSyntaxError as exc:
                calls.append(malformed(f"ERROR: the tool call is not valid JSON ({exc})."))
                break
            calls.append(call_from_object(value, ("parameters", "arguments"), _SHAPE))
            at = skip_space(text, at)
            if text.startswith(";", at):
                at = skip_space(text, at + 1)
        return ParsedAction(CALLS, calls=calls)

    def arguments(self, tool: Tool, call: ParsedCall) -> tuple[Any, bool]:
        return call.arguments, True

    def render_call(self, tool: Tool | None, call: Call) -> str:
        name = tool.name if tool is not None else call.name
        return json.dumps({"name": name, "parameters": call.arguments}, ensure_ascii=False)

    def render_calls(self, tools: Mapping[str, Tool], calls: Sequence[Call]) -> str:
        return "; ".join(self.render_call(tools.get(c.name.upper()), c) for c in calls)

    def result(self, tool_name: str, call: ParsedCall, text: str) -> str:
        return text

    def describe(self, tools: Sequence[Tool], finish: str) -> list[str]:
        if not tools:
            return [finish]
        lines = schema_lines(tools)
        lines += [
            "To call a tool, respond with only a JSON object, nothing else:",
            '{"name": <tool name>, "parameters": <JSON object>}',
            f'Several calls are separated by "; "; their results come back in order. {finish}',
        ]
        return lines

    def call_example(self, tool: Tool | None) -> str:
        name = tool.name if tool is not None else "name"
        return f'{{"name": "{name}", "parameters": {{...}}}}'

    def malformed(self, action: str) -> str | None:
        """The first call's JSON without its last closing brace."""
        start = action.find("{")
        if start < 0:
            return None
        try:
            _, end = decode_at(action, start)
        except JsonSyntaxError:
            return None
        return action[: end - 1] + action[end:]

    def mistakes(self, tools: Sequence[Tool]) -> tuple[str, ...]:
        if not tools:
            return ("", "[ANSWER]", "I am not sure.")
        name = tools[0].name
        return (
            f'{{"name": "{name}", "parameters": {{',
            '{"name": "foo", "parameters": {}}',
            "",
            f'{{"name": "{name}", "parameters": {{"nonexistent": 1}}}}',
            "[ANSWER]",
            "I am not sure.",
            f'I will call {{"name": "{name}", "parameters": {{}}}}',
        )
