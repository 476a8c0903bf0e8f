"""OLMo 2 (`olmo2`, Olmo2ForCausalLM) and OLMo 3 (`olmo3`, Olmo3ForCausalLM): Llama's linears and
SwiGLU MLP with the norms moved after each sublayer (no input norm; `post_attention_layernorm` on
the attention's output and `post_feedforward_layernorm` on the MLP's output, each before its
residual add), and q_norm / k_norm RMSNorms over the whole q and k projections (num_heads *
head_dim, num_kv_heads * head_dim) before they are split into heads. Biases on q/k/v/o only with
`attention_bias`. OLMo 3 adds sliding-window layers (`layer_types`, by default three in four, and
`sliding_window`, default 4096); OLMo 2 has none.

RoPE: default only, the same base on every layer. transformers 5 writes OLMo 3's as
`rope_parameters` per layer type; both must be the default type with one `rope_theta`, so the
published 65K-context checkpoints' YaRN on the full-attention layers is refused (one line). The
older flat `rope_theta` / `rope_scaling` form reads as that base on every layer (transformers 4.57's
reading); OLMo 3's config.json is written per layer type, so transformers 5 reads the same base."""

from __future__ import annotations

from typing import Any

from .base import Family, Shape

# Olmo2Config / Olmo3Config defaults where config.json leaves a field out.
_EPS, _OLMO2_THETA, _OLMO3_THETA, _WINDOW, _PATTERN = 1e-5, 10_000.0, 500_000.0, 4096, 4
_OWN_LAYERS = "OLMo's blocks (norms after attention and MLP, q/k norms over the whole projection)"


def _rope_in(d: dict[str, Any], model_type: str, default_theta: float) -> dict[str, Any]:
    """transformers 5's per-layer-type `rope_parameters` as one flat set (refused where the layer
    types differ), else the flat fields with the family's default base."""
    out = dict(d)
    params = d.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        kinds = {k: dict(v or {}) for k, v in params.items() if k in ("full_attention", "sliding_attention")}
        for kind in kinds.values():
            kind.setdefault("rope_theta", d.get("rope_theta", default_theta))
            kind.setdefault("rope_type", "default")
        for kind, rope in kinds.items():
            if rope["rope_type"] != "default":
                raise ValueError(
                    f"{model_type}: RoPE rope_type={rope['rope_type']!r} on the {kind} layers is not "
                    "supported (supported: ['default'])"
                )
        if len({tuple(sorted(k.items())) for k in kinds.values()}) > 1:
            raise ValueError(
                f"{model_type}: different RoPE per layer type is not supported (rope_parameters={params})"
            )
        out["rope_parameters"] = next(iter(kinds.values()))
    elif not params.get("rope_theta"):
        out.setdefault("rope_theta", default_theta)
    return out


def _olmo2_in(d: dict[str, Any]) -> dict[str, Any]:
    out = _rope_in(d, "olmo2", _OLMO2_THETA)
    out.setdefault("rms_norm_eps", _EPS)
    return out


def _olmo3_in(d: dict[str, Any]) -> dict[str, Any]:
    out = _rope_in(d, "olmo3", _OLMO3_THETA)
    out.setdefault("rms_norm_eps", _EPS)
    out.setdefault("sliding_window", _WINDOW)
    if not d.get("layer_types"):
        out["layer_types"] = [
            "sliding_attention" if (i + 1) % _PATTERN else "full_attention"
            for i in range(d["num_hidden_layers"])
        ]
    return out


def _olmo2_fields(config: Shape) -> dict[str, Any]:
    return {"attention_bias": config.attention_bias}


def _olmo3_fields(config: Shape) -> dict[str, Any]:
    """transformers 5 reads a flat `rope_theta` as the full-attention layers' base only (the sliding
    ones then get its default 5e5), so the base is written per layer type too."""
    layers = config.num_hidden_layers
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    return {
        "attention_bias": config.attention_bias,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types or ["full_attention"] * layers),
        "rope_parameters": {"full_attention": dict(rope), "sliding_attention": dict(rope)},
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
    own_layers=_OWN_LAYERS,
)

__all__ = ["OLMO2", "OLMO3"]
