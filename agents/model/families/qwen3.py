"""Qwen3 dense: an RMSNorm over each head's q and k before RoPE; biases on q/k/v/o only with
`attention_bias`; default RoPE or YaRN."""

from __future__ import annotations

from typing import Any

from .base import Family, Shape


def _hf_fields(config: Shape) -> dict[str, Any]:
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.num_hidden_layers,
        "attention_bias": config.attention_bias,
    }


QWEN3 = Family(model_type="qwen3", architecture="Qwen3ForCausalLM", bias="flag", qk_norm=True,
               rope_types=("default", "yarn"), hf_fields=_hf_fields)  # fmt: skip

__all__ = ["QWEN3"]
