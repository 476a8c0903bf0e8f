"""Qwen3 dense: an RMSNorm over each head's q and k before RoPE; biases on q/k/v/o only with
`attention_bias`; default RoPE or YaRN."""

from __future__ import annotations

from typing import Any

from .base import Family, Shape


def qwen3_hf_fields(config: Shape) -> dict[str, Any]:
    """Qwen3's own config.json fields (Qwen3-MoE's too)."""
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.num_hidden_layers,
        "attention_bias": config.attention_bias,
    }


QWEN3 = Family(model_type="qwen3", architecture="Qwen3ForCausalLM", bias="flag", qk_norm=True,
               rope_types=("default", "yarn"), hf_fields=qwen3_hf_fields)  # fmt: skip

__all__ = ["QWEN3", "qwen3_hf_fields"]
