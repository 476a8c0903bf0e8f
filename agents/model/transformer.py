"""The decoder of every native family (Qwen2, Qwen3, Qwen3-MoE, Llama, Mistral, SmolLM3, Gemma 3 text,
OLMo 2/3, gpt-oss, Qwen3.5) in plain torch, read top to bottom (gpt-fast style).

GQA attention with RoPE, RMSNorm (pre-norm), SwiGLU MLP or a mixture of experts (Qwen3-MoE's,
gpt-oss's: agents/model/moe.py), tied or untied embeddings, gpt-oss's attention sinks. What a family
adds is declared by its module (agents/model/families/) and read through the `ModelConfig`
(agents/model/config.py, with the named shapes): biases (Qwen2: q/k/v; Qwen3, Llama, SmolLM3: q/k/v/o
with `attention_bias`), an RMSNorm over each head of q and k before RoPE (Qwen3), Llama 3.1's
RoPE scaling and YaRN, layers without RoPE (SmolLM3), sliding-window layers (`ModelConfig.layer_window`:
Mistral's on every layer, Gemma 3's per `layer_types`), Gemma 3's blocks (its RMSNorm, four norms
per block, scaled embeddings and queries, GELU-tanh MLP, a second RoPE base for its sliding layers),
OLMo 2/3's blocks (norms after attention and MLP, q/k norms over the whole projection), Qwen3.5's
hybrid (Gated DeltaNet layers, agents/model/linear_attention.py, between full-attention layers
whose output is gated per head and whose RoPE rotates part of each head; training forwards only:
the torch engine keeps no recurrent state yet).

Module names and `state_dict()` keys are exactly Hugging Face's (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `model.norm.weight`, `lm_head.weight`), so HF
checkpoints load without renaming and trained weights export directly. With tied embeddings
`lm_head.weight` IS `model.embed_tokens.weight` (one Parameter).

Two ways in:
- training: `model(input_ids [B, T]) -> logits [B, T, V]`, causal (right padding is harmless).
  Every decoder block is called as a module, so `fully_shard` on each `model.model.layers[i]` and
  on the root works (FSDP2).
- inference: `model.model(input_ids, positions, cache=..., rope=...)` returns hidden states; the
  `cache` (the engine's `ForwardBatch`, agents/model/forward.py) stores each layer's k/v and
  attends (`cache.attend`). A prefill
  passes `keep=` (each row's last prompt position): only those hidden states feed the sampler, so
  the last layer computes its query, attention and MLP there alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import causal_attention
from .config import ModelConfig, RopeScaling, YarnScaling
from .families.base import NormScale
from .linear_attention import GatedDeltaNet
from .moe import GptOssMoE, SparseMoE

# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen2RMSNorm: normalise in float32, cast back, then scale (same rounding as HF)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Gemma3RMSNorm: normalise and scale by (1 + weight) all in float32, then cast back."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(x)


@functools.cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (as transformers casts Gemma's embedding scale)."""
    return float(torch.tensor(value, dtype=dtype))


