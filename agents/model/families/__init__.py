"""The native model families, one module each, keyed by Hugging Face's `model_type`
(`FAMILIES`). `family(model_type)` is the one lookup; an unknown model_type is one line naming it
and the native families. A new family is a new module here plus one entry below."""

from __future__ import annotations

from .base import Family
from .gemma3 import GEMMA3_TEXT
from .gpt_oss import GPT_OSS
from .llama import LLAMA
from .mistral import MISTRAL
from .olmo import OLMO2, OLMO3
from .qwen2 import QWEN2
from .qwen3 import QWEN3
from .qwen3_5 import QWEN3_5
from .qwen3_moe import QWEN3_MOE
from .smollm3 import SMOLLM3

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (QWEN2, QWEN3, QWEN3_MOE, LLAMA, MISTRAL, SMOLLM3, GEMMA3_TEXT, OLMO2, OLMO3, GPT_OSS, QWEN3_5)
}


def family(model_type: object) -> Family:
    """The native family of `model_type`; ValueError naming it and the native families if none."""
    found = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise ValueError(
            f"model_type {model_type!r} has no native family (native: {', '.join(FAMILIES)}); "
            'run it through transformers with policy.implementation = "transformers"'
        )
    return found


__all__ = ["FAMILIES", "Family", "family"]
