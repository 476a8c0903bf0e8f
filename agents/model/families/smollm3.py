"""SmolLM3: Llama's blocks, with some layers that do not rotate q/k (`no_rope_layers`, NoPE);
biases on q/k/v/o only with `attention_bias`; default RoPE."""

from __future__ import annotations

from typing import Any

from .base import Family, Shape


def _hf_fields(config: Shape) -> dict[str, Any]:
    layers = config.num_hidden_layers
    return {
        "attention_bias": config.attention_bias,
        "mlp_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "no_rope_layers": list(config.no_rope_layers or [1] * layers),
        "layer_types": ["full_attention"] * layers,
    }


SMOLLM3 = Family(
    model_type="smollm3",
    architecture="SmolLM3ForCausalLM",
    bias="flag",
    no_rope_layers=True,
    hf_fields=_hf_fields,
)

__all__ = ["SMOLLM3"]
