"""Tools: Python functions the policy can call, with typed, validated arguments.

A tool is made from an ordinary (sync or async) function; its type hints give the JSON Schema of
its parameters, its docstring the description:

    @tool
    def convert(value: float, unit: Literal["km", "mi"]) -> float:
        '''Convert a distance between kilometres and miles.

        Args:
            value: the distance to convert.
            unit: the unit `value` is in.
        '''

`Tool.from_function(fn)` (or `tool(fn)`) builds the `Tool`; a `ToolEnv` also collects its own
methods marked `@tool`, bound to the env, so a tool can read and change the episode's state.
Parameter types: str, int, float, bool, Literal, Enum, list, dict, tuple, Optional/unions and
msgspec Structs (anything msgspec converts). Before the call, the arguments are validated and
converted by msgspec: a wrong, missing or extra argument raises `ToolCallError` naming the
parameter, and the function is never called. A result may be any JSON value (str is shown as it
is, everything else JSON-encoded), or a `ToolResult` that also awards named reward components.
A value JSON cannot show as it is (a set, shown as a list; bytes, shown as base64; a NaN or an
infinity, shown as null) is shown all the same, with a one-time RuntimeWarning naming the tool
and the type (`Tool.__call__` says why a warning and not an error).
Raising `ToolError` (or ValueError) rejects the call with a message. Any other exception is a
bug in the tool: it is raised as `ToolCrashError`, whose message names the tool, the exception
and the call and carries the traceback (so the episode's env error, Trajectory.error, has it),
and one line is logged per tool and raising place. An async tool is awaited on a background
event loop and cut off after `timeout_s`; a sync tool runs in the caller's thread.

`Tool(name, description, fn, arg=...)` is the plain form: `fn` takes the one string argument.
`Tool.from_schema(name, description, parameters, fn)` is a tool whose JSON Schema comes from
outside (an MCP server's tool, envs/tools/mcp.py): its arguments are checked against that schema
(`check_arguments`, a sound subset) and `fn(**arguments)` gets them as JSON values.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import re
import traceback
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from .event_loop import BackgroundLoop

_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MARK: Final = "__toolgym_tool__"
DEFAULT_TIMEOUT_S: Final = 30.0
_SHOWN_VALUE_CHARS: Final = 80  # each argument's repr in a ToolCrashError's first line
_TRACEBACK_CHARS: Final = 8000  # a longer traceback keeps its first line and its end

log = logging.getLogger(__name__)
_LOGGED_CRASHES: set[tuple[str, str, str]] = set()  # (tool, exception type, file:line): logged once
_WARNED_RESULTS: set[tuple[str, str]] = set()  # (tool, type): warned once


class ToolError(Exception):
    """Raised by a tool function to reject its call.

    The message becomes the call's result and the call counts as an error (info `errors`, the
    error penalty, the consecutive-error limit). A tool that wants a "not found" to be an
    ordinary result simply returns it instead.
    """


class ToolCallError(Exception):
    """A call the env refuses before or while running it: `kind` is the error counter's name
    (bad_arguments, empty_argument, tool_error, tool_timeout, or a tool's own such as
    sandbox_timeout), `str(self)` the observation; `metrics` ({name: count}) are added to the
    episode's env metrics like `ToolResult.metrics`."""

    def __init__(self, kind: str, message: str, metrics: Mapping[str, float] | None = None):
        super().__init__(message)
        self.kind = kind
        self.metrics = dict(metrics or {})


class ToolServiceError(RuntimeError):
    """A tool's outside service failed (an MCP server that exited or hung): neither the policy's
    mistake nor a bug in the tool's code. `Tool.__call__` lets it through as it is, so the
    episode's env error is named by its own type (`env_error:MCPServerError`) and message."""


class ToolCrashError(RuntimeError):
    """A tool's function raised something other than ToolError, ValueError, ToolCallError or
    ToolServiceError: a bug in the env's code. str() is one line naming the tool, the exception
    and the call, `tool count raised KeyError: 'cnts' on the call count(word='apple')`, then the
    traceback: the rollout runner records `ToolCrashError: <str>` as the episode's env error
    (Trajectory.error and the step's info `error`), so the traceback travels with the episode.
    `tool` and `call` are the tool's name and the call as text; `__cause__` is the exception."""

    def __init__(self, tool: str, call: str, summary: str, trace: str):
        super().__init__(f"{summary}\n{trace}" if trace else summary)
        self.tool, self.call, self.summary = tool, call, summary


