"""Qwen3.5 text (`qwen3_5_text`, Qwen3_5ForCausalLM): a hybrid of Gated DeltaNet linear-attention
layers (agents/model/linear_attention.py; `layer_types` "linear_attention", by default three in
four) and full-attention layers whose q_proj also gives a sigmoid gate on each head's output
(`attention_output_gate`), with a per-head q/k norm and RoPE on the first `partial_rotary_factor`
of each head (0.25 by default). Every RMSNorm scales by (1 + w) in float32 (its weights start at
0), except the linear layers' gated output norm (plain w, starting at 1). Its multimodal RoPE
(`mrope_section`) rotates text positions as plain RoPE does, so text checkpoints read as they
are. Qwen3_5ForConditionalGeneration checkpoints (model_type "qwen3_5", as Qwen3.5 is published)
read as their text model: `text_config`, the `model.language_model.*` weights and `lm_head`;
the vision tower (`model.visual.*`) and any multi-token-prediction head (`mtp.*`) are not read."""

from __future__ import annotations

from typing import Any

from .base import Family, Shape, full_every

# Qwen3_5TextConfig's defaults where config.json leaves a field out.
_INTERVAL, _PARTIAL = 4, 0.25


def _hf_in(d: dict[str, Any]) -> dict[str, Any]:
    """config.json in the shared reader's terms: layer_types (every `full_attention_interval`-th
    layer full) and partial_rotary_factor where absent."""
    out = dict(d)
    rope = dict(d.get("rope_parameters") or {})
    rope.setdefault("partial_rotary_factor", d.get("partial_rotary_factor", _PARTIAL))
    out["rope_parameters"] = rope
    if not d.get("layer_types"):
        interval = d.get("full_attention_interval", _INTERVAL)
        out["layer_types"] = full_every(d["num_hidden_layers"], interval, "linear_attention")
    return out


def _hf_fields(config: Shape) -> dict[str, Any]:
    linear = config.linear_fields()
    return {
        "attention_bias": config.attention_bias,
        "layer_types": list(config.layer_types or ()),
        **linear,
        "partial_rotary_factor": linear["partial_rotary_factor"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": linear["partial_rotary_factor"],
        },
    }


QWEN3_5 = Family(model_type="qwen3_5_text", architecture="Qwen3_5ForCausalLM", bias="flag", qk_norm=True,
                 layer_types=True, hf_fields=_hf_fields, hf_in=_hf_in, norm_scale="one_plus_weight",
                 own_layers="Qwen3.5's Gated DeltaNet layers", linear_attention=True,
                 attention_output_gate=True, multimodal=("qwen3_5", "model.language_model."))  # fmt: skip

__all__ = ["QWEN3_5"]
