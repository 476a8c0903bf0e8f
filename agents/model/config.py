"""The shape of a Qwen2 / Qwen3 decoder (agents/model/transformer.py) and the named shapes tests, benchmarks
and the CPU demo use. Field names are Hugging Face's config.json names, so a config reads from and
writes to a checkpoint directory (agents/model/checkpoint.py) as it is."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec
import torch

ModelType = Literal["qwen2", "qwen3"]


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of a Qwen2/Qwen3 decoder; field names are Hugging Face's config.json names.

    `attention_bias` is Qwen3's flag (bias on q/k/v/o); Qwen2 always has a q/k/v bias and no o bias.
    Token ids are only carried so that a saved config.json is complete; the model ignores them.
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
        if self.model_type not in ("qwen2", "qwen3"):
            raise ValueError(f"ModelConfig.model_type must be 'qwen2' or 'qwen3', got {self.model_type!r}")
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
        if self.model_type == "qwen2" and self.attention_bias:
            raise ValueError(
                "attention_bias is a qwen3 field; qwen2 always has a q/k/v bias and no o_proj bias"
            )

    # Which optional pieces this family has.
    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.model_type == "qwen3" and self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = (
            h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.qkv_bias + h * self.o_bias + 2 * d * self.qk_norm
        )
        per_layer = attn + 3 * h * self.intermediate_size + 2 * h
        body = self.num_hidden_layers * per_layer + h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return body + (embed if include_embedding else 0)

    # ---- Hugging Face config.json ----
    _ARCHITECTURES: ClassVar[dict[str, str]] = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict; unsupported features raise a clear error."""
        model_type = d.get("model_type")
        if model_type not in cls._ARCHITECTURES:
            raise ValueError(f"config.json model_type must be 'qwen2' or 'qwen3', got {model_type!r}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")  # fmt: skip
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"config.json is missing required fields: {missing}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {d['hidden_act']!r}")
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"only the default RoPE is supported, got rope_type={rope_type!r}")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        if isinstance(eos, list):  # HF allows a list; the first is the canonical one
            eos = eos[0] if eos else None
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10_000.0))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            model_type=model_type,
            attention_bias=bool(d.get("attention_bias", False)) if model_type == "qwen3" else False,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
        )

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """A config.json dict that transformers and vLLM load as Qwen2ForCausalLM/Qwen3ForCausalLM."""
        d: dict[str, Any] = {
            "architectures": [self._ARCHITECTURES[self.model_type]],
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
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        if self.model_type == "qwen3":
            d["attention_bias"] = self.attention_bias
        return d

    # ---- named configs ----
    @classmethod
    def named(cls, name: str) -> ModelConfig:
        """A named config: 'tiny' (CPU default), 'bench-3m', 'small-25m', 'test', 'test-qwen3',
        'qwen2.5-0.5b', 'qwen3-0.6b', 'qwen3-1.7b', 'qwen3-4b', 'qwen3-8b' (the real shapes, random
        weights)."""
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
}  # fmt: skip