class RMSNorm(nn.Module):
    """`rms_norm` (or, scale "one_plus_weight", `gemma_rms_norm`) with its weight as a Parameter."""

    def __init__(self, dim: int, eps: float, scale: NormScale = "weight") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale == "one_plus_weight":
            return gemma_rms_norm(x, self.weight, self.variance_epsilon)
        return rms_norm(x, self.weight, self.variance_epsilon)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency scaling of RoPE's inverse frequencies (HF's `_compute_llama3_parameters`,
    the same operations): long wavelengths divided by `factor`, short ones kept, those between
    interpolated."""
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)


def yarn_inv_freq(inv_freq: torch.Tensor, theta: float, head_dim: int, scaling: YarnScaling) -> torch.Tensor:
    """YaRN's inverse frequencies (HF's `_compute_yarn_parameters`, the same operations): the
    original ones (extrapolation) on the dimensions that turn more than beta_fast times over
    original_max_position_embeddings, those divided by `factor` (interpolation) on the ones that
    turn fewer than beta_slow times, a linear ramp between."""
    beta_fast, beta_slow = scaling.beta_fast or 32, scaling.beta_slow or 1
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.truncate is None or scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp.to(inv_freq.device)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=inv_freq.device).float() / head_dim)
    interpolated = 1.0 / (scaling.factor * pos_freqs)
    return interpolated * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: RopeScaling | YarnScaling | None = None,
):
    """cos and sign-folded sin for `positions` (any shape) -> each [*positions.shape, head_dim].
    scaling (`ModelConfig.rope_scaling`): Llama 3.1's, applied to the inverse frequencies, or
    YaRN's, applied to them and, as its attention factor, to cos and sin (in float32, before the
    cast to `dtype`, as transformers does).

    HF rotates with rotate_half(x) = cat(-x2, x1); we use roll(x, D/2) * sign instead, and fold
    the sign into sin, so `apply_rope` is 4 ops and bit-identical to HF's.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    attention_scaling = 1.0
    if isinstance(scaling, YarnScaling):
        inv_freq = yarn_inv_freq(inv_freq, theta, head_dim, scaling)
        attention_scaling = scaling.attention_scaling
    elif scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    sin = torch.cat((-sin[..., : head_dim // 2], sin[..., head_dim // 2 :]), dim=-1)
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D]; cos/sin [B or 1, T, 1, R] (sin already carries rotate_half's sign):
    the first R dims rotate (R < D: partial RoPE, Qwen3.5), the rest pass."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        head, rest = x[..., :rotary], x[..., rotary:]
        return torch.cat([apply_rope(head, cos, sin), rest], dim=-1)
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def cast_once_for_autocast(x: torch.Tensor) -> torch.Tensor:
    """x cast to the autocast dtype when autocast is on (else x): for an activation that several
    linears read (q/k/v, gate/up), so it is cast once instead of once per linear. In the
    vs_trl.py training step that is 12 fewer float32 -> bf16 copies of [2414, 256] per forward,
    and fewer float32 conversions and sums of its gradient in backward: its three (or two)
    gradients are summed in bf16, as with bf16 parameters (FSDP2's mixed precision)."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.dtype != torch.get_autocast_dtype(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


class AttentionCache(Protocol):
    """What an inference forward's `cache=` provides (the engine's `ForwardBatch`,
    agents/model/forward.py; the trainer's shared-prefix attention): store k/v for `layer`, attend."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [B, H, T, D], k/v [B, Hkv, T, D] (new tokens, RoPE applied) -> [B, H, T, D]; sinks [H]
        (a family with attention sinks; passed only then): agents/model/attention.py's."""
        ...


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        # Qwen3.5: q_proj gives each head its query, then a gate on its output (`gated`).
        self.gated = cfg.family.attention_output_gate
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim * (2 if self.gated else 1), bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.rope = cfg.layer_rope(layer_idx)  # SmolLM3's no_rope_layers: some layers do not rotate
        self.window = cfg.layer_window(layer_idx)  # a sliding window (the cache knows its own)
        self.query_scale = cfg.query_scale  # Gemma: scores scaled by query_pre_attn_scalar**-0.5
        # Qwen3, Gemma 3: an RMSNorm over each head's q and k, before RoPE; OLMo ("projection"):
        # over the whole q and k projections, before they are split into heads.
        self.qk_norm_over = cfg.family.qk_norm_over if cfg.qk_norm else None
        if cfg.qk_norm:
            whole = self.qk_norm_over == "projection"
            self.q_norm = RMSNorm(q_dim if whole else cfg.head_dim, cfg.rms_norm_eps, cfg.family.norm_scale)
            self.k_norm = RMSNorm(kv_dim if whole else cfg.head_dim, cfg.rms_norm_eps, cfg.family.norm_scale)
        # gpt-oss: a learned sink logit per head joins each query's softmax.
        self.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads)) if cfg.family.attention_sinks else None

    def forward(
        self, x: torch.Tensor, cos, sin, cache: AttentionCache | None = None, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        k = self.k_proj(x)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        q_cos, q_sin = cos, sin
        if keep is None:
            q = self.q_proj(x)
        else:  # only the query at position keep[b] of each row (every position still gives k/v)
            rows = torch.arange(B, device=x.device)
            q = self.q_proj(x[rows, keep][:, None])
            q_cos = cos.expand(B, -1, -1, -1)[rows, keep][:, None]
            q_sin = sin.expand(B, -1, -1, -1)[rows, keep][:, None]
        gate = None
        if self.gated:  # per head: its query, then its gate
            q, gate = q.view(B, q.shape[1], -1, 2 * self.head_dim).split(self.head_dim, dim=-1)
            q, gate = q.reshape(B, q.shape[1], -1), gate.reshape(B, q.shape[1], -1)
        if self.qk_norm_over == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(B, q.shape[1], -1, self.head_dim), k.view(B, T, -1, self.head_dim)
        if self.qk_norm_over == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, q_cos, q_sin), apply_rope(k, cos, sin)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            out = causal_attention(q, k, v, self.window, self.sinks)
        elif self.sinks is None:
            out = cache.attend(self.layer_idx, q, k, v)
        else:
            out = cache.attend(self.layer_idx, q, k, v, sinks=self.sinks)
        out = out.transpose(1, 2).reshape(B, q.shape[2], -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


def attend_rows(
    q,
    k,
    v,
    x,
    layer_idx: int,
    cache: AttentionCache | None,
    keep: torch.Tensor | None,
    window: int | None = None,
):
    """The attention of a layer that computes q/k/v [B, T, heads, D] (RoPE applied) its own way
    (agents/kernels/packed_linear.py, agents/kernels/fused_layer.py): with `keep`, only position keep[b] of each
    row's query and residual `x` go on (k/v: every position). -> (attended [B, T or 1, heads*D], x)."""
    B = q.shape[0]
    if keep is not None:
        rows = torch.arange(B, device=q.device)
        q, x = q[rows, keep][:, None], x[rows, keep][:, None]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if cache is None:
        attended = causal_attention(q, k, v, window)
    else:
        attended = cache.attend(layer_idx, q, k, v)
    return attended.transpose(1, 2).reshape(B, q.shape[2], -1), x


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or, as the family declares,
    GELU with the tanh approximation (Gemma's GeGLU)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.family.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). The FSDP2 wrap unit.
    With the family's sandwich_norms (Gemma 3): x + post_attention_layernorm(attn(input_layernorm(x))),
    then x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))). With its
    norm_placement "post" (OLMo 2/3): x + post_attention_layernorm(attn(x)), then
    x + post_feedforward_layernorm(mlp(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        scale = cfg.family.norm_scale
        # Qwen3.5's "linear_attention" layers mix tokens with a Gated DeltaNet, the others attend.
        self.linear = cfg.layer_linear(layer_idx)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = Attention(cfg, layer_idx)
        moe = GptOssMoE if cfg.family.moe_style == "gpt_oss" else SparseMoE
        self.mlp = moe(cfg) if cfg.layer_moe(layer_idx) else MLP(cfg)
        self.post_norms = cfg.family.norm_placement == "post"
        if not self.post_norms:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, scale)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, scale)
        self.sandwich = cfg.family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, scale)
        if self.sandwich or self.post_norms:
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, scale)

    @property
    def dense_mlp(self) -> MLP:
        """The layer's dense MLP, for the engine's packed and fused layers (the dense block's);
        ValueError for a mixture-of-experts layer (it runs as the model's own layer)."""
        if not isinstance(self.mlp, MLP):
            raise ValueError("a mixture-of-experts layer has no dense MLP: it runs as the model's own layer")
        return self.mlp

    def forward(
        self, x: torch.Tensor, cos, sin, cache: AttentionCache | None = None, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """keep [B] (with a cache): compute only position keep[b] of each row -> [B, 1, hidden]."""
        normed = x if self.post_norms else self.input_layernorm(x)
        if self.linear:  # every position runs (its state needs them); `keep` picks the rows after
            attended = self.linear_attn(cast_once_for_autocast(normed), cache)
            if keep is not None:
                attended = attended[torch.arange(x.shape[0], device=x.device), keep][:, None]
        else:
            attended = self.self_attn(cast_once_for_autocast(normed), cos, sin, cache, keep)
        if keep is not None:
            x = x[torch.arange(x.shape[0], device=x.device), keep][:, None]
        if self.post_norms:
            x = x + self.post_attention_layernorm(attended)
            return x + self.post_feedforward_layernorm(self.mlp(cast_once_for_autocast(x)))
        if self.sandwich:
            x = x + self.post_attention_layernorm(attended)
            mlp = self.mlp(cast_once_for_autocast(self.pre_feedforward_layernorm(x)))
            return x + self.post_feedforward_layernorm(mlp)
        x = x + attended
        return x + self.mlp(cast_once_for_autocast(self.post_attention_layernorm(x)))


def run_block(layer: nn.Module, x: torch.Tensor, cos, sin, cache: AttentionCache | None) -> torch.Tensor:
    """One decoder block of a training forward (what `compiled_block` compiles)."""
    return layer(x, cos, sin, cache)


_COMPILED_BLOCK: list = []


def compiled_block():
    """`run_block` under torch.compile (dynamic shapes), made once per process: the blocks share
    one compiled graph (torch.compile treats a module's parameters as inputs), and the function
    holds no module, so a copy of the model (the engine's) shares nothing with the trainer's."""
    if not _COMPILED_BLOCK:
        _COMPILED_BLOCK.append(torch.compile(run_block, dynamic=True))
    return _COMPILED_BLOCK[0]


class DecoderStack(nn.Module):
    """HF's `Qwen2Model` / `LlamaModel`: embeddings, the decoder layers, the final norm (the `model.` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # padding_idx: transformers' (pad_token_id), whose row lookups never train.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.family.norm_scale)
        # Gemma: embeddings times sqrt(hidden_size), that factor in the embedding's dtype.
        self.embed_scale = cfg.hidden_size**0.5 if cfg.family.embed_scale else None
        # The layers that rotate with the local RoPE base (Gemma 3's sliding-window layers).
        self.local_rope = [cfg.layer_rope_local(i) for i in range(cfg.num_hidden_layers)]
        # The trainer's `activation_checkpointing`: a training forward keeps only each block's
        # input and recomputes the block in backward. Its `compile`: a training forward runs
        # each block through `compiled_block`. Inference forwards (no grad) do neither.
        self.checkpoint_layers = False
        self.compile_layers = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        keep: torch.Tensor | None = None,
        rope_local: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> hidden [B, T, hidden]. positions [B, T] or [T] (default arange(T));
        `rope` (cos, sin) [B or 1, T, 1, D] may be passed precomputed instead of positions.
        keep [B] (a prefill, with a cache): only the hidden state at position keep[b] of each row
        is wanted -> [B, hidden]; the last layer then computes its query, attention output and MLP
        at that position alone (its k/v, which the cache keeps, at every position)."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # a Python number: no host tensor in a captured step
            x = x * _in_dtype(self.embed_scale, x.dtype)
        cfg = self.config
        if rope is None:
            if positions is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device)

            def table(
                theta: float, scaling: RopeScaling | YarnScaling | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
                cos, sin = rope_cos_sin(positions, cfg.rotary_dim, theta, x.dtype, scaling)
                if cos.dim() == 2:  # [T, D] -> [1, T, 1, D]
                    cos, sin = cos[None], sin[None]
                return cos.unsqueeze(2), sin.unsqueeze(2)

            cos, sin = table(cfg.rope_theta, cfg.rope_scaling)
            if cfg.rope_local_base_freq is not None:
                rope_local = table(cfg.rope_local_base_freq, None)
        else:
            cos, sin = rope
            if cfg.rope_local_base_freq is not None and rope_local is None:
                raise ValueError(f"{cfg.model_type}: a precomputed rope= needs rope_local= too")
        if keep is not None and cache is None:
            raise ValueError("keep= needs a cache (the cache masks the kept queries' attention)")
        last = len(self.layers) - 1
        training = keep is None and torch.is_grad_enabled()
        block = compiled_block() if self.compile_layers else run_block
        for i, layer in enumerate(self.layers):
            c, s = rope_local if self.local_rope[i] and rope_local is not None else (cos, sin)
            if not training:
                x = layer(x, c, s, cache, keep if i == last else None)
            elif self.checkpoint_layers:
                x = checkpoint(block, layer, x, c, s, cache, use_reentrant=False)
            else:
                x = block(layer, x, c, s, cache)
        return self.norm(x if keep is None else x[:, 0])


class Transformer(nn.Module):
    """HF's `<Family>ForCausalLM` (`ModelConfig.family.architecture`): `model` (DecoderStack) + `lm_head`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.reset_parameters()

    def tie_weights(self) -> None:
        """With tied embeddings, make lm_head.weight the same Parameter as embed_tokens.weight."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """HF's init: weights ~ N(0, std), biases 0, norms 1 (no-op on the meta device)."""
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if name.endswith(("linear_attn.norm.weight", "linear_attn.dt_bias")):  # plain scales: 1
                p.fill_(1.0)
            elif name.endswith("linear_attn.A_log"):  # decay rates A ~ U(0.01, 16): short and long memories
                p.uniform_(0.01, 16.0, generator=generator).log_()
            elif name.endswith("norm.weight"):  # 1, or 0 where the norm scales by 1 + weight (Gemma)
                p.fill_(0.0 if self.config.family.norm_scale == "one_plus_weight" else 1.0)
            elif name.endswith((".bias", "_bias")):  # gpt-oss's experts: gate_up_proj_bias, down_proj_bias
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
        head: Callable[[torch.Tensor, nn.Module], Any] | None = None,
    ) -> Any:
        """Training / scoring: input_ids [B, T] -> logits [B, T, V] (causal, or as `cache` attends).

        `head(hidden [B, T, hidden], self.lm_head)`, when given, replaces `lm_head(hidden)` and its
        result is returned: the trainer scores only the positions it trains, without the whole
        logits (trainers/logprobs.py). It runs inside this forward, where FSDP2 has gathered the
        head's weight."""
        hidden = self.model(input_ids, positions, cache)
        return self.lm_head(hidden) if head is None else head(hidden, self.lm_head)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype


def build_model(
    config: ModelConfig | str,
    *,
    seed: int | None = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Transformer:
    """A randomly initialised model (HF's init, drawn on CPU: the same seed gives the same weights
    on every device)."""
    cfg = ModelConfig.named(config) if isinstance(config, str) else config
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the two tied names separate storage
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    model.reset_parameters(generator=generator)
    return model.to(dtype=dtype, device=device)


def causal_lm_logprobs(model: Transformer, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Teacher-forced log p(tokens[:, t+1] | tokens[:, :t+1]) under log_softmax(logits / T): [B, T-1]."""
    logits = model(tokens)[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


__all__ = [
    "DecoderLayer",
    "Transformer",
    "attend_rows",
    "build_model",
    "causal_lm_logprobs",
    "rms_norm",
    "rope_cos_sin",
]
