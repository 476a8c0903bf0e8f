"""Qwen2 / Qwen2.5: a bias on q/k/v (none on o), no q/k norm, default RoPE or YaRN."""

from __future__ import annotations

from typing import Any

from .base import Family, Shape


def _hf_fields(config: Shape) -> dict[str, Any]:
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.num_hidden_layers,
    }


QWEN2 = Family(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    bias="qkv",
    rope_types=("default", "yarn"),
    hf_fields=_hf_fields,
)

__all__ = ["QWEN2"]
