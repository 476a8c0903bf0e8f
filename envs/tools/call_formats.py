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
- "harmony": a `commentary` message to `functions.f` holding a JSON object; the answer is the
  `final` message (gpt-oss, with `policy.chat_template = "harmony"`; formats/harmony.py).

Every format: a `[ANSWER] <answer>` tag outside any call is the answer; a call that cannot be
read is a malformed call (a counted error whose observation says why, where the format can
tell), never a crash; only the first `max_chars` characters of an action are parsed (the env cuts
it); parsing never raises on any str.

`template_tool_format` reads a chat template's source and names the format it teaches (or None),
so a run can suggest the env's `tool_format` from the checkpoint's template.
"""

from __future__ import annotations

import re
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
from .formats.harmony import HarmonyFormat
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
    "template_tool_format",
]

FORMATS: Final[dict[str, ToolCallFormat]] = {
    f.name: f
    for f in (
        BracketFormat(),
        HarmonyFormat(),
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


# What each family's stock chat template writes (in its Jinja source, where a quote may be escaped):
# Qwen3-Coder's XML calls inside <tool_call>; Mistral's [TOOL_CALLS] marker; Hermes/Qwen's
# <tool_call> JSON blocks; Llama 3.2/4's pythonic instructions ("[func_name1(params_name1=...");
# Llama 3.1/3.2's JSON instructions ({"name": function name, "parameters": dictionary ...}) or
# its <|python_tag|>.
_QWEN_XML = re.compile(r"<function=.*?<parameter=", re.DOTALL)
_PYTHONIC = re.compile(r"\[\s*func(?:tion)?_?name\w*\s*\(\s*\w+\s*=")
_LLAMA_JSON = re.compile(r"""\\?["']parameters\\?["']\s*:\s*dictionary|<\|python_tag\|>""")


def template_tool_format(template: str) -> str | None:
    """The tool-call format (a FORMATS name) that a chat template's source teaches its model, or
    None where it names none of them (a template without tools, or another dialect). Checked in
    this order, so that a template holding two markers gets its own: gpt-oss's harmony
    (`<|channel|>` and `<|call|>`) -> "harmony"; Qwen3-Coder's
    `<function=`/`<parameter=` (its calls also sit in `<tool_call>`) -> "qwen3_coder";
    `[TOOL_CALLS]` -> "mistral"; `<tool_call>` -> "json" (unless the calls inside are pythonic:
    another dialect, None); Llama 3.2/4's `[func_name1(params_name1=...)]` instructions ->
    "pythonic"; Llama 3.1's `"parameters": dictionary ...` instructions or `<|python_tag|>` ->
    "llama3_json"."""
    if "<|channel|>" in template and "<|call|>" in template:
        return "harmony"
    if _QWEN_XML.search(template):
        return "qwen3_coder"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    pythonic = _PYTHONIC.search(template) is not None
    if "<tool_call>" in template:
        return None if pythonic else "json"
    if pythonic:
        return "pythonic"
    if _LLAMA_JSON.search(template):
        return "llama3_json"
    return None
