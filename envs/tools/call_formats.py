"""Tool-call formats: how an action string states tool calls and answers, and how calls, results
and tools are written back. A `ToolEnv` takes one by name (`tool_format=`).

"brackets" (Zorplex's), checked in this order:
1. `[ANSWER] <answer>`: a tagged final answer: the rest of the line after the tag, up to another
   tag (an optional `:` or `=` skipped); the grader reads it strictly (`[ANSWER] 28 or 29` is no
   number). The tag is case-insensitive and the FIRST one counts; calls in the same
   action are ignored. A bracket right after a tool NAME is a call's: `LOOKUP[answer]` is a call.
2. `NAME[arg]`: a tool call. NAME is an identifier matched case-insensitively; nothing may stand
   between NAME and `[`; the argument may not contain brackets or a newline. A tool with several
   parameters takes them comma-separated, in order (`CONVERT[1.5, km]`); each value is stripped of
   whitespace and one pair of matching quotes. Every call in the action counts, in order.
3. A known tool name followed by `[` or `(` that did not parse as a call, or a JSON
   `<tool_call>` block (the other format), is a malformed call.
4. Otherwise the action has no call and no tag (empty when it is only whitespace).

"json" (as Qwen2.5/Qwen3/Hermes-style models write calls): one or more blocks
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

Both: only the first `max_chars` characters of an action are parsed (the env cuts it); parsing
never raises on any str.
"""

from __future__ import annotations

import inspect
import json
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

import msgspec

from ..core.grading import answer_text
from .typed import Call, Tool

# Parse outcomes (ParsedAction.kind).
ANSWER: Final = "answer"
CALLS: Final = "calls"
BAD_CALL: Final = "bad_call"
MIXED: Final = "mixed"
OTHER: Final = "other"  # no call and no tag: maybe an untagged answer (the env's grader decides)
EMPTY: Final = "empty"

_CALL_RE: Final = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)\[([^\[\]\n]*)\]")
_ANSWER_TAG_RE: Final = re.compile(r"\[\s*answer\s*\]", re.IGNORECASE)
_AFTER_TAG_RE: Final = re.compile(r"[ \t]*[:=]?[ \t]*([^\n]*)")
_IDENTIFIER_CHARS: Final = frozenset(string.ascii_letters + string.digits + "_")
_BLOCK_RE: Final = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_BARE_CALL_RE: Final = re.compile(r'\{\s*"name"\s*:')
_SHOWN_ARG_CHARS: Final = 40  # arguments echoed in bracket observations are cut to this
_SHOWN_NAME_CHARS: Final = 24


class ParsedCall(NamedTuple):
    """One call as written: `name` as written, `arguments` (a raw str from brackets, a JSON object
    from json), `shown` (how an observation echoes it); `error` is set for a call that could not
    be read at all (kind malformed_call, with `message`)."""

    name: str
    arguments: Any
    shown: str = ""
    error: str | None = None
    message: str = ""


class ParsedAction(NamedTuple):
    kind: str  # ANSWER, CALLS, BAD_CALL, MIXED, OTHER or EMPTY
    answer: str | None = None  # ANSWER: the text after the tag
    calls: list[ParsedCall] | None = None  # CALLS


def clean_argument(raw: str) -> str:
    """Strip whitespace and one pair of matching quotes: ` 'apple' ` -> `apple`."""
    arg = raw.strip()
    if len(arg) >= 2 and arg[0] == arg[-1] and arg[0] in "'\"":
        arg = arg[1:-1].strip()
    return arg


def _after_tag(text: str, end: int) -> str:
    """The answer after a tag: the rest of its line, up to another tag."""
    m = _AFTER_TAG_RE.match(text, end)
    answer = m.group(1) if m else ""
    again = _ANSWER_TAG_RE.search(answer)
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
        return f"ERROR: unknown tool {call.name[:_SHOWN_NAME_CHARS]!r}; the tools are: {names}."

    def mistakes(self, tools: Sequence[Tool]) -> tuple[str, ...]:
        """Actions with one typical mistake each (malformed call, unknown tool, empty action, ...)."""
        raise NotImplementedError


