"""The "qwen3_coder" format (Qwen3-Coder's XML calls): one or more blocks
    <tool_call>
    <function=convert>
    <parameter=value>
    1.5
    </parameter>
    <parameter=unit>
    km
    </parameter>
    </function>
    </tool_call>
each a call, in order. A value is the text between `<parameter=NAME>` and `</parameter>`, less
one newline right after the opening tag and one right before the closing one (as Qwen3-Coder's
own parser reads it). The tool's JSON Schema types it: a parameter that takes a string gets the
text as it is (`null` is None where the schema also takes null); any other is read as JSON
(`1.5`, `true`, `[1, 2]`, `{"days": 3}`; `True` / `False` too for a boolean), and text that is no
JSON stays text, which the type check then refuses naming the parameter. Then the arguments are
checked strictly.

- A block that is not one `<function=NAME>...</function>` holding only `<parameter=NAME>` ...
  `</parameter>` pairs (JSON inside, a missing `</function>` or `</parameter>`, text between the
  parameters, a parameter given twice), or an unterminated `<tool_call>`, is a malformed call
  saying what is wrong (one error each; the other calls still run). As in Qwen's parsers, a
  block ends at the first `</tool_call>` and a value at the first `</parameter>`.
- A `[ANSWER]` tag outside the blocks is the answer; blocks together with a tag are an error
  (`mixed_call_and_answer`), not a guess. Without a block, `<function=`, a JSON call object,
  another format's call or a known tool's name followed by `(` or `[` is a malformed call.
- Results come back as one `<tool_response>` block per call, in order (as the json format's).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
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
    foreign_call,
    near_miss_pattern,
    schema_lines,
)
from .json_calls import BARE_CALL_RE

_OPEN: Final = "<tool_call>"
_CLOSE: Final = "</tool_call>"
_PARAMETER: Final = "<parameter="
_PARAMETER_END: Final = "</parameter>"
_PARAMETER_NAME_RE: Final = re.compile(r"([^>\n]*)>")
_FUNCTION_RE: Final = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", re.DOTALL)
_SHAPE: Final = "a tool call is <function=NAME> holding <parameter=NAME>value</parameter> for each argument"
_SHOWN_CHARS: Final = 40


def _bad(message: str, name: str = "") -> ParsedCall:
    return ParsedCall(name, {}, error="malformed_call", message=f"ERROR: {message}.")


def _shown(text: str) -> str:
    return json.dumps(text.strip()[:_SHOWN_CHARS], ensure_ascii=False)


def _value_text(raw: str) -> str:
    """A parameter's text less one newline after its opening tag and one before its closing tag."""
    if raw.startswith("\n"):
        raw = raw[1:]
    return raw[:-1] if raw.endswith("\n") else raw


def _blocks(text: str) -> tuple[list[str], str, bool]:
    """The `<tool_call>` blocks' bodies in order, the text outside them (each block a newline),
    and whether a `<tool_call>` never closes. Scanned with `find`, so linear in the text."""
    bodies: list[str] = []
    outside: list[str] = []
    done = 0
    while True:
        start = text.find(_OPEN, done)
        end = text.find(_CLOSE, start + len(_OPEN)) if start >= 0 else -1
        if end < 0:
            outside.append(text[done:])
            return bodies, "\n".join(outside), start >= 0
        outside.append(text[done:start])
        bodies.append(text[start + len(_OPEN) : end])
        done = end + len(_CLOSE)


def _decode_block(body: str) -> ParsedCall:
    function = _FUNCTION_RE.fullmatch(body)
    if function is None:
        if body.lstrip().startswith("{"):
            return _bad(f"JSON in a <tool_call> block; {_SHAPE}")
        if "<function=" not in body:
            return _bad(f"no <function=NAME> in the <tool_call> block; {_SHAPE}")
        if "</function>" not in body:
            return _bad("<function=...> without </function>")
        return _bad(f"text outside <function=...>...</function> in the <tool_call> block; {_SHAPE}")
    name, inner = function.group(1).strip(), function.group(2)
    arguments: dict[str, str] = {}
    done = 0
    while (start := inner.find(_PARAMETER, done)) >= 0:  # each tag found once: linear
        if inner[done:start].strip():
            return _bad(f"{name}: text between the parameters ({_shown(inner[done:start])}); {_SHAPE}", name)
        named = _PARAMETER_NAME_RE.match(inner, start + len(_PARAMETER))
        if named is None:
            return _bad(f"{name}: a <parameter= tag without its closing >", name)
        end = inner.find(_PARAMETER_END, named.end())
        if end < 0:
            return _bad(f"{name}: <parameter=...> without </parameter>", name)
        key = named.group(1).strip()
        if key in arguments:
            return _bad(f"{name}: parameter {key!r} given twice", name)
        arguments[key] = _value_text(inner[named.end() : end])
        done = end + len(_PARAMETER_END)
    if inner[done:].strip():
        return _bad(f"{name}: text between the parameters ({_shown(inner[done:])}); {_SHAPE}", name)
    return ParsedCall(name, arguments, name[:SHOWN_NAME_CHARS])


