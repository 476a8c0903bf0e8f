"""The "json" format (as Qwen2.5/Qwen3/Hermes-style models write calls): one or more blocks
    <tool_call>
    {"name": "convert", "arguments": {"value": 1.5, "unit": "km"}}
    </tool_call>
each a call, in order (`arguments` may also be a JSON string holding the object, as the OpenAI
API sends it). A block that is not such JSON, or an unterminated `<tool_call>`, is a malformed
call (one error each, the other calls still run); a `[ANSWER]` tag outside the blocks is the
answer; blocks together with a tag are an error (`mixed_call_and_answer`), not a guess. A JSON
object naming a tool outside any block is a malformed call. Results come back as one
`<tool_response>` block per call, in order. As in Hermes-style parsers, a block ends at the first
`</tool_call>`, even one inside a JSON string (JSON may write it `<\\/tool_call>`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgspec

from ..typed import Call, Tool
from .base import (
    ANSWER,
    ANSWER_TAG_RE,
    BAD_CALL,
    CALLS,
    EMPTY,
    MIXED,
    OTHER,
    SHOWN_NAME_CHARS,
    ParsedAction,
    ParsedCall,
    ToolCallFormat,
    after_tag,
    near_miss_pattern,
    schema_lines,
)

_BLOCK_RE: Final = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_BARE_CALL_RE: Final = re.compile(r'\{\s*"name"\s*:')


class JsonFormat(ToolCallFormat):
    name = "json"
    template_tools = True

    def near_miss(self, tool_names: Iterable[str]) -> re.Pattern[str] | None:
        """A known tool called the bracket way (`price[kite, 3]`): a malformed call, answered with
        how this env calls tools, not read as an untagged answer."""
        return near_miss_pattern(tool_names, r"\[")

    def mistakes(self, tools: Sequence[Tool]) -> tuple[str, ...]:
        if not tools:
            return ("", "[ANSWER]", "I am not sure.")
        name = tools[0].name
        return (
            f'<tool_call>\n{{"name": "{name}", "arguments": {{\n</tool_call>',
            '<tool_call>\n{"name": "foo", "arguments": {}}\n</tool_call>',
            "",
            f'<tool_call>\n{{"name": "{name}", "arguments": {{"nonexistent": 1}}}}\n</tool_call>',
            "[ANSWER]",
            "I am not sure.",
            f'{{"name": "{name}", "arguments": {{}}}}',
        )

    def parse(self, text: str, near_miss: re.Pattern[str] | None) -> ParsedAction:
        if "<tool_call>" not in text:
            tag = ANSWER_TAG_RE.search(text) if "[" in text else None
            if tag is not None:
                return ParsedAction(ANSWER, after_tag(text, tag.end()))
            if "</tool_call>" in text or _BARE_CALL_RE.search(text):
                return ParsedAction(BAD_CALL)
            if near_miss is not None and near_miss.search(text):
                return ParsedAction(BAD_CALL)
            return ParsedAction(EMPTY if not text.strip() else OTHER)
        blocks = list(_BLOCK_RE.finditer(text))
        rest = _BLOCK_RE.sub("\n", text)
        if ANSWER_TAG_RE.search(rest):
            return ParsedAction(MIXED)
        calls = [self._decode(b.group(1)) for b in blocks]
        if "<tool_call>" in rest:
            calls.append(
                ParsedCall("", {}, error="malformed_call", message="ERROR: <tool_call> without </tool_call>.")
            )
        return ParsedAction(CALLS, calls=calls)

    @staticmethod
    def _decode(body: str) -> ParsedCall:
        shape = 'a tool call is {"name": <tool name>, "arguments": {<arguments>}}'
        try:
            value = msgspec.json.decode(body.strip())
        except (msgspec.DecodeError, RecursionError, ValueError) as exc:
            return ParsedCall(
                "", {}, error="malformed_call", message=f"ERROR: the tool call is not valid JSON ({exc})."
            )
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return ParsedCall("", {}, error="malformed_call", message=f"ERROR: {shape}.")
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = msgspec.json.decode(arguments) if arguments.strip() else {}
            except (msgspec.DecodeError, RecursionError, ValueError) as exc:
                return ParsedCall(
                    value["name"],
                    {},
                    error="malformed_call",
                    message=f"ERROR: arguments are not valid JSON ({exc}).",
                )
        return ParsedCall(value["name"], arguments, value["name"][:SHOWN_NAME_CHARS])

    def arguments(self, tool: Tool, call: ParsedCall) -> tuple[Any, bool]:
        return call.arguments, True

    def render_call(self, tool: Tool | None, call: Call) -> str:
        name = tool.name if tool is not None else call.name
        body = json.dumps({"name": name, "arguments": call.arguments}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"

    def result(self, tool_name: str, call: ParsedCall, text: str) -> str:
        return f"<tool_response>\n{text}\n</tool_response>"

    def describe(self, tools: Sequence[Tool], finish: str) -> list[str]:
        if not tools:
            return [finish]
        heading, *schemas = schema_lines(tools)
        lines = [heading, "<tools>", *schemas]
        lines += [
            "</tools>",
            "Call a tool by writing its name and arguments as JSON in a <tool_call> block:",
            '<tool_call>\n{"name": <tool name>, "arguments": <JSON object>}\n</tool_call>',
            "Several blocks in one turn are several calls; each result comes back in a <tool_response> "
            f"block, in order. {finish}",
        ]
        return lines

    def call_example(self, tool: Tool | None) -> str:
        name = tool.name if tool is not None else "name"
        return f'<tool_call>\n{{"name": "{name}", "arguments": {{...}}}}\n</tool_call>'

    def malformed(self, action: str) -> str | None:
        """The first block's JSON without its last closing brace."""
        block = _BLOCK_RE.search(action)
        if block is None:
            return None
        body = block.group(1)
        cut = body.rfind("}")
        if cut < 0:
            return None
        return action[: block.start(1)] + body[:cut] + body[cut + 1 :] + action[block.end(1) :]