def _answer_tag(text: str) -> re.Match[str] | None:
    """The first `[ANSWER]` tag whose bracket does not open a tool call's argument (a NAME `_CALL_RE`
    would match ends right before it). Each scan stops at the previous non-identifier character,
    so all scans together are linear."""
    for tag in _ANSWER_TAG_RE.finditer(text):
        start = tag.start()
        while start > 0 and text[start - 1] in _IDENTIFIER_CHARS:
            start -= 1
        if start == tag.start() or text[start].isdigit():
            return tag
    return None


def near_miss_pattern(tool_names: Iterable[str], opening: str = r"\s*[\[(]") -> re.Pattern[str] | None:
    """A regex that finds a known tool name followed by `opening` (default `[` or `(`: a call
    attempt), case ignored."""
    names = sorted({n.upper() for n in tool_names}, key=len, reverse=True)
    if not names:
        return None
    return re.compile(r"(?<![A-Za-z0-9_])(?:" + "|".join(map(re.escape, names)) + ")" + opening, re.IGNORECASE)


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
        if "[" in text:
            tag = _answer_tag(text)
            if tag is not None:
                return ParsedAction(ANSWER, _after_tag(text, tag.end()))
            found = _CALL_RE.findall(text)
            if found:
                calls = []
                for name, raw in found:
                    arg = clean_argument(raw)
                    shown = arg if len(arg) <= _SHOWN_ARG_CHARS else arg[: _SHOWN_ARG_CHARS - 3] + "..."
                    calls.append(ParsedCall(name, raw, f"{name[:_SHOWN_NAME_CHARS]}[{shown}]"))
                return ParsedAction(CALLS, calls=calls)
        if (near_miss is not None and near_miss.search(text)) or "<tool_call>" in text:
            return ParsedAction(BAD_CALL)
        return ParsedAction(EMPTY if not text.strip() else OTHER)

    def arguments(self, tool: Tool, call: ParsedCall) -> tuple[Any, bool]:
        names = tool.param_names
        if tool.params is None:
            return {names[0]: clean_argument(call.arguments)}, False
        raw = call.arguments.strip()
        required = [p.name for p in tool.params if p.default is inspect.Parameter.empty]
        if not raw and required:  # `BALANCE[]`: never an empty string for a required argument
            raise ValueError(f"{tool.name.upper()} needs {', '.join(required)}: write {tool.usage}")
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
            tag = _ANSWER_TAG_RE.search(text) if "[" in text else None
            if tag is not None:
                return ParsedAction(ANSWER, _after_tag(text, tag.end()))
            if "</tool_call>" in text or _BARE_CALL_RE.search(text):
                return ParsedAction(BAD_CALL)
            if near_miss is not None and near_miss.search(text):
                return ParsedAction(BAD_CALL)
            return ParsedAction(EMPTY if not text.strip() else OTHER)
        blocks = list(_BLOCK_RE.finditer(text))
        rest = _BLOCK_RE.sub("\n", text)
        if _ANSWER_TAG_RE.search(rest):
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
        return ParsedCall(value["name"], arguments, value["name"][:_SHOWN_NAME_CHARS])

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
        lines = ["Tools (JSON Schema of each function):", "<tools>"]
        lines += [json.dumps(t.spec, ensure_ascii=False) for t in tools]
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


FORMATS: Final[dict[str, ToolCallFormat]] = {"brackets": BracketFormat(), "json": JsonFormat()}


def get_format(name: str) -> ToolCallFormat:
    if name not in FORMATS:
        raise ValueError(f"tool_format must be one of {sorted(FORMATS)}, got {name!r}")
    return FORMATS[name]
