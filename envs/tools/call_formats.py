"""Tool-call formats: how an action string states tool calls and answers, and how calls, results
and tools are written back. A `ToolEnv` takes one by name (`tool_format=`); each is one module
of envs/tools/formats/, whose doc is its grammar:

- "brackets": `NAME[arg]` (Zorplex's, the seed experiment's; formats/brackets.py).
- "json": Hermes-style `<tool_call>{json}</tool_call>` blocks (Qwen2.5/Qwen3; formats/hermes.py).
- "llama3_json": `{"name": f, "parameters": {...}}` as the whole message (Llama 3.1/3.2;
  formats/llama.py).
- "mistral": `[TOOL_CALLS][{"name": f, "arguments": {...}}]` or `[TOOL_CALLS]f[ARGS]{...}`
  (formats/mistral.py).
- "pythonic": `[f(a=1, b="x"), g()]`, literals only (Llama 3.2 / Llama 4; formats/pythonic.py).
- "qwen3_coder": `<tool_call><function=f><parameter=a>1</parameter></function></tool_call>`,
  values typed by the tool's JSON Schema (Qwen3-Coder; formats/qwen_xml.py).

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
from .formats.llama import Llama3JsonFormat
from .formats.mistral import MistralFormat
from .formats.pythonic import PythonicFormat
from .formats.qwen_xml import QwenXmlFormat

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
    "Llama3JsonFormat",
    "MistralFormat",
    "ParsedAction",
    "ParsedCall",
    "PythonicFormat",
    "QwenXmlFormat",
    "ToolCallFormat",
    "clean_argument",
    "get_format",
    "near_miss_pattern",
]

FORMATS: Final[dict[str, ToolCallFormat]] = {
    f.name: f
    for f in (
        BracketFormat(),
        JsonFormat(),
        Llama3JsonFormat(),
        MistralFormat(),
        PythonicFormat(),
        QwenXmlFormat(),
    )
}


def get_format(name: str) -> ToolCallFormat:
    if name not in FORMATS:
        raise ValueError(f"tool_format must be one of {sorted(FORMATS)}, got {name!r}")
    return FORMATS[name]
