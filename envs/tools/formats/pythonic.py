"""The "pythonic" format (Llama 3.2 / Llama 4's pythonic tool calling): the whole assistant message
is a Python list of calls,
    [convert(value=1.5, unit="km"), rate(currency="eur")]
arguments by name, each value a literal: a str, an int, a finite float, True / False / None, or a
list, tuple (read as a list) or dict (str keys) of them. Llama's `<|python_tag|>` before the
list, or `<|python_start|>` ... `<|python_end|>` around it, are skipped. The list is read with
`ast.parse` and its values by walking the tree: nothing is evaluated.

- A message that starts with `[NAME(` (after the markers and whitespace) is calls: text that does
  not parse as a Python list is a malformed call saying where (`'[' was never closed at line 1,
  column 1`); an element that is not a call of a plain name, a positional argument, `**kwargs` or
  a value that is not a literal (a name, an expression, a set, a non-finite float) is a malformed
  call saying which (one error each; the other calls still run). Calls together with a
  `[ANSWER]` tag after them are an error (`mixed_call_and_answer`), not a guess.
- Otherwise a `[ANSWER]` tag is the answer; a call list elsewhere in the message, another
  format's call or a known tool's name followed by `(` or `[` is a malformed call.
- Results: each call's result text as it is (the `ipython` role of Llama's templates), in order.
- A chat template's tools block is not offered: Llama's stock templates teach JSON calls, so the
  system prompt describes the tools and this call shape itself.
"""

from __future__ import annotations

import ast
import math
import re
import warnings
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
    SHOWN_NAME_CHARS,
    ParsedAction,
    ParsedCall,
    ToolCallFormat,
    after_tag,
    foreign_call,
    near_miss_pattern,
    schema_lines,
)

