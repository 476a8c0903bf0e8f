"""What the JSON dialects (Llama 3 JSON, Mistral `[TOOL_CALLS]`) share: reading one JSON value
where it starts in a longer text, and reading a `{"name": ..., "arguments": {...}}` object as a
call. Values are read as the json format reads them (msgspec: no NaN, no infinity, big ints
kept); every failure is a message, never an exception."""

from __future__ import annotations

import json
import re
from typing import Any, Final

import msgspec

from .base import SHOWN_NAME_CHARS, ParsedCall

BARE_CALL_RE: Final = re.compile(r'\{\s*"name"\s*:')
_SPACE_RE: Final = re.compile(r"\s*")


class JsonSyntaxError(ValueError):
    """The text at a position is not one JSON value; `str()` says why and where."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_SPAN: Final = json.JSONDecoder(parse_constant=_no_constant)


def decode_at(text: str, start: int) -> tuple[Any, int]:
    """The JSON value that starts at `text[start]` and where it ends; raises JsonSyntaxError."""
    try:
        _, end = _SPAN.raw_decode(text, start)
        return msgspec.json.decode(text[start:end]), end
    except (msgspec.DecodeError, RecursionError, ValueError) as exc:
        raise JsonSyntaxError(str(exc)) from None


def skip_space(text: str, at: int) -> int:
    """The first non-whitespace position at or after `at`."""
    match = _SPACE_RE.match(text, at)
    return match.end() if match is not None else at


def malformed(message: str, name: str = "") -> ParsedCall:
    """An unreadable call: a malformed_call error whose observation is `message`."""
    return ParsedCall(name, {}, error="malformed_call", message=message)


def call_from_object(value: Any, keys: tuple[str, ...], shape: str) -> ParsedCall:
    """A decoded `{"name": <str>, <key>: {...}}` as a call; the arguments under the first of
    `keys` present (a JSON string holding the object is read too, as the OpenAI API sends it;
    none: no arguments). `shape` is how the error says a call is written."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return malformed(f"ERROR: {shape}.")
    given = [key for key in keys if key in value]
    if len(given) > 1:
        return malformed(f"ERROR: {' and '.join(given)} in one call; {shape}.", value["name"])
    arguments = value[given[0]] if given else {}
    if isinstance(arguments, str):
        try:
            arguments = msgspec.json.decode(arguments) if arguments.strip() else {}
        except (msgspec.DecodeError, RecursionError, ValueError) as exc:
            return malformed(f"ERROR: arguments are not valid JSON ({exc}).", value["name"])
    return ParsedCall(value["name"], arguments, value["name"][:SHOWN_NAME_CHARS])