def _crash(tool: str, kwargs: Mapping[str, Any], exc: Exception) -> ToolCrashError:
    """`exc` from `tool`'s function as a ToolCrashError, logged in one line the first time this
    tool raises this type at this place."""
    shown = ", ".join(f"{k}={_cut(repr(v), _SHOWN_VALUE_CHARS)}" for k, v in kwargs.items())
    call = f"{tool}({shown})"
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    summary = f"tool {tool} raised {what} on the call {call}".replace("\n", "\\n")
    trace = "".join(traceback.format_exception(exc)).rstrip()
    if len(trace) > _TRACEBACK_CHARS:
        head, _, rest = trace.partition("\n")
        trace = f"{head}\n  ...\n{rest[-_TRACEBACK_CHARS:]}"
    frames = traceback.extract_tb(exc.__traceback__)
    place = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    if (tool, type(exc).__name__, place) not in _LOGGED_CRASHES:
        _LOGGED_CRASHES.add((tool, type(exc).__name__, place))
        log.warning(
            "%s (%s); the episode ends as an env error whose text has the traceback "
            "(logged once per tool and place)",
            summary,
            place,
        )
    return ToolCrashError(tool, call, summary, trace)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _unfaithful(value: Any, depth: int = 0) -> tuple[str, str, str] | None:
    """(what, how it is shown, what to return instead) for the first part of a result that JSON
    cannot show as it is, or None. Looks inside lists, tuples and dicts (not Structs)."""
    if isinstance(value, set | frozenset):
        order = "an arbitrary order (for str items one that changes with PYTHONHASHSEED)"
        return f"a {type(value).__name__}", f"a JSON list in {order}", "a sorted list"
    if isinstance(value, bytes | bytearray | memoryview):
        return "bytes", "base64 text", "text (decode the bytes)"
    if isinstance(value, float) and not math.isfinite(value):
        return "a non-finite float", "null", "a finite number, or a string such as 'inf'"
    if depth < 32 and isinstance(value, list | tuple | dict):
        for item in value.values() if isinstance(value, dict) else value:
            found = _unfaithful(item, depth + 1)
            if found is not None:
                return found
    return None


class ToolResult(msgspec.Struct, frozen=True):
    """A tool's result with reward: `content` (any JSON value) is what the policy sees;
    `rewards` ({name: float}) are added to the step's reward and to the episode's
    `reward_components` under those names; `metrics` ({name: count}) are added to the episode's
    env metrics (info `metrics`, summed over the episode's calls), e.g. the sandbox's
    `sandbox_output_truncated`."""

    content: Any
    rewards: dict[str, float] = msgspec.field(default_factory=dict)
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


class Call(msgspec.Struct, frozen=True):
    """One tool call: the tool's name and its arguments (a JSON object). A task's solution is
    written in Calls, which each env renders in its own tool-call format."""

    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)


class _Param(typing.NamedTuple):
    name: str
    annotation: Any
    default: Any  # inspect.Parameter.empty when required
    description: str


def _doc_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """(first paragraph as one line, {param: description} from a Google-style `Args:` section)."""
    doc = inspect.getdoc(fn) or ""
    paragraphs = doc.split("\n\n")
    summary = " ".join(paragraphs[0].split()) if doc else ""
    described: dict[str, str] = {}
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            current, indent = None, 0
            for entry in lines[i + 1 :]:
                if entry.strip() and not entry.startswith((" ", "\t")):
                    break
                m = re.match(r"\s+([A-Za-z_][A-Za-z0-9_]*)\s*(?:\([^)]*\))?\s*:\s*(.*)", entry)
                if m and (current is None or len(entry) - len(entry.lstrip()) <= indent):
                    current, indent = m.group(1), len(entry) - len(entry.lstrip())
                    described[current] = m.group(2).strip()
                elif current is not None and entry.strip():
                    described[current] += " " + entry.strip()
            break
    return summary, described