_START_RE: Final = re.compile(r"\s*(?:<\|python_tag\|>|<\|python_start\|>)?\s*")
_PYTHON_END: Final = "<|python_end|>"
_LIST_RE: Final = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_.]*\s*\(")


class _NotLiteral(ValueError):
    """A value that is not a literal; `str()` says what it is."""


def _literal(node: ast.expr) -> Any:
    """The JSON value a literal's tree writes; raises _NotLiteral for anything else. The parser
    bounds the nesting, so the recursion is bounded too."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _NotLiteral(f"{value} is not a finite number")
            return value
        raise _NotLiteral(f"{type(value).__name__} is not a JSON value")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _literal(node.operand)
        if isinstance(operand, bool) or not isinstance(operand, int | float):
            raise _NotLiteral("a sign goes before a number only")
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        result = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None:
                raise _NotLiteral("** in a dict is not a literal")
            name = _literal(key)
            if not isinstance(name, str):
                raise _NotLiteral("a dict's keys are strings")
            result[name] = _literal(value)
        return result
    if isinstance(node, ast.Name):
        hint = {"true": "True", "false": "False", "null": "None"}.get(node.id)
        raise _NotLiteral(f"{node.id} is a name, not a literal" + (f"; write {hint}" if hint else ""))
    if isinstance(node, ast.Set):
        raise _NotLiteral("a set is not a JSON value (write a list)")
    raise _NotLiteral(f"a {type(node).__name__.lower()} is not a literal")


def _bad(message: str, name: str = "") -> ParsedCall:
    return ParsedCall(name, {}, error="malformed_call", message=f"ERROR: {message}.")


def _call(index: int, node: ast.expr) -> ParsedCall:
    """One element of the list as a call (or a malformed call saying what is wrong)."""
    where = f"element {index + 1} of the list"
    if not isinstance(node, ast.Call):
        return _bad(f"{where} is not a call; write [name(arg=value, ...)]")
    if not isinstance(node.func, ast.Name):
        return _bad(f"{where} does not call a tool by its name")
    name = node.func.id
    if node.args:
        return _bad(f"{name}: arguments go by name, {name}(arg=value)", name)
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return _bad(f"{name}: **arguments are not literals; write each by name", name)
        if keyword.arg in arguments:
            return _bad(f"{name}: argument {keyword.arg} given twice", name)
        try:
            arguments[keyword.arg] = _literal(keyword.value)
        except _NotLiteral as exc:
            return _bad(f"{name}: the value of {keyword.arg} is not a literal ({exc})", name)
        except RecursionError:
            return _bad(f"{name}: the value of {keyword.arg} is nested too deep", name)
    return ParsedCall(name, arguments, name[:SHOWN_NAME_CHARS])


def _parsed(source: str) -> ast.expr | str:
    """`source` as one Python expression's tree, or why it is not one."""
    try:
        with warnings.catch_warnings():  # an invalid escape in a string warns: not the caller's concern
            warnings.simplefilter("ignore")
            return ast.parse(source, mode="eval").body
    except SyntaxError as exc:
        where = f" at line {exc.lineno}, column {exc.offset}" if exc.lineno and exc.offset else ""
        return f"not a Python list of calls: {exc.msg}{where}"
    except (ValueError, RecursionError, MemoryError, OverflowError) as exc:
        return f"not a Python list of calls: {exc}"


class PythonicFormat(ToolCallFormat):
    name = "pythonic"

    def near_miss(self, tool_names: Iterable[str]) -> re.Pattern[str] | None:
        return near_miss_pattern(tool_names, r"[\[(]")

    def parse(self, text: str, near_miss: re.Pattern[str] | None) -> ParsedAction:
        start = _START_RE.match(text)
        at = start.end() if start is not None else 0
        if _LIST_RE.match(text, at):
            source = text[at:].rstrip()
            if source.endswith(_PYTHON_END):
                source = source[: -len(_PYTHON_END)]
            return self._calls(source)
        tag = ANSWER_TAG_RE.search(text) if "[" in text else None
        if tag is not None:
            return ParsedAction(ANSWER, after_tag(text, tag.end()))
        if _LIST_RE.search(text):
            return ParsedAction(BAD_CALL, reason="a tool call list is the whole message, nothing before it")
        if foreign_call(text) or (near_miss is not None and near_miss.search(text)):
            return ParsedAction(BAD_CALL)
        return ParsedAction(EMPTY if not text.strip() else OTHER)

    @staticmethod
    def _calls(source: str) -> ParsedAction:
        tree = _parsed(source)
        if isinstance(tree, str):
            tag = ANSWER_TAG_RE.search(source)
            if tag is not None and isinstance(_parsed(source[: tag.start()].rstrip()), ast.List):
                return ParsedAction(MIXED)
            return ParsedAction(BAD_CALL, reason=tree)
        if not isinstance(tree, ast.List):
            return ParsedAction(BAD_CALL, reason="not a Python list of calls: write [name(arg=value, ...)]")
        return ParsedAction(CALLS, calls=[_call(i, node) for i, node in enumerate(tree.elts)])

    def arguments(self, tool: Tool, call: ParsedCall) -> tuple[Any, bool]:
        return call.arguments, True

    def render_call(self, tool: Tool | None, call: Call) -> str:
        return f"[{self._call(tool, call)}]"

    def render_calls(self, tools: Mapping[str, Tool], calls: Sequence[Call]) -> str:
        return "[" + ", ".join(self._call(tools.get(c.name.upper()), c) for c in calls) + "]"

    @staticmethod
    def _call(tool: Tool | None, call: Call) -> str:
        """`name(a=1, b='x')`: each value's repr, which Python reads back as the same JSON value."""
        name = tool.name if tool is not None else call.name
        return f"{name}({', '.join(f'{k}={v!r}' for k, v in call.arguments.items())})"

    def result(self, tool_name: str, call: ParsedCall, text: str) -> str:
        return text

    def describe(self, tools: Sequence[Tool], finish: str) -> list[str]:
        if not tools:
            return [finish]
        lines = schema_lines(tools)
        lines += [
            "To call tools, respond with only a Python list of calls, arguments by name, values as literals:",
            "[func_name1(param1=value1, param2=value2), func_name2(param=value)]",
            f"Their results come back in order. {finish}",
        ]
        return lines

    def call_example(self, tool: Tool | None) -> str:
        if tool is None:
            return "[name(arg=...)]"
        return f"[{tool.name}({', '.join(f'{p}=...' for p in tool.param_names)})]"

    def malformed(self, action: str) -> str | None:
        """The call list without its closing bracket."""
        start = _START_RE.match(action)
        at = start.end() if start is not None else 0
        if not _LIST_RE.match(action, at):
            return None
        cut = action.rfind("]")
        return action[:cut] + action[cut + 1 :]

    def mistakes(self, tools: Sequence[Tool]) -> tuple[str, ...]:
        if not tools:
            return ("", "[ANSWER]", "I am not sure.")
        tool = tools[0]
        first = tool.param_names[0]
        return (
            f"[{tool.name}({first}=",
            "[foo(x=1)]",
            "",
            f"[{tool.name}(nonexistent=1)]",
            "[ANSWER]",
            "I am not sure.",
            f"[{tool.name}({first}=open('x'))]",
        )
