"""OLMo 2 (`olmo2`, Olmo2ForCausalLM) and OLMo 3 (`olmo3`, Olmo3ForCausalLM): Llama's linears and
SwiGLU MLP with the norms moved after each sublayer (no input norm; `post_attention_layernorm` on
the attention's output and `post_feedforward_layernorm` on the MLP's output, each before its
residual add), and q_norm / k_norm RMSNorms over the whole q and k projections (num_heads *
head_dim, num_kv_heads * head_dim) before they are split into heads. Biases on q/k/v/o only with
`attention_bias`. OLMo 3 adds sliding-window layers (`layer_types`, by default three in four, and
`sliding_window`, default 4096); OLMo 2 has none.

RoPE: OLMo 2 default only. OLMo 3: default or YaRN, and a different RoPE per layer type where the
sliding layers' is a default one (the published 65K-context checkpoints: YaRN x8 from 8192 on the
full-attention layers, default RoPE on the sliding ones), read as `rope_scaling` for the
full-attention layers and `rope_local_base_freq` for the sliding ones; other mixes are refused
(one line). transformers 5 writes OLMo 3's RoPE as `rope_parameters` per layer type; the older
flat `rope_theta` / `rope_scaling` form reads as that base on every layer and the scaling on the
full-attention layers only (transformers 4.57's reading; 5's too, but for the sliding layers'
base, its default 5e5). OLMo 3's config.json is written per layer type."""

from __future__ import annotations

from typing import Any

from .base import Family, Shape, full_every

# Olmo2Config / Olmo3Config defaults where config.json leaves a field out.
_EPS, _OLMO2_THETA, _OLMO3_THETA, _WINDOW, _PATTERN = 1e-5, 10_000.0, 500_000.0, 4096, 4
_OLMO3_ROPE = ("default", "yarn")
_OWN_LAYERS = "OLMo's blocks (norms after attention and MLP, q/k norms over the whole projection)"


def _rope_in(
    d: dict[str, Any], model_type: str, default_theta: float, types: tuple[str, ...]
) -> dict[str, Any]:
    """transformers 5's per-layer-type `rope_parameters` as one set for the full-attention layers
    plus, where the sliding ones differ (OLMo 3 only: a default RoPE there), their base as
    `rope_local_base_freq`; else the flat fields with the family's default base, a flat RoPE
    scaling on the full-attention layers only (Olmo3Config's reading) and the flat base on both."""
    out = dict(d)
    params = d.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        kinds = {k: dict(v or {}) for k, v in params.items() if k in ("full_attention", "sliding_attention")}
        for kind, rope in kinds.items():
            rope.setdefault("rope_theta", d.get("rope_theta", default_theta))
            rope.setdefault("rope_type", rope.pop("type", "default"))
            # transformers reads `truncate` from the top of rope_parameters only: no effect here.
            rope.pop("truncate", None)
            if rope["rope_type"] not in types:
                raise ValueError(
                    f"{model_type}: RoPE rope_type={rope['rope_type']!r} on the {kind} layers is not "
                    f"supported (supported: {list(types)})"
                )
        full = kinds.get("full_attention") or kinds["sliding_attention"]
        sliding = kinds.get("sliding_attention") or full
        if full != sliding:
            if model_type != "olmo3" or sliding["rope_type"] != "default":
                raise ValueError(
                    f"{model_type}: different RoPE per layer type is supported as a default RoPE on "
                    f"the sliding layers only (rope_parameters={params})"
                )
            out["rope_local_base_freq"] = sliding["rope_theta"]
        out["rope_parameters"] = full
        out.pop("rope_scaling", None)
    else:
        flat = d.get("rope_scaling") or params
        if model_type == "olmo3" and flat.get("rope_type", flat.get("type", "default")) != "default":
            out["rope_local_base_freq"] = flat.get("rope_theta", d.get("rope_theta", default_theta))
        if not params.get("rope_theta"):
            out.setdefault("rope_theta", default_theta)
    return out


def _olmo2_in(d: dict[str, Any]) -> dict[str, Any]:
    out = _rope_in(d, "olmo2", _OLMO2_THETA, ("default",))
    out.setdefault("rms_norm_eps", _EPS)
    return out


def _olmo3_in(d: dict[str, Any]) -> dict[str, Any]:
    out = _rope_in(d, "olmo3", _OLMO3_THETA, _OLMO3_ROPE)
    out.setdefault("rms_norm_eps", _EPS)
    out.setdefault("sliding_window", _WINDOW)
    if not d.get("layer_types"):
        out["layer_types"] = full_every(d["num_hidden_layers"], _PATTERN, "sliding_attention")
    return out


def _olmo2_fields(config: Shape) -> dict[str, Any]:
    return {"attention_bias": config.attention_bias}


def _olmo3_fields(config: Shape) -> dict[str, Any]:
    """RoPE per layer type (transformers 5 reads a flat `rope_theta` as the full-attention layers'
    base only, the sliding ones then getting its default 5e5): the full-attention layers' with
    the scaling, the sliding ones' the same or, with `rope_local_base_freq`, a default RoPE of that
    base. No flat `rope_scaling` (Olmo3Config would lay it over the full-attention layers')."""
    layers = config.num_hidden_layers
    full = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        full = {**config.rope_scaling.to_hf_dict(), "rope_theta": config.rope_theta}
    sliding = dict(full)
    if config.rope_local_base_freq is not None:
        sliding = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    return {
        "attention_bias": config.attention_bias,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types or ["full_attention"] * layers),
        "rope_scaling": None,
        "rope_parameters": {"full_attention": full, "sliding_attention": sliding},
    }


OLMO2 = Family(
    model_type="olmo2",
    architecture="Olmo2ForCausalLM",
    bias="flag",
    qk_norm=True,
    qk_norm_over="projection",
    norm_placement="post",
    hf_fields=_olmo2_fields,
    hf_in=_olmo2_in,
    own_layers=_OWN_LAYERS,
)

OLMO3 = Family(
    model_type="olmo3",
    architecture="Olmo3ForCausalLM",
    bias="flag",
    qk_norm=True,
    qk_norm_over="projection",
    norm_placement="post",
    sliding_window=True,
    layer_types=True,
    hf_fields=_olmo3_fields,
    hf_in=_olmo3_in,
    rope_types=_OLMO3_ROPE,
    local_rope="optional",
    own_layers=_OWN_LAYERS,
)

__all__ = ["OLMO2", "OLMO3"]