def _params(fn: Callable[..., Any]) -> tuple[_Param, ...]:
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # an unresolvable forward reference: say which function
        raise TypeError(
            f"tool {getattr(fn, '__name__', fn)!r}: cannot resolve its type hints: {exc}"
        ) from None
    _, described = _doc_parts(fn)
    params = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__!r}: *args/**kwargs parameters cannot be described to a model")
        if p.kind is p.POSITIONAL_ONLY:
            raise TypeError(
                f"tool {fn.__name__!r}: positional-only parameter {p.name!r}; tools are called by name"
            )
        if p.name not in hints:
            raise TypeError(
                f"tool {fn.__name__!r}: parameter {p.name!r} needs a type hint (it becomes the schema)"
            )
        params.append(_Param(p.name, hints[p.name], p.default, described.get(p.name, "")))
    return tuple(params)


def _arguments_struct(name: str, params: tuple[_Param, ...]) -> type[msgspec.Struct]:
    fields = [
        (p.name, p.annotation) if p.default is inspect.Parameter.empty else (p.name, p.annotation, p.default)
        for p in params
    ]
    try:
        return msgspec.defstruct(name, fields, forbid_unknown_fields=True, kw_only=True)
    except TypeError as exc:
        raise TypeError(f"tool {name!r}: its parameters cannot be validated: {exc}") from None


def _parameters_schema(struct: type[msgspec.Struct], params: tuple[_Param, ...]) -> dict[str, Any]:
    try:
        (_,), defs = msgspec.json.schema_components([struct], ref_template="#/$defs/{name}")
    except TypeError as exc:
        raise TypeError(f"tool {struct.__name__!r}: a parameter type has no JSON Schema: {exc}") from None
    schema = dict(defs.pop(struct.__name__))
    schema.pop("title", None)
    properties = {k: dict(v) for k, v in schema.get("properties", {}).items()}
    for p in params:
        if p.description and "description" not in properties[p.name]:
            properties[p.name]["description"] = p.description
    schema["properties"] = properties
    schema.setdefault("required", [])
    if defs:
        schema["$defs"] = defs
    return schema


_VALIDATION_AT = re.compile(r"^(.*) - at `\$\.([A-Za-z_][A-Za-z0-9_]*)(.*)`$")


def _explain(error: msgspec.ValidationError) -> str:
    """msgspec's message in the tool's terms: which argument, what was wrong."""
    text = str(error)
    if m := re.fullmatch(r"Object missing required field `(.*)`", text):
        return f"missing argument `{m.group(1)}`"
    if m := re.fullmatch(r"Object contains unknown field `(.*)`", text):
        return f"unexpected argument `{m.group(1)}`"
    if m := _VALIDATION_AT.match(text):
        where = m.group(2) + m.group(3).replace("$", "")
        return f"argument `{where}`: {m.group(1)[0].lower()}{m.group(1)[1:]}"
    return text


_Loop = BackgroundLoop("toolgym-tools")  # awaits every async tool


@dataclass(frozen=True, slots=True)
class Tool:
    """A named function the policy can call. Build typed tools with `Tool.from_function`.

    name: an identifier (`convert`, `LOOKUP`). description: one line for the system prompt.
    fn: the function; in this plain form it takes one string (the argument, never empty).
    arg: the plain form's parameter name, for the prompt (`LOOKUP[word]`).
    timeout_s: an async tool's per-call limit (a sync tool cannot be cut off).
    waits: a sync tool whose call waits on something outside the process (a subprocess, a
    server): the rollout runner then steps its env in a worker thread, so the other episodes
    go on meanwhile (`waits_outside`; async tools always count).
    per_env, end_episode: for a tool whose calls share state within an episode (the sandbox's
    persistent interpreter). A ToolEnv given such a tool uses its own copy, `per_env()`, so that
    envs never share it, and calls `end_episode()` when an episode ends (settled, reset, closed):
    the state is gone and the next call starts afresh.
    """

    name: str
    description: str
    fn: Callable[..., Any]
    arg: str = "x"
    timeout_s: float = DEFAULT_TIMEOUT_S
    waits: bool = False
    params: tuple[_Param, ...] | None = None  # None: the plain form (one str argument `arg`)
    # A JSON Schema given from outside (Tool.from_schema): validated by it, not by a Struct.
    schema: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)
    per_env: Callable[[], Tool] | None = field(default=None, repr=False, compare=False)
    end_episode: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    is_async: bool = field(init=False, default=False)
    _arguments: type[msgspec.Struct] | None = field(init=False, repr=False, compare=False)
    parameters: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"Tool name must be an identifier like LOOKUP, got {self.name!r}")
        if self.name.upper() == "ANSWER":
            raise ValueError("Tool name ANSWER is reserved for the [ANSWER] tag")
        if not isinstance(self.description, str) or not self.description.strip() or "\n" in self.description:
            raise ValueError(
                f"Tool {self.name}: description must be one non-empty line, got {self.description!r}"
            )
        if not callable(self.fn):
            raise TypeError(f"Tool {self.name}: fn must be callable, got {self.fn!r}")
        if not (
            isinstance(self.timeout_s, int | float) and self.timeout_s > 0 and math.isfinite(self.timeout_s)
        ):
            raise ValueError(f"Tool {self.name}: timeout_s must be a positive number, got {self.timeout_s!r}")
        if self.schema is not None:
            parameters = _given_schema(self.name, self.schema)
            if self.params is None:
                object.__setattr__(self, "params", _schema_params(parameters))
            object.__setattr__(self, "_arguments", None)
            object.__setattr__(self, "parameters", parameters)
            object.__setattr__(self, "is_async", inspect.iscoroutinefunction(self.fn))
            return
        params = self.params
        if params is None:
            if not _NAME_RE.fullmatch(self.arg):
                raise ValueError(f"Tool {self.name}: arg must be an identifier, got {self.arg!r}")
            params = (_Param(self.arg, str, inspect.Parameter.empty, ""),)
        struct = _arguments_struct(self.name, params)
        object.__setattr__(self, "_arguments", struct)
        object.__setattr__(self, "parameters", _parameters_schema(struct, params))
        object.__setattr__(self, "is_async", inspect.iscoroutinefunction(self.fn))

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        waits: bool = False,
        per_env: Callable[[], Tool] | None = None,
        end_episode: Callable[[], None] | None = None,
    ) -> Tool:
        """A typed tool: name from `fn.__name__`, description from the docstring's first
        paragraph, parameters (and their descriptions, from an `Args:` section) from the
        signature. Raises TypeError for a parameter that has no type hint or no JSON Schema.
        per_env, end_episode: a tool with per-episode state (the class doc)."""
        summary, _ = _doc_parts(fn)
        name = name or str(getattr(fn, "__name__", ""))
        description = description or summary
        if not description:
            raise ValueError(f"tool {name!r}: give it a docstring (its first line is the description)")
        return cls(
            name,
            description,
            fn,
            timeout_s=timeout_s,
            waits=waits,
            params=_params(fn),
            per_env=per_env,
            end_episode=end_episode,
        )

    @classmethod
    def from_schema(
        cls,
        name: str,
        description: str,
        parameters: Mapping[str, Any],
        fn: Callable[..., Any],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Tool:
        """A tool described by a given JSON Schema (an object schema, e.g. an MCP server's
        `inputSchema`): `parameters` is what the model sees, `check_arguments` validates a call
        against it, and `fn(**arguments)` receives the arguments as given (no defaults filled
        in). Raises ValueError for a schema that is not an object schema."""
        return cls(name, description, fn, timeout_s=timeout_s, schema=parameters)

    @property
    def waits_outside(self) -> bool:
        """Whether a call waits on something outside the process (`waits`, or an async tool)."""
        return self.waits or self.is_async

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params) if self.params is not None else (self.arg,)

    @property
    def spec(self) -> dict[str, Any]:
        """The tool as an OpenAI-style function spec: {"type": "function", "function": {name,
        description, parameters}}; what a chat template's `tools` takes."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @property
    def usage(self) -> str:
        """The bracket format's call shape: `LOOKUP[word]`, `CONVERT[value, unit]`."""
        return f"{self.name.upper()}[{', '.join(self.param_names)}]"

    def validate(self, arguments: Any, *, strict: bool = True) -> dict[str, Any]:
        """The arguments (a JSON object) checked and converted to the parameters' types.
        strict=False also converts strings to numbers and bools (text from the bracket format).
        Raises ToolCallError(bad_arguments) naming the offending parameter."""
        if not isinstance(arguments, Mapping):
            raise ToolCallError(
                "bad_arguments", f"arguments must be a JSON object, got {type(arguments).__name__}"
            )
        if self.schema is not None or self._arguments is None:
            return check_arguments(arguments, self.parameters, strict=strict)
        try:
            converted = msgspec.convert(arguments, self._arguments, strict=strict)
        except msgspec.ValidationError as exc:
            raise ToolCallError("bad_arguments", _explain(exc)) from None
        return {name: getattr(converted, name) for name in self.param_names}

    def __call__(self, arguments: Mapping[str, Any], *, strict: bool = True) -> ToolResult:
        """Validate `arguments`, run the function (awaiting an async one, within `timeout_s`),
        and return its result as a ToolResult. Raises ToolCallError for bad arguments, a
        rejected call (ToolError/ValueError) or a timeout (and lets one the function raises
        through); ToolServiceError passes as it is; anything else the function raises is a bug
        in the env, not the policy's mistake: ToolCrashError, naming this tool and the call,
        with the traceback (logged in one line the first time per tool and place).

        A result JSON cannot show faithfully (a set, bytes, a NaN or an infinity, also inside
        lists and dicts) warns once per tool and type (RuntimeWarning) and is shown all the
        same. A warning, not an error observation: the policy did nothing wrong, so it must not
        pay an error penalty or see its episode changed for the env's choice of type; results
        that were shown before are shown exactly as before; and the env's author, who can fix
        it (return a sorted list), is told which tool and type once, not once per call."""
        kwargs = self.validate(arguments, strict=strict)
        if self.params is None and not kwargs[self.arg].strip():
            raise ToolCallError("empty_argument", "EMPTY_ARGUMENT")
        try:
            if self.params is None:
                result = self.fn(kwargs[self.arg])
            else:
                result = self.fn(**kwargs)
            if inspect.isawaitable(result):
                future = asyncio.run_coroutine_threadsafe(_awaited(result), _Loop.get())
                try:
                    result = future.result(timeout=self.timeout_s)
                except TimeoutError:
                    future.cancel()
                    raise ToolCallError(
                        "tool_timeout", f"ERROR: {self.name} timed out after {self.timeout_s:g} s"
                    ) from None
        except (ToolError, ValueError) as rejected:
            raise ToolCallError("tool_error", str(rejected) or "ERROR") from None
        except (ToolCallError, ToolServiceError, ToolCrashError):
            raise
        except Exception as exc:
            raise _crash(self.name, kwargs, exc) from exc
        if not isinstance(result, ToolResult):
            result = ToolResult(result)
        if not isinstance(result.content, str):
            self._check_shown(result.content)
        for key, value in result.rewards.items():
            if not isinstance(key, str) or not _NAME_RE.fullmatch(key):
                raise ValueError(f"tool {self.name}: reward names are identifiers, got {key!r}")
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"tool {self.name}: reward {key!r} must be a finite number, got {value!r}")
        return result

    def _check_shown(self, content: Any) -> None:
        """Warn once per tool and type when `content` has a part JSON cannot show as it is."""
        found = _unfaithful(content)
        if found is None or (self.name, found[0]) in _WARNED_RESULTS:
            return
        _WARNED_RESULTS.add((self.name, found[0]))
        what, how, instead = found
        warnings.warn(
            f"tool {self.name} returned {what}: the observation shows it as {how}; return "
            f"{instead} (warned once per tool and type)",
            RuntimeWarning,
            stacklevel=3,
        )


def _given_schema(name: str, schema: Any) -> dict[str, Any]:
    """A copy of `schema` as a tool's parameters: an object schema with `properties` and
    `required` (its top-level `title` dropped, as the typed tools' schemas have none)."""
    if not isinstance(schema, Mapping) or schema.get("type", "object") != "object":
        raise ValueError(
            f"tool {name!r}: parameters must be a JSON Schema of type object, got {schema!r:.200}"
        )
    properties = schema.get("properties", {})
    required = schema.get("required", [])
    if not isinstance(properties, Mapping) or not all(isinstance(k, str) for k in properties):
        raise ValueError(f"tool {name!r}: the schema's properties must be an object, got {properties!r:.200}")
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise ValueError(
            f"tool {name!r}: the schema's required must be a list of names, got {required!r:.200}"
        )
    parameters = {k: v for k, v in schema.items() if k != "title"}
    parameters.update(type="object", properties=dict(properties), required=list(required))
    return parameters


def _schema_params(parameters: Mapping[str, Any]) -> tuple[_Param, ...]:
    """The schema's properties as parameters, in order (the bracket format's positions)."""
    required = set(parameters["required"])
    params = []
    for name, prop in parameters["properties"].items():
        described = prop.get("description", "") if isinstance(prop, Mapping) else ""
        default = inspect.Parameter.empty if name in required else None
        params.append(_Param(name, Any, default, described if isinstance(described, str) else ""))
    return tuple(params)


_JSON_TYPE_NAMES: Final = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    type(None): "null",
}
_INTEGER_TEXT: Final = re.compile(r"[+-]?[0-9]+")
_NUMBER_TEXT: Final = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _json_type(value: Any) -> str:
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _as_type(value: Any, kind: str, strict: bool) -> tuple[bool, Any]:
    """(whether `value` is of JSON type `kind`, the value converted). strict=False also reads
    numbers and booleans from strings (text from the bracket format)."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "integer":
        if is_number and (isinstance(value, int) or (math.isfinite(value) and value.is_integer())):
            return True, int(value)
        if not strict and isinstance(value, str) and _INTEGER_TEXT.fullmatch(value.strip()):
            return True, int(value.strip())
    elif kind == "number":
        if is_number and math.isfinite(value):
            return True, value
        if not strict and isinstance(value, str) and _NUMBER_TEXT.fullmatch(value.strip()):
            number = float(value.strip())
            return math.isfinite(number), int(number) if _INTEGER_TEXT.fullmatch(value.strip()) else number
    elif kind == "boolean":
        if isinstance(value, bool):
            return True, value
        if not strict and isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return True, value.strip().lower() == "true"
    elif kind in ("string", "null", "array", "object"):
        return _json_type(value) == kind, value
    else:  # a type this check does not know: the server decides
        return True, value
    return False, value


def _same_json(a: Any, b: Any) -> bool:
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))
    return a == b if numbers else (_json_type(a) == _json_type(b) and a == b)


def _check(value: Any, schema: Any, where: str, strict: bool) -> Any:
    """`value` checked against `schema` (see check_arguments); returns it converted."""
    if schema is False:
        raise ToolCallError("bad_arguments", f"argument `{where}` is not allowed")
    if not isinstance(schema, Mapping):
        return value
    kinds = schema.get("type")
    if isinstance(kinds, str):
        kinds = [kinds]
    if isinstance(kinds, list) and kinds:
        for kind in (*((k, True) for k in kinds), *(((k, False) for k in kinds) if not strict else ())):
            ok, converted = _as_type(value, kind[0], kind[1])
            if ok:
                value = converted
                break
        else:
            expected = " or ".join(f"`{k}`" for k in kinds)
            raise ToolCallError(
                "bad_arguments", f"argument `{where}`: expected {expected}, got `{_json_type(value)}`"
            )
    if "const" in schema and not _same_json(value, schema["const"]):
        raise ToolCallError("bad_arguments", f"argument `{where}`: expected {schema['const']!r}")
    choices = schema.get("enum")
    if isinstance(choices, list) and not any(_same_json(value, c) for c in choices):
        shown = ", ".join(repr(c) for c in choices[:10])
        raise ToolCallError(
            "bad_arguments", f"argument `{where}`: expected one of {shown}, got {value!r:.80}"
        )
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            for branch in branches:
                try:
                    value = _check(value, branch, where, strict)
                    break
                except ToolCallError:
                    continue
            else:
                raise ToolCallError("bad_arguments", f"argument `{where}`: matches none of its allowed forms")
    if isinstance(value, list) and "items" in schema:
        value = [_check(v, schema["items"], f"{where}[{i}]", strict) for i, v in enumerate(value)]
    elif isinstance(value, Mapping):
        value = _check_object(value, schema, f"{where}.", strict)
    return value


def _check_object(
    value: Mapping[str, Any], schema: Mapping[str, Any], prefix: str, strict: bool
) -> dict[str, Any]:
    properties = schema.get("properties", {})
    properties = properties if isinstance(properties, Mapping) else {}
    required = schema.get("required", [])
    for name in required if isinstance(required, list) else ():
        if name not in value:
            if not prefix:
                raise ToolCallError("bad_arguments", f"missing argument `{name}`")
            raise ToolCallError("bad_arguments", f"argument `{prefix[:-1]}`: missing field `{name}`")
    extra = schema.get("additionalProperties", True)
    checked: dict[str, Any] = {}
    for name, item in value.items():
        if name in properties:
            checked[name] = _check(item, properties[name], f"{prefix}{name}", strict)
        elif extra is False and "patternProperties" not in schema:
            if not prefix:
                raise ToolCallError("bad_arguments", f"unexpected argument `{name}`")
            raise ToolCallError("bad_arguments", f"argument `{prefix[:-1]}`: unexpected field `{name}`")
        else:
            checked[name] = (
                _check(item, extra, f"{prefix}{name}", strict) if isinstance(extra, Mapping) else item
            )
    return checked


def check_arguments(arguments: Any, schema: Mapping[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """`arguments` checked against an object JSON Schema and converted (strict=False: numbers
    and booleans read from strings; an integral float is an integer). Returns the arguments as
    given, converted; defaults are not filled in.

    A sound subset, so it never rejects what the schema allows: required keys, unknown keys
    where `additionalProperties` is false, `type` (one or a list), `enum`, `const`, `anyOf` /
    `oneOf` (some branch matches), nested `properties` and `items`. Other keywords ($ref,
    bounds, patterns, formats) are left to whoever runs the call (an MCP server rejects what it
    refuses). Raises ToolCallError(bad_arguments) naming the argument."""
    if not isinstance(arguments, Mapping):
        raise ToolCallError(
            "bad_arguments", f"arguments must be a JSON object, got {type(arguments).__name__}"
        )
    return _check_object(arguments, schema, "", strict)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def result_text(content: Any) -> str:
    """What the policy sees of a result: a str as it is, anything else compact JSON."""
    if isinstance(content, str):
        return content
    try:
        return msgspec.json.encode(content).decode()
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(
            f"a tool returned a value that is not JSON ({type(content).__name__}): {exc}"
        ) from None


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Mark a function (or a ToolEnv method) as a tool: `@tool` or `@tool(name=..., timeout_s=...)`.

    Returns the function itself, marked: a `ToolEnv` subclass collects its marked methods (bound
    to the env) and `ToolEnv(tools=[fn])` takes marked or plain functions; `Tool.from_function`
    builds the Tool."""

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise TypeError(f"@tool marks a function, got {f!r}")
        setattr(f, _MARK, {"name": name, "description": description, "timeout_s": timeout_s})
        return f

    return mark(fn) if fn is not None else mark


def as_tool(value: Any) -> Tool:
    """A Tool from a Tool, or from a (marked or plain) function via `Tool.from_function`."""
    if isinstance(value, Tool):
        return value
    if callable(value):
        options = getattr(value, _MARK, None) or {}
        return Tool.from_function(value, **options)
    raise TypeError(f"tools must be Tools or functions, got {value!r}")


def marked_methods(obj: Any) -> list[Callable[..., Any]]:
    """`obj`'s methods marked `@tool`, bound, in definition order (base classes first)."""
    seen: dict[str, None] = {}
    for klass in reversed(type(obj).__mro__):
        for attr, value in vars(klass).items():
            if callable(value) and hasattr(value, _MARK):
                seen[attr] = None
    return [getattr(obj, attr) for attr in seen]
