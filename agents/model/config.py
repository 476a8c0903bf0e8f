"""The shape of a decoder of one of the native families (agents/model/families/: Qwen2, Qwen3, ...)
and the named shapes tests, benchmarks and the CPU demo use. Field names are Hugging Face's
config.json names, so a config reads from and writes to a checkpoint directory
(agents/model/checkpoint.py) as it is; what differs between families is declared by the family
(`ModelConfig.family`), never branched on here."""

from __future__ import annotations

import math
from typing import Any, Literal, cast

import msgspec
import torch

from .families import FAMILIES, Family, family

ModelType = Literal[
    "qwen2", "qwen3", "qwen3_moe", "llama", "mistral", "smollm3", "gemma3_text", "olmo2", "olmo3", "gpt_oss",
    "qwen3_5_text",
]  # fmt: skip
# HF's config.json `layer_types` entries this decoder runs.
LAYER_TYPES = ("sliding_attention", "full_attention", "linear_attention")
# The fields of a family's Gated DeltaNet layers (`Family.linear_attention`), 0 in every other.
LINEAR_FIELDS = (
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim",
)  # fmt: skip


class RopeScaling(msgspec.Struct, frozen=True, kw_only=True):
    """Llama 3.1's `llama3` RoPE frequency scaling (HF's rope_type "llama3"): wavelengths longer
    than original_max_position_embeddings / low_freq_factor are divided by `factor`, those shorter
    than original_max_position_embeddings / high_freq_factor kept, those between interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def to_hf_dict(self) -> dict[str, Any]:
        return {"rope_type": "llama3", **msgspec.structs.asdict(self)}


class YarnScaling(msgspec.Struct, frozen=True, kw_only=True):
    """YaRN (HF's rope_type "yarn", `_compute_yarn_parameters`): each inverse frequency a blend of
    the original one (extrapolation) and the one divided by `factor` (interpolation), by a linear
    ramp over the frequency dimensions between the ones that turn beta_fast and beta_slow times
    over original_max_position_embeddings (the ramp's ends floored / ceiled with `truncate`); cos
    and sin are multiplied by `attention_factor`, by default 0.1 * ln(factor) + 1 (or, with
    `mscale` and `mscale_all_dim`, the ratio of that formula with each; 1 where factor <= 1).
    None: absent from config.json (written back absent)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    def __post_init__(self) -> None:
        if not self.factor > 0 or self.original_max_position_embeddings < 1:
            raise ValueError(
                f"yarn: factor must be > 0 and original_max_position_embeddings >= 1, got "
                f"{self.factor}, {self.original_max_position_embeddings}"
            )

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by (transformers' `attention_factor`)."""
        if self.attention_factor is not None:
            return self.attention_factor

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    def to_hf_dict(self) -> dict[str, Any]:
        fields = {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}
        return {"rope_type": "yarn", **fields}

    @classmethod
    def from_hf_dict(cls, rope: dict[str, Any], max_position_embeddings: int) -> YarnScaling:
        """From a config.json's yarn `rope_parameters` / `rope_scaling`, with transformers'
        defaults: original_max_position_embeddings the model's max_position_embeddings, a null
        factor their ratio."""
        original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
        factor = rope.get("factor")
        optional = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
        return cls(
            factor=float(max_position_embeddings / original if factor is None else factor),
            original_max_position_embeddings=original,
            **{k: float(rope[k]) for k in optional if rope.get(k) is not None},
            truncate=None if rope.get("truncate") is None else bool(rope["truncate"]),
        )


def rope_scaling_from_dict(d: dict[str, Any]) -> RopeScaling | YarnScaling:
    """A TOML/JSON table (`rope_type` "llama3", the default, or "yarn") as its struct."""
    fields = {k: v for k, v in d.items() if k not in ("rope_type", "type")}
    if d.get("rope_type", d.get("type", "llama3")) == "yarn":
        return YarnScaling(**fields)
    return RopeScaling(**fields)


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of a decoder of a native family; field names are Hugging Face's config.json names.

    `attention_bias` is the flag of the families whose `bias` rule is "flag" (Qwen3, Llama,
    SmolLM3, OLMo 2/3: a bias on q/k/v/o); Qwen2 always has a q/k/v bias and no o bias, Mistral none.
    `rope_scaling`: Llama 3.1's (llama only) or YaRN (Qwen2/3, Llama, Mistral, OLMo 3), on the
    layers that rotate with `rope_theta`; `rope_local_base_freq`: the base of the sliding-window
    layers' own default RoPE (Gemma 3's; OLMo 3's where its layer types differ). `sliding_window`: the window of the windowed layers
    (`layer_window`); `layer_types`: HF's per-layer "sliding_attention" / "full_attention" (None
    with a sliding_window: every layer windowed, Mistral's). `no_rope_layers`:
    SmolLM3's, per layer 1 = RoPE, 0 = none (None: every layer rotates).
    Mixture of experts (Qwen3-MoE; `num_experts` > 0, families whose module says `moe`): each
    layer `layer_moe` names routes every token to its `num_experts_per_tok` most likely experts
    (agents/model/moe.py), each a SwiGLU of `moe_intermediate_size`; the chosen probabilities are
    renormalised with `norm_topk_prob`. The other layers (`mlp_only_layers`, and all but every
    `decoder_sparse_step`-th) have the dense MLP of `intermediate_size`. gpt-oss's experts
    (`family.moe_style` "gpt_oss"): every layer, the softmax over the top-k router logits, and
    its clamped SwiGLU with `swiglu_alpha` and `swiglu_limit` (None for every other family).
    Linear attention (Qwen3.5; `family.linear_attention`): the "linear_attention" layers of
    `layer_types` are Gated DeltaNet mixers (agents/model/linear_attention.py) of `linear_*` heads
    and dims and a `linear_conv_kernel_dim`-tap convolution; `partial_rotary_factor` of each head
    rotates (`rotary_dim`), the rest passes.
    Token ids are only carried so that a saved config.json is complete, except `pad_token_id`: as
    in transformers, the embedding's padding_idx (its row gets no gradient from lookups).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    model_type: ModelType = "qwen2"
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    rope_scaling: RopeScaling | YarnScaling | None = None
    sliding_window: int | None = None
    no_rope_layers: tuple[int, ...] | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        fam = family(self.model_type)
        # From a TOML/JSON override: a table and a list, as the struct and tuple they stand for.
        if isinstance(self.rope_scaling, dict):
            msgspec.structs.force_setattr(self, "rope_scaling", rope_scaling_from_dict(self.rope_scaling))
        if isinstance(self.no_rope_layers, list):
            msgspec.structs.force_setattr(self, "no_rope_layers", tuple(self.no_rope_layers))
        if isinstance(self.layer_types, list):
            msgspec.structs.force_setattr(self, "layer_types", tuple(self.layer_types))
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id={self.pad_token_id} is not a token of vocab_size={self.vocab_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError(
                f"rope_theta and rms_norm_eps must be > 0, got {self.rope_theta}, {self.rms_norm_eps}"
            )
        if self.attention_bias and fam.bias != "flag":
            raise ValueError(
                f"attention_bias is not a {self.model_type} field: "
                + (
                    "qwen2 always has a q/k/v bias and no o_proj bias"
                    if fam.bias == "qkv"
                    else "it has no biases"
                )
            )
        if self.rope_scaling is not None:
            kind = "yarn" if isinstance(self.rope_scaling, YarnScaling) else "llama3"
            if kind not in fam.rope_types:
                raise ValueError(f"rope_scaling ({kind}) is not a {self.model_type} field")
        if self.sliding_window is not None and not (fam.sliding_window and self.sliding_window >= 1):
            raise ValueError(
                f"sliding_window={self.sliding_window!r}: a positive window is a field of "
                f"{[t for t, f in FAMILIES.items() if f.sliding_window]} only"
            )
        if isinstance(self.mlp_only_layers, list):
            msgspec.structs.force_setattr(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.num_experts:
            if not fam.moe:
                raise ValueError(f"num_experts (a mixture of experts) is not a {self.model_type} field")
            if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
                raise ValueError(
                    f"a mixture of experts needs 1 <= num_experts_per_tok <= num_experts ({self.num_experts}) "
                    f"and moe_intermediate_size >= 1, got {self.num_experts_per_tok}, {self.moe_intermediate_size}"
                )
            if self.decoder_sparse_step < 1 or any(not 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
                raise ValueError(
                    f"decoder_sparse_step must be >= 1 and mlp_only_layers layers 0..{self.num_hidden_layers - 1}, "
                    f"got {self.decoder_sparse_step}, {list(self.mlp_only_layers)}"
                )
        elif fam.moe:
            raise ValueError(f"{self.model_type} needs num_experts >= 1")
        clamped = (self.swiglu_alpha, self.swiglu_limit)
        if fam.moe_style == "gpt_oss":
            if not all(isinstance(x, int | float) and x > 0 for x in clamped):
                raise ValueError(f"{self.model_type} needs swiglu_alpha and swiglu_limit > 0, got {clamped}")
            if self.moe_intermediate_size != self.intermediate_size:  # config.json has one width
                raise ValueError(
                    f"{self.model_type}'s experts are its intermediate_size ({self.intermediate_size}): "
                    f"moe_intermediate_size must equal it, got {self.moe_intermediate_size}"
                )
        elif clamped != (None, None):
            raise ValueError(f"swiglu_alpha and swiglu_limit are not {self.model_type} fields")
        if self.layer_types is not None:
            if not fam.layer_types:
                raise ValueError(f"layer_types is not a {self.model_type} field")
            if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(
                    f"layer_types must be one of {list(LAYER_TYPES)} per layer ({self.num_hidden_layers}), "
                    f"got {list(self.layer_types)}"
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
            if "linear_attention" in self.layer_types and not fam.linear_attention:
                raise ValueError(f"layer_types: linear_attention layers are not a {self.model_type} field")
        linear = [getattr(self, name) for name in LINEAR_FIELDS]
        if fam.linear_attention:
            if not all(isinstance(x, int) and x >= 1 for x in linear):
                raise ValueError(f"{self.model_type} needs {', '.join(LINEAR_FIELDS)} >= 1, got {linear}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(
                    f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                    f"linear_num_key_heads ({self.linear_num_key_heads})"
                )
        elif any(linear):
            raise ValueError(f"{', '.join(LINEAR_FIELDS)} are not {self.model_type} fields")
        if self.partial_rotary_factor != 1.0:
            if not fam.linear_attention:
                raise ValueError(f"partial_rotary_factor is not a {self.model_type} field")
            if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim < 2:
                raise ValueError(
                    f"partial_rotary_factor={self.partial_rotary_factor} must rotate an even part of "
                    f"head_dim {self.head_dim}, got {self.rotary_dim} dims"
                )
        if (self.rope_local_base_freq is not None) != bool(fam.local_rope) and fam.local_rope != "optional":
            raise ValueError(
                f"rope_local_base_freq is {'required for' if fam.local_rope else 'not a field of'} {self.model_type}"
            )
        if self.rope_local_base_freq is not None and not self.rope_local_base_freq > 0:
            raise ValueError(f"rope_local_base_freq must be > 0, got {self.rope_local_base_freq}")
        if self.query_pre_attn_scalar is not None and not (
            fam.query_pre_attn_scalar and self.query_pre_attn_scalar > 0
        ):
            raise ValueError(
                f"query_pre_attn_scalar={self.query_pre_attn_scalar!r}: a positive value is a field of "
                f"{[t for t, f in FAMILIES.items() if f.query_pre_attn_scalar]} only"
            )
        if self.no_rope_layers is not None:
            if not fam.no_rope_layers:
                raise ValueError(f"no_rope_layers is not a {self.model_type} field")
            if len(self.no_rope_layers) != self.num_hidden_layers or set(self.no_rope_layers) - {0, 1}:
                raise ValueError(
                    f"no_rope_layers must be one 0 or 1 per layer ({self.num_hidden_layers}), "
                    f"got {list(self.no_rope_layers)}"
                )

    # What this family has, as its module declares (agents/model/families/).
    @property
    def family(self) -> Family:
        return family(self.model_type)

    @property
    def qkv_bias(self) -> bool:
        bias = self.family.bias
        return bias == "qkv" or (bias == "flag" and self.attention_bias)

    @property
    def o_bias(self) -> bool:
        return self.family.bias == "flag" and self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    def layer_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the mixture-of-experts MLP (transformers' rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def moe_fields(self) -> dict[str, Any]:
        """The mixture-of-experts fields of config.json ({} without experts)."""
        if not self.num_experts:
            return {}
        return {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            **({} if self.swiglu_alpha is None else {"swiglu_alpha": self.swiglu_alpha}),
            **({} if self.swiglu_limit is None else {"swiglu_limit": self.swiglu_limit}),
        }

    def layer_linear(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a Gated DeltaNet mixer (a "linear_attention" layer)."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def linear_attention(self) -> bool:
        """Whether any layer is a Gated DeltaNet mixer (a recurrent state, not k/v)."""
        return any(self.layer_linear(i) for i in range(self.num_hidden_layers))

    @property
    def linear_key_dim(self) -> int:
        """A Gated DeltaNet layer's q (and k) width: its key heads x their dim."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        """A Gated DeltaNet layer's v width: its value heads x their dim."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """The channels of a Gated DeltaNet layer's convolution (q, k and v)."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims RoPE rotates (the first ones; head_dim unless partial)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def linear_fields(self) -> dict[str, Any]:
        """The Gated DeltaNet fields of config.json and partial_rotary_factor ({} without them)."""
        if not self.family.linear_attention:
            return {}
        return {name: getattr(self, name) for name in LINEAR_FIELDS} | {
            "partial_rotary_factor": self.partial_rotary_factor
        }

    def layer_rope(self, layer: int) -> bool:
        """Whether decoder layer `layer` rotates q/k (SmolLM3's no_rope_layers say; else all do)."""
        return self.no_rope_layers is None or bool(self.no_rope_layers[layer])

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: it attends over the full context).
        A query at position p sees the keys at positions p - window + 1 .. p (transformers'
        `kv_idx > q_idx - sliding_window`). `sliding_window` with no `layer_types` windows every
        layer (Mistral); with them, only the "sliding_attention" layers."""
        window = self.sliding_window
        if window is None or (
            self.layer_types is not None and self.layer_types[layer] != "sliding_attention"
        ):
            return None
        return window

    @property
    def windowed(self) -> bool:
        """Whether any layer attends over a sliding window."""
        return any(self.layer_window(i) is not None for i in range(self.num_hidden_layers))

    @property
    def torch_attention_only(self) -> str | None:
        """Why only torch's attention runs this model (vLLM's kernels here attend over the whole
        context and add no sink to the softmax), or None where any attention can."""
        if self.windowed:
            return f"sliding-window layers (sliding_window={self.sliding_window})"
        if self.family.attention_sinks:
            return "attention sinks"
        if self.linear_attention:
            return "Gated DeltaNet layers (a recurrent state the torch attention keeps)"
        return None

    def layer_rope_local(self, layer: int) -> bool:
        """Whether layer `layer` rotates with the local RoPE base (`rope_local_base_freq`: Gemma 3's
        sliding-window layers, OLMo 3's where they differ) rather than `rope_theta` and `rope_scaling`."""
        types = self.layer_types
        return (
            self.rope_local_base_freq is not None
            and types is not None
            and types[layer] == "sliding_attention"
        )

    @property
    def rope_in_every_layer(self) -> bool:
        return self.no_rope_layers is None or all(self.no_rope_layers)

    @property
    def query_scale(self) -> float:
        """What q is multiplied by before attention's 1/sqrt(head_dim), so that scores are scaled
        by query_pre_attn_scalar**-0.5 (Gemma) instead: 1.0 without one."""
        if self.query_pre_attn_scalar is None:
            return 1.0
        return (self.head_dim / self.query_pre_attn_scalar) ** 0.5

    @property
    def own_layers(self) -> str | None:
        """Why only the model's own decoder layers can run this model (the engine's packed and
        fused layers are the Llama-style block, RoPE in every layer), or None where they can."""
        if self.family.own_layers is not None:
            return self.family.own_layers
        if not self.rope_in_every_layer:
            return "layers without RoPE (no_rope_layers)"
        return None

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        qk_norm = (q + kv if self.family.qk_norm_over == "projection" else 2 * d) * self.qk_norm
        gate = q * (h + self.qkv_bias) * self.family.attention_output_gate  # q_proj's second half
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.qkv_bias + h * self.o_bias + qk_norm + gate
        attn += self.num_attention_heads * self.family.attention_sinks
        # A Gated DeltaNet layer: in_proj_qkv and its convolution, in_proj_z, in_proj_b and in_proj_a
        # with dt_bias and A_log, the gated norm, out_proj.
        values = self.linear_value_dim
        mixer = self.linear_conv_dim * (h + self.linear_conv_kernel_dim) + values * h
        mixer += 2 * self.linear_num_value_heads * (h + 1) + self.linear_value_head_dim + values * h
        norms = (4 if self.family.sandwich_norms else 2) * h
        mixers = sum(mixer if self.layer_linear(i) else attn for i in range(self.num_hidden_layers))
        moe = self.num_experts * (h + 3 * h * self.moe_intermediate_size)  # the router, the experts
        if self.family.moe_style == "gpt_oss":  # the router's bias, the experts' biases
            moe += self.num_experts * (1 + 2 * self.moe_intermediate_size + h)
        mlps = sum(moe if self.layer_moe(i) else 3 * h * self.intermediate_size for i in range(self.num_hidden_layers))
        body = mixers + self.num_hidden_layers * norms + mlps + h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return body + (embed if include_embedding else 0)

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict; unsupported features raise a clear error."""
        model_type = d.get("model_type")
        fam = family(model_type)
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")  # fmt: skip
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"config.json is missing required fields: {missing}")
        d = fam.hf_in(d)
        if d.get("hidden_act", "silu") != fam.hidden_act:
            raise ValueError(
                f"{model_type}: only hidden_act={fam.hidden_act!r} is supported, got {d['hidden_act']!r}"
            )
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=true (a bias on the MLP's linears) is not supported")
        if d.get("use_sliding_window"):
            raise ValueError(
                f"sliding-window attention (use_sliding_window=true) is not supported for {model_type}"
            )
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in fam.rope_types:
            raise ValueError(
                f"{model_type}: RoPE rope_type={rope_type!r} is not supported (supported: {list(fam.rope_types)})"
            )
        scaling: RopeScaling | YarnScaling | None = None
        if rope_type == "yarn":
            scaling = YarnScaling.from_hf_dict(rope, d.get("max_position_embeddings", 32768))
        elif rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        num_layers = d["num_hidden_layers"]
        no_rope = None
        if fam.no_rope_layers:
            no_rope = d.get("no_rope_layers")
            if no_rope is None:  # HF's default: every `no_rope_layer_interval`-th layer without
                interval = d.get("no_rope_layer_interval", 4)
                no_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
            no_rope = tuple(int(x) for x in no_rope)
        heads = d["num_attention_heads"]
        clamped: dict[str, Any] = {}  # gpt-oss's SwiGLU
        if fam.moe_style == "gpt_oss":
            clamped = {"swiglu_alpha": float(d["swiglu_alpha"]), "swiglu_limit": float(d["swiglu_limit"])}
        partial = float(rope.get("partial_rotary_factor", 1.0)) if fam.linear_attention else 1.0
        linear: dict[str, Any] = {name: int(d[name]) for name in LINEAR_FIELDS} if fam.linear_attention else {}
        eos = d.get("eos_token_id")
        if isinstance(eos, list):  # HF allows a list; the first is the canonical one
            eos = eos[0] if eos else None
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10_000.0))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            model_type=cast(ModelType, fam.model_type),
            attention_bias=bool(d.get("attention_bias", False)) if fam.bias == "flag" else False,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
            rope_scaling=scaling,
            sliding_window=d.get("sliding_window") if fam.sliding_window else None,
            no_rope_layers=no_rope,
            layer_types=tuple(d["layer_types"]) if fam.layer_types and d.get("layer_types") else None,
            rope_local_base_freq=(
                float(d["rope_local_base_freq"])
                if fam.local_rope and d.get("rope_local_base_freq") is not None
                else None
            ),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar") if fam.query_pre_attn_scalar else None,
            **(
                {
                    "num_experts": int(d["num_experts"]),
                    "num_experts_per_tok": int(d["num_experts_per_tok"]),
                    "moe_intermediate_size": int(d["moe_intermediate_size"]),
                    "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
                    "decoder_sparse_step": int(d.get("decoder_sparse_step", 1)),
                    "mlp_only_layers": tuple(int(i) for i in d.get("mlp_only_layers") or ()),
                }
                if fam.moe
                else {}
            ),
            **clamped,
            **linear,
            partial_rotary_factor=partial,
        )

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """A config.json dict that transformers and vLLM load as the family's architecture
        (Qwen2ForCausalLM, Qwen3ForCausalLM, ...)."""
        fam = self.family
        d: dict[str, Any] = {
            "architectures": [fam.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf_dict(),
            "tie_word_embeddings": self.tie_word_embeddings,
            **fam.hf_fields(self),
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        return d

    # ---- named configs ----
    @classmethod
    def named(cls, name: str) -> ModelConfig:
        """A named config: 'tiny' (CPU default), 'tiny-moe', 'tiny-gpt-oss', 'bench-3m', 'small-25m',
        'test', 'test-qwen3', 'test-gemma3', 'test-gpt-oss', 'qwen2.5-0.5b', 'qwen3-0.6b', 'qwen3-1.7b',
        'qwen3-4b', 'qwen3-8b', 'llama-3.2-1b', 'mistral-7b-v0.3', 'smollm3-3b', 'gemma-3-1b', 'olmo-3-7b',
        'gpt-oss-20b', 'qwen3.5-9b' (the real shapes, random weights), 'test-qwen3.5', 'tiny-qwen3.5'."""
        if name not in NAMED_CONFIGS:
            raise KeyError(f"unknown model config {name!r}; known: {sorted(NAMED_CONFIGS)}")
        return cls(**NAMED_CONFIGS[name])


_SMALL = dict(vocab_size=1024, max_position_embeddings=2048, tie_word_embeddings=True, model_type="qwen2")
# What the published Qwen3 dense shapes share (0.6B-8B): vocabulary, RoPE, 8 KV heads of 128.
_QWEN3 = dict(vocab_size=151936, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
              max_position_embeddings=40960, tie_word_embeddings=True, model_type="qwen3",
              bos_token_id=151643, eos_token_id=151645)  # fmt: skip
NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    # ~3.2M params: the CPU default policy. Qwen3's attention (an RMSNorm over each head's q and k)
    # with 8 heads of 32 and RoPE theta 1e4: SFT teaches the CPU demo to copy the looked-up value
    # by step 200-500 for 8 of 8 model seeds, where the same shape without the q/k norm formed it
    # for 1 of 4 seeds in 1,500 steps on an AVX-512 CPU (bench/sft_copy.py sweeps, bench/RESULTS.md).
    "tiny": dict(_SMALL, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=32, rope_theta=10_000.0,
                 model_type="qwen3"),
    # tiny with Qwen3-MoE's MLPs (~10M params, ~3.2M active): 8 experts of 344 in every layer, 2 per
    # token, so a token's MLP is as wide as tiny's; the CPU demo's MoE run (docs/models.md).
    "tiny-moe": dict(_SMALL, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=32, rope_theta=10_000.0,
                     model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=344, norm_topk_prob=True),
    # tiny with gpt-oss's blocks (~10M params, ~3.2M active): q/k/v/o biases and attention sinks, no
    # q/k norm, windows of 128 on every other layer, 8 experts of 344 with biases, 2 per token.
    "tiny-gpt-oss": dict(_SMALL, hidden_size=256, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, rope_theta=10_000.0,
                         model_type="gpt_oss", tie_word_embeddings=True, attention_bias=True, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=344, norm_topk_prob=True,
                         sliding_window=128, layer_types=("sliding_attention", "full_attention") * 2,
                         swiglu_alpha=1.702, swiglu_limit=7.0),
    # tiny as Qwen3.5's hybrid (~3.3M params): Gated DeltaNet layers (4 key heads of 32 serving 8
    # value heads of 32) alternating with full-attention ones (gated, a quarter of each head
    # rotated); two of four linear where Qwen3.5 has three: with one attention layer (the last) the
    # CPU demo's SFT did not form the copy of the looked-up value in 1,000 steps (docs/models.md).
    "tiny-qwen3.5": dict(_SMALL, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, rope_theta=10_000.0,
                         model_type="qwen3_5_text", partial_rotary_factor=0.25,
                         layer_types=("linear_attention", "full_attention") * 2, linear_num_key_heads=4,
                         linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
                         linear_conv_kernel_dim=4),
    # The benchmarks' model (generate, vs_trl, train): tiny's first shape, pinned so tiny may change.
    "bench-3m": dict(_SMALL, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    # ~24.6M params, for trainer benchmarks.
    "small-25m": dict(_SMALL, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64),
    # Test-size models (fast on CPU; head_dim 32 is the smallest vLLM CPU accepts).
    "test": dict(_SMALL, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512),
    "test-qwen3": dict(_SMALL, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                       model_type="qwen3", tie_word_embeddings=False),
    # Gemma 3's blocks with a window of 4 on two of its three layers.
    "test-gemma3": dict(_SMALL, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                        model_type="gemma3_text", rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                        query_pre_attn_scalar=32, sliding_window=4,
                        layer_types=("sliding_attention", "full_attention", "sliding_attention")),
    # Qwen3-MoE's blocks: 4 experts of 32, 2 per token, the second layer dense.
    "test-qwen3-moe": dict(_SMALL, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                           model_type="qwen3_moe", tie_word_embeddings=False, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                           mlp_only_layers=(1,)),
    # Qwen3.5's hybrid: three Gated DeltaNet layers (2 key heads of 16 serving 4 value heads of 16)
    # then a full-attention layer (gated, a quarter of each head rotated).
    "test-qwen3.5": dict(_SMALL, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         model_type="qwen3_5_text", tie_word_embeddings=False, partial_rotary_factor=0.25,
                         layer_types=("linear_attention",) * 3 + ("full_attention",), linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_conv_kernel_dim=4),
    # Real shapes (random weights unless loaded), for GPU benchmarks.
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, head_dim=64, rope_theta=1_000_000.0,
                         max_position_embeddings=32768, tie_word_embeddings=True, model_type="qwen2",
                         bos_token_id=151643, eos_token_id=151645),
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16),
    # Larger Qwen3 shapes, for one-GPU memory and LoRA measurements (bench/gpu_rl_step.py).
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=False),
    # gpt-oss's blocks: 4 experts of 32, 2 per token, window-4 layers alternating with full ones.
    "test-gpt-oss": dict(_SMALL, vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         model_type="gpt_oss", tie_word_embeddings=False, attention_bias=True, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                         sliding_window=4, layer_types=("sliding_attention", "full_attention"),
                         swiglu_alpha=1.702, swiglu_limit=7.0),
    # gpt-oss-20b: 32 experts of 2880, 4 per token, in all 24 layers; windows of 128 on every other
    # layer, YaRN over a 4,096-token original context (random weights: the published ones are MXFP4).
    "gpt-oss-20b": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, rope_theta=150_000.0,
                        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                        model_type="gpt_oss", attention_bias=True, num_experts=32, num_experts_per_tok=4,
                        moe_intermediate_size=2880, norm_topk_prob=True, sliding_window=128,
                        layer_types=("sliding_attention", "full_attention") * 12, swiglu_alpha=1.702,
                        swiglu_limit=7.0, bos_token_id=199998, eos_token_id=200002, pad_token_id=199999,
                        rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=4096,
                                                 beta_fast=32.0, beta_slow=1.0, truncate=False)),
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token, in all 48 layers.
    "qwen3-30b-a3b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, model_type="qwen3_moe",
                          max_position_embeddings=40960, tie_word_embeddings=False, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    # Qwen3.5-9B's text model (Qwen3_5TextConfig's defaults): 24 Gated DeltaNet layers (16 key heads
    # serving 32 value heads, all of 128) and 8 full-attention ones (16 heads of 256, 4 KV).
    "qwen3.5-9b": dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256, rope_theta=10_000_000.0,
                       max_position_embeddings=32768, tie_word_embeddings=False, model_type="qwen3_5_text",
                       partial_rotary_factor=0.25,
                       layer_types=tuple("linear_attention" if (i + 1) % 4 else "full_attention" for i in range(32)),
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4),
    # The other native families' published shapes (random weights unless loaded).
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500_000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True,
                         model_type="llama", bos_token_id=128000, eos_token_id=128001,
                         rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=8192)),
    "mistral-7b-v0.3": dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
                            rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=False,
                            model_type="mistral", bos_token_id=1, eos_token_id=2),
    "smollm3-3b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128, rope_theta=5_000_000.0,
                       max_position_embeddings=65536, tie_word_embeddings=True, model_type="smollm3",
                       no_rope_layers=tuple(int((i + 1) % 4 != 0) for i in range(36))),
    # Gemma 3 1B (text): five sliding-window layers (512, RoPE base 1e4) to one global (1e6).
    "gemma-3-1b": dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, rope_theta=1_000_000.0,
                       rope_local_base_freq=10_000.0, query_pre_attn_scalar=256, sliding_window=512,
                       layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(26)),
                       max_position_embeddings=32768, tie_word_embeddings=True, model_type="gemma3_text",
                       bos_token_id=2, eos_token_id=1),
    # OLMo 3 7B (Olmo-3-1025-7B): norms after each sublayer, q/k norms over the whole projection,
    # three window-4096 layers to one full; its YaRN (x8 from 8192) on the full-attention layers,
    # default RoPE of the same base on the sliding ones.
    "olmo-3-7b": dict(vocab_size=100278, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, head_dim=128, rope_theta=500_000.0,
                      rope_scaling=YarnScaling(factor=8.0, original_max_position_embeddings=8192, beta_fast=32.0,
                                               beta_slow=1.0, attention_factor=1.2079441541679836),
                      rope_local_base_freq=500_000.0,
                      rms_norm_eps=1e-6, max_position_embeddings=65536, tie_word_embeddings=False,
                      model_type="olmo3", sliding_window=4096,
                      layer_types=tuple("sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(32)),
                      eos_token_id=100257, pad_token_id=100277),
}  # fmt: skip
