"""gpt-oss (`gpt_oss`, GptOssForCausalLM): attention with q/k/v/o biases and a learned sink logit
per head (`self_attn.sinks`), sliding-window layers alternating with full ones (`layer_types`,
window 128), YaRN RoPE, and a mixture of experts in every layer: a router with a bias whose
softmax runs over its top-k logits, experts with biases and gpt-oss's clamped SwiGLU
(`swiglu_alpha`, `swiglu_limit`; agents/model/moe.py `GptOssMoE`). The experts' width is
config.json's `intermediate_size` (there is no dense MLP). Refused: the MXFP4-quantized experts of
the published checkpoints (`quantization_config`; a bf16 copy of the weights loads)."""

from __future__ import annotations

from typing import Any

from .base import Family, Shape, full_every

# GptOssConfig's defaults where config.json leaves a field out.
_ALPHA, _LIMIT, _WINDOW = 1.702, 7.0, 128


def _hf_in(d: dict[str, Any]) -> dict[str, Any]:
    """config.json in the shared reader's terms: the experts' count, width and routing as the
    mixture-of-experts fields, layer_types alternating from a sliding layer where absent."""
    if d.get("quantization_config"):
        method = (d["quantization_config"] or {}).get("quant_method", "?")
        raise ValueError(
            f"gpt_oss: quantized weights (quantization_config {method!r}) are not supported; "
            "load a bf16 copy of the checkpoint"
        )
    out = dict(d)
    out["num_experts"] = d.get("num_local_experts", d.get("num_experts"))
    out["moe_intermediate_size"] = d["intermediate_size"]
    out["norm_topk_prob"] = True  # the softmax over the top-k logits: weights that sum to 1
    out.setdefault("attention_bias", True)
    out.setdefault("sliding_window", _WINDOW)
    out.setdefault("swiglu_alpha", _ALPHA)
    out.setdefault("swiglu_limit", _LIMIT)
    if not d.get("layer_types"):
        out["layer_types"] = full_every(d["num_hidden_layers"], 2, "sliding_attention")
    return out


def _hf_fields(config: Shape) -> dict[str, Any]:
    moe = config.moe_fields()
    return {
        "attention_bias": config.attention_bias,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types or ["full_attention"] * config.num_hidden_layers),
        "num_local_experts": moe["num_experts"],
        "num_experts_per_tok": moe["num_experts_per_tok"],
        "swiglu_alpha": moe["swiglu_alpha"],
        "swiglu_limit": moe["swiglu_limit"],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        # transformers' GptOssConfig reads no rope parameters as the published YaRN: plain RoPE is
        # written out, or a checkpoint of a shape without YaRN would load with it.
        **(
            {"rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}}
            if config.rope_scaling is None
            else {}
        ),
    }


GPT_OSS = Family(model_type="gpt_oss", architecture="GptOssForCausalLM", bias="flag",
                 rope_types=("default", "yarn"), sliding_window=True, layer_types=True, hf_fields=_hf_fields,
                 hf_in=_hf_in, moe=True, moe_style="gpt_oss", attention_sinks=True,
                 own_layers="gpt-oss's blocks (attention sinks, mixture-of-experts MLPs)")  # fmt: skip

__all__ = ["GPT_OSS"]
