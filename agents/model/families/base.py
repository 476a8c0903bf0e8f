"""What a model family declares (`Family`): the pieces of a Llama-style decoder it has, its RoPE,
and the config.json fields that are its own. agents/model/config.py reads and writes config.json
through it and agents/model/transformer.py builds the decoder from it; neither branches on a
model_type.

Every native family shares the decoder's blocks and Hugging Face's weight names (RMSNorm pre-norm,
GQA attention, SwiGLU MLP; `model.layers.{i}.self_attn.q_proj.weight`, ...), so a family only says
which optional tensors exist: biases (`bias`), a per-head q/k RMSNorm (`qk_norm`: `q_norm`,
`k_norm`), which layers rotate q/k (`no_rope_layers`), which attend over a sliding window
(`sliding_window`, `layer_types`), and Gemma-style blocks (norm scale, sandwich norms, scaled
embeddings, GELU MLP, a second RoPE base, `pre_feedforward_layernorm` / `post_feedforward_layernorm`),
OLMo-style blocks (norms after attention and MLP instead of before: `norm_placement`; q/k norms over
the whole projection: `qk_norm_over`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

# Each RMSNorm's scale: "weight" (x * w, Llama's) or "one_plus_weight" (x * (1 + w), all in float32:
# Gemma's, whose weights start at 0).
NormScale = Literal["weight", "one_plus_weight"]
# The MLP's gate activation (HF's hidden_act / hidden_activation names).
Activation = Literal["silu", "gelu_pytorch_tanh"]
# Where a block's norms sit: "pre" (x + attn(input_layernorm(x)), Llama's) or "post" (no input
# norm: x + post_attention_layernorm(attn(x)), then x + post_feedforward_layernorm(mlp(x)): OLMo 2/3).
NormPlacement = Literal["pre", "post"]
# What q_norm / k_norm normalise: "head" (each head's head_dim: Qwen3, Gemma 3) or "projection"
# (the whole q / k projection, num_heads * head_dim, before it is split into heads: OLMo 2/3).
QkNormOver = Literal["head", "projection"]

# A mixture of experts' block: "qwen3_moe" (a bias-free router whose softmax's top k are kept,
# SwiGLU experts) or "gpt_oss" (a router with a bias, the softmax over its top-k logits, experts
# with biases and gpt-oss's clamped SwiGLU): agents/model/moe.py.
MoeStyle = Literal["qwen3_moe", "gpt_oss"]

# Where the attention projections have a bias:
# "qkv": always on q/k/v, never on o (Qwen2); "flag": on q/k/v/o when config.json's
# attention_bias is true (Qwen3, Llama, SmolLM3); "none": never (Mistral).
BiasRule = Literal["qkv", "flag", "none"]


def full_every(num_layers: int, every: int, other: str) -> list[str]:
    """HF's `layer_types` where a config.json gives only a period: every `every`-th layer
    "full_attention", the others `other` ("sliding_attention", "linear_attention")."""
    return [other if (i + 1) % every else "full_attention" for i in range(num_layers)]


class HfRopeScaling(Protocol):
    """A RoPE scaling of the config (agents/model/config.py's `RopeScaling`, `YarnScaling`)."""

    def to_hf_dict(self) -> dict[str, Any]: ...


class Shape(Protocol):
    """The part of a ModelConfig a family's config.json writer reads."""

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def rope_theta(self) -> float: ...

    @property
    def attention_bias(self) -> bool: ...

    @property
    def sliding_window(self) -> int | None: ...

    @property
    def no_rope_layers(self) -> tuple[int, ...] | None: ...

    @property
    def layer_types(self) -> tuple[str, ...] | None: ...

    @property
    def rope_scaling(self) -> HfRopeScaling | None: ...

    @property
    def rope_local_base_freq(self) -> float | None: ...

    @property
    def query_pre_attn_scalar(self) -> float | None: ...

    def linear_fields(self) -> dict[str, Any]: ...

    def moe_fields(self) -> dict[str, Any]: ...


def _no_fields(config: Shape) -> dict[str, Any]:
    return {}


def _as_is(d: dict[str, Any]) -> dict[str, Any]:
    return d


@dataclass(frozen=True)
class Family:
    """One native family. model_type / architecture: HF's names (config.json's `model_type`, the
    `architectures` entry transformers and vLLM load). bias: `BiasRule`. qk_norm: an RMSNorm over
    each head's q and k before RoPE. rope_types: the RoPE variants config.json may ask for
    ("default", "llama3", "yarn"). sliding_window: config.json's `sliding_window` is read, the window of
    the windowed layers (`ModelConfig.layer_window`); otherwise `use_sliding_window: true` is
    refused. no_rope_layers: config.json's
    `no_rope_layers` (1 = the layer rotates, 0 = it does not) is read, default one layer in
    `no_rope_layer_interval` (4) without. layer_types: config.json's `layer_types` (which layers
    use the sliding window, "sliding_attention", and which attend over the full context) is read;
    without it a sliding_window windows every layer. hf_fields: the family's own config.json
    entries, written after the shared ones. norm_placement: `NormPlacement`; qk_norm_over:
    `QkNormOver` (with qk_norm). local_rope: the sliding-window layers' own default RoPE base
    (`rope_local_base_freq`), True required (Gemma 3), "optional" (OLMo 3: where its layer types'
    RoPE differ). moe: config.json's mixture-of-experts fields are read (`num_experts`, ...: the
    layers `ModelConfig.layer_moe` names have agents/model/moe.py's sparse MLP), of `moe_style`.
    attention_sinks: each attention layer has a learned sink logit per head (`self_attn.sinks`,
    gpt-oss: agents/model/attention.py `attention_with_sinks`). linear_attention: config.json's
    `layer_types` may name "linear_attention" layers, Gated DeltaNet mixers
    (agents/model/linear_attention.py) of its `linear_*` fields, and its `partial_rotary_factor`
    rotates the first part of each head only (Qwen3.5). attention_output_gate: q_proj also gives a
    gate per head, the attention output times its sigmoid (Qwen3.5). multimodal: (the model_type
    of a multimodal checkpoint whose `text_config` is this family, the prefix its text weights
    carry): such a checkpoint reads as its text model, its vision tower and other heads unread."""

    model_type: str
    architecture: str
    bias: BiasRule
    qk_norm: bool = False
    rope_types: tuple[str, ...] = ("default",)
    sliding_window: bool = False
    no_rope_layers: bool = False
    layer_types: bool = False
    hf_fields: Callable[[Shape], dict[str, Any]] = _no_fields
    hf_in: Callable[[dict[str, Any]], dict[str, Any]] = _as_is
    norm_scale: NormScale = "weight"
    sandwich_norms: bool = False
    embed_scale: bool = False
    hidden_act: Activation = "silu"
    local_rope: bool | Literal["optional"] = False
    query_pre_attn_scalar: bool = False
    own_layers: str | None = None
    norm_placement: NormPlacement = "pre"
    qk_norm_over: QkNormOver = "head"
    moe: bool = False
    moe_style: MoeStyle = "qwen3_moe"
    attention_sinks: bool = False
    linear_attention: bool = False
    attention_output_gate: bool = False
    multimodal: tuple[str, str] | None = None


__all__ = [
    "Activation",
    "BiasRule",
    "Family",
    "HfRopeScaling",
    "MoeStyle",
    "NormPlacement",
    "NormScale",
    "QkNormOver",
    "Shape",
    "full_every",
]
