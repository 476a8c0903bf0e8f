"""Tool-call formats: how an action string states tool calls and answers, and how calls, results
and tools are written back. A `ToolEnv` takes one by name (`tool_format=`); each is one module
of envs/tools/formats/, whose doc is its grammar:

- "brackets": `NAME[arg]` (Zorplex's, the seed experiment's; formats/brackets.py).
- "json": Hermes-style `<tool_call>{json}</tool_call>` blocks (Qwen2.5/Qwen3; formats/hermes.py).

Every format: a `[ANSWER] <answer>` tag outside any call is the answer; a call that cannot be
read is a malformed call (a counted error whose observation says why, where the format can
tell), never a crash; only the first `max_chars` characters of an action are parsed (the env cuts
it); parsing never raises on any str.
"""

from __future__ import annotations

from typing import Final

from .formats.base import (
    ANSWER,
    BAD_CALL,
    CALLS,
    EMPTY,
    MIXED,
    OTHER,
    ParsedAction,
    ParsedCall,
    ToolCallFormat,
    clean_argument,
    near_miss_pattern,
)
from .formats.brackets import BracketFormat
from .formats.hermes import JsonFormat

__all__ = [
    "ANSWER",
    "BAD_CALL",
    "CALLS",
    "EMPTY",
    "FORMATS",
    "MIXED",
    "OTHER",
    "BracketFormat",
    "JsonFormat",
    "ParsedAction",
    "ParsedCall",
    "ToolCallFormat",
    "clean_argument",
    "get_format",
    "near_miss_pattern",
]

FORMATS: Final[dict[str, ToolCallFormat]] = {"brackets": BracketFormat(), "json": JsonFormat()}


def get_format(name: str) -> ToolCallFormat:
    if name not in FORMATS:
        raise ValueError(f"tool_format must be one of {sorted(FORMATS)}, got {name!r}")
    return FORMATS[name]
