"""Gemma 3 text (`gemma3_text`, Gemma3ForCausalLM): Gemma's RMSNorm (x * (1 + w) in float32),
four norms per block (the attention's output and the MLP's input and output each normalised), a
per-head q/k norm, scores scaled by query_pre_attn_scalar**-0.5, embeddings times
sqrt(hidden_size), a GELU-tanh MLP, and sliding-window layers (`layer_types`, by default five in
six) that rotate with their own RoPE base (`rope_local_base_freq`) while the full-attention layers
use `rope_theta`. No biases. Refused: logit soft-capping, bidirectional attention, RoPE scaling
(the published 4B+ checkpoints' `linear` factor on the global layers)."""

from __future__ import annotations

from typing import Any

from .base import Family, Shape, full_every

# Gemma3TextConfig's defaults where config.json leaves a field out.
_GLOBAL_THETA, _LOCAL_THETA, _PATTERN = 1_000_000.0, 10_000.0, 6


def _hf_in(d: dict[str, Any]) -> dict[str, Any]:
    """config.json in the shared reader's terms: the full-attention layers' RoPE as rope_theta /
    rope_parameters, the sliding layers' base as rope_local_base_freq, hidden_activation as
    hidden_act, layer_types from sliding_window_pattern where absent; refusals in one line."""
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(field) is not None:
            raise ValueError(f"gemma3_text: {field}={d[field]} (logit soft-capping) is not supported")
    if d.get("use_bidirectional_attention"):
        raise ValueError("gemma3_text: use_bidirectional_attention=true is not supported (causal only)")
    out = dict(d)
    params = d.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5's layout
        full = dict(params.get("full_attention") or {})
        local = params.get("sliding_attention") or {}
        out["rope_theta"] = full.pop("rope_theta", d.get("rope_theta", _GLOBAL_THETA))
        out["rope_local_base_freq"] = local.get("rope_theta", d.get("rope_local_base_freq", _LOCAL_THETA))
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"gemma3_text: sliding layers' rope_type={local['rope_type']!r} is not supported"
            )
        out["rope_parameters"] = full
    else:
        out.setdefault("rope_theta", _GLOBAL_THETA)
        out.setdefault("rope_local_base_freq", _LOCAL_THETA)
    out["hidden_act"] = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    out.setdefault("query_pre_attn_scalar", 256)
    out.setdefault("sliding_window", 4096)
    out.setdefault("tie_word_embeddings", True)
    out.setdefault("pad_token_id", 0)
    if not d.get("layer_types"):
        pattern = d.get("sliding_window_pattern", _PATTERN)
        out["layer_types"] = full_every(d["num_hidden_layers"], pattern, "sliding_attention")
    return out


def _hf_fields(config: Shape) -> dict[str, Any]:
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "rope_local_base_freq": config.rope_local_base_freq,
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types or ["full_attention"] * config.num_hidden_layers),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


GEMMA3_TEXT = Family(
    model_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    bias="none",
    qk_norm=True,
    sliding_window=True,
    layer_types=True,
    hf_fields=_hf_fields,
    hf_in=_hf_in,
    norm_scale="one_plus_weight",
    sandwich_norms=True,
    embed_scale=True,
    hidden_act="gelu_pytorch_tanh",
    local_rope=True,
    query_pre_attn_scalar=True,
    own_layers="Gemma 3's blocks (four norms, GELU MLP, two RoPE bases)",
)

__all__ = ["GEMMA3_TEXT"]
