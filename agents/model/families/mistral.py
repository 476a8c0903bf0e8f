"""Mistral: no biases, no q/k norm, default RoPE or YaRN; `sliding_window` (null in v0.2+) is a window
over every layer (`ModelConfig.layer_window`)."""

from __future__ import annotations

from typing import Any

from .base import Family, Shape


def _hf_fields(config: Shape) -> dict[str, Any]:
    return {"sliding_window": config.sliding_window}


MISTRAL = Family(
    model_type="mistral",
    architecture="MistralForCausalLM",
    bias="none",
    rope_types=("default", "yarn"),
    sliding_window=True,
    hf_fields=_hf_fields,
)

__all__ = ["MISTRAL"]
