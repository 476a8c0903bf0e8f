"""Qwen3-MoE (`qwen3_moe`, Qwen3MoeForCausalLM): Qwen3's attention (an RMSNorm over each head's q
and k before RoPE) with mixture-of-experts MLPs (agents/model/moe.py) on the layers
`ModelConfig.layer_moe` names (all but `mlp_only_layers`, every `decoder_sparse_step`-th), a
dense SwiGLU MLP of `intermediate_size` on the others. Default RoPE or YaRN."""

from __future__ import annotations

from typing import Any

from .base import Family, Shape
from .qwen3 import qwen3_hf_fields


def _hf_fields(config: Shape) -> dict[str, Any]:
    return {**qwen3_hf_fields(config), **config.moe_fields()}


def _hf_in(d: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `num_experts` as `num_local_experts` (Qwen3MoeConfig's attribute map)."""
    out = dict(d)
    if "num_experts" not in out and "num_local_experts" in out:
        out["num_experts"] = out["num_local_experts"]
    return out


QWEN3_MOE = Family(model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", bias="flag", qk_norm=True,
                   rope_types=("default", "yarn"), hf_fields=_hf_fields, hf_in=_hf_in, moe=True,
                   own_layers="mixture-of-experts MLPs")  # fmt: skip

__all__ = ["QWEN3_MOE"]
