"""Llama 2 / 3.x: no q/k norm, biases on q/k/v/o only with `attention_bias`, default RoPE or
Llama 3.1's `llama3` frequency scaling (factor, low/high_freq_factor,
original_max_position_embeddings), or YaRN."""

from __future__ import annotations

from typing import Any

from .base import Family, Shape


def _hf_fields(config: Shape) -> dict[str, Any]:
    return {"attention_bias": config.attention_bias, "mlp_bias": False, "pretraining_tp": 1}


LLAMA = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    bias="flag",
    rope_types=("default", "llama3", "yarn"),
    hf_fields=_hf_fields,
)

__all__ = ["LLAMA"]