def _types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema admits (empty: it does not say)."""
    if not isinstance(schema, Mapping):
        return set()
    kinds: set[str] = set()
    given = schema.get("type")
    if isinstance(given, str):
        kinds.add(given)
    elif isinstance(given, list):
        kinds.update(k for k in given if isinstance(k, str))
    for key in ("enum", "const"):
        values = schema.get(key, []) if key == "enum" else [schema[key]] if key in schema else []
        for value in values if isinstance(values, list) else []:
            kinds.add("string" if isinstance(value, str) else "null" if value is None else "other")
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key, []) if isinstance(schema.get(key), list) else []:
            kinds |= _types(branch)
    if "$ref" in schema or "properties" in schema:
        kinds.add("object")
    return kinds


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as the type its schema says (see the module doc)."""
    kinds = _types(schema)
    if "string" in kinds:
        return None if "null" in kinds and text.strip() == "null" else text
    stripped = text.strip()
    try:
        return msgspec.json.decode(stripped)
    except (msgspec.DecodeError, RecursionError, ValueError):
        if "boolean" in kinds and stripped in ("True", "False"):
            return stripped == "True"
        return text


class QwenXmlFormat(ToolCallFormat):
    name = "qwen3_coder"
    template_tools = True  # Qwen3-Coder's own template teaches these XML calls

    def near_miss(self, tool_names: Iterable[str]) -> re.Pattern[str] | None:
        return near_miss_pattern(tool_names, r"[\[(]")

    def parse(self, text: str, near_miss: re.Pattern[str] | None) -> ParsedAction:
        if "<tool_call>" not in text:
            tag = ANSWER_TAG_RE.search(text) if "[" in text else None
            if tag is not None:
                return ParsedAction(ANSWER, after_tag(text, tag.end()))
            if BARE_CALL_RE.search(text) or foreign_call(text):
                return ParsedAction(BAD_CALL)
            if near_miss is not None and near_miss.search(text):
                return ParsedAction(BAD_CALL)
            return ParsedAction(EMPTY if not text.strip() else OTHER)
        bodies, rest, unclosed = _blocks(text)
        if ANSWER_TAG_RE.search(rest):
            return ParsedAction(MIXED)
        calls = [_decode_block(body) for body in bodies]
        if unclosed:
            calls.append(_bad("<tool_call> without </tool_call>"))
        return ParsedAction(CALLS, calls=calls)

    def arguments(self, tool: Tool, call: ParsedCall) -> tuple[Any, bool]:
        properties = tool.parameters.get("properties", {})
        if not isinstance(properties, Mapping):
            properties = {}
        return {key: typed_value(text, properties.get(key)) for key, text in call.arguments.items()}, True

    def render_call(self, tool: Tool | None, call: Call) -> str:
        name = tool.name if tool is not None else call.name
        lines = ["<tool_call>", f"<function={name}>"]
        for key, value in call.arguments.items():
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            lines += [f"<parameter={key}>", text, "</parameter>"]
        return "\n".join([*lines, "</function>", "</tool_call>"])

    def result(self, tool_name: str, call: ParsedCall, text: str) -> str:
        return f"<tool_response>\n{text}\n</tool_response>"

    def describe(self, tools: Sequence[Tool], finish: str) -> list[str]:
        if not tools:
            return [finish]
        heading, *schemas = schema_lines(tools)
        lines = [heading, "<tools>", *schemas]
        lines += [
            "</tools>",
            "Call a tool by writing its name and each argument in a <tool_call> block:",
            "<tool_call>\n<function=NAME>\n<parameter=NAME>\nvalue\n</parameter>\n</function>\n</tool_call>",
            "A value is text (JSON for numbers, booleans, lists and objects). Several blocks in one turn "
            f"are several calls; each result comes back in a <tool_response> block, in order. {finish}",
        ]
        return lines

    def call_example(self, tool: Tool | None) -> str:
        name = tool.name if tool is not None else "NAME"
        first = tool.param_names[0] if tool is not None else "NAME"
        return f"<tool_call>\n<function={name}>\n<parameter={first}>\n...\n</parameter>\n</function>\n</tool_call>"

    def malformed(self, action: str) -> str | None:
        """The first block without its `</function>`."""
        start = action.find(_OPEN)
        end = action.find(_CLOSE, start) if start >= 0 else -1
        if end < 0:
            return None
        cut = action.find("</function>", start, end)
        if cut < 0:
            return None
        return action[:cut] + action[cut + len("</function>") :]

    def mistakes(self, tools: Sequence[Tool]) -> tuple[str, ...]:
        if not tools:
            return ("", "[ANSWER]", "I am not sure.")
        name, first = tools[0].name, tools[0].param_names[0]
        return (
            f"<tool_call>\n<function={name}>\n<parameter={first}>\nx\n</function>\n</tool_call>",
            "<tool_call>\n<function=foo>\n</function>\n</tool_call>",
            "",
            f"<tool_call>\n<function={name}>\n<parameter=nonexistent>\n1\n</parameter>\n</function>\n</tool_call>",
            "[ANSWER]",
            "I am not sure.",
            f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>',
        )
