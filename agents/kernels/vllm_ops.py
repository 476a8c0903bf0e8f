"""vLLM's compiled CPU kernels, borrowed by the torch engine when vllm-cpu is installed.

A decode step of a small model is a few dozen small ops per layer, each paying its dispatch and
its cold-cache memory traffic; where vllm-cpu is installed the engine (`kernels="vllm"`, chosen by
agents/engine/backend.py) runs the ones vLLM has a one-pass kernel for with that kernel:
- the attention over the KV cache: SGLang's CPU kernels `decode_attention_cpu` and
  `extend_attention_cpu` for bf16/fp16 (agents/kernels/sglang_attention.py), vLLM's paged kernel
  `cpu_attention_with_kv_cache` for float32 (agents/kernels/paged_attention.py);
- RMSNorm (`rms_norm`), bit for bit torch's in bf16/fp16;
- RoPE (`rotary_embedding`), in place on q and k as views of the q/k/v GEMM's output, rounding
  once per element where torch's rotate-half form rounds three times (`rope_supports`: which
  head sizes it takes);
- bf16/fp16 linears of small batches (SGLang's `weight_packed_linear`, `small_batch_linear`;
  agents/kernels/packed_linear.py's SMALL_BATCH_ROWS says up to which batch).
What each buys: docs/engine.md and bench/RESULTS.md ('bench/generate.py').

The library is loaded with `torch.ops.load_library`, not imported: no vLLM Python code runs (its
package import sets environment variables and takes seconds). The file is the one vLLM's own CPU
platform would import for this CPU, so a process that also runs vLLM loads it once. Only x86 CPUs
with AVX-512 BF16 qualify (where vLLM uses `_C`); elsewhere, or when an op's schema differs from
what this module calls (another vLLM version), `vllm_op` gives None and the engine keeps torch's
ops. TOOLGYM_VLLM_CPU_KERNELS=0 turns the borrowing off.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import platform
from pathlib import Path
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

# Whose compiled kernels the engine's packed layers and attention use: torch's, or vllm-cpu's.
Kernels = Literal["torch", "vllm"]

# Each op's argument names as this module passes them (vllm-cpu 0.32); an op with another schema is
# not used.
SIGNATURES = {
    "decode_attention_cpu": [
        "query", "k_buffer", "v_buffer", "output", "key", "value", "loc", "attn_logits", "req_to_token",
        "req_pool_indices", "seq_lens", "sm_scale", "logit_cap", "is_cross_attn", "sliding_window_size",
        "encoder_lens", "sinks",
    ],
    "extend_attention_cpu": [
        "q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "req_to_token",
        "req_pool_indices", "seq_lens", "extend_seq_lens", "extend_start_loc", "max_len_extend", "sm_scale",
        "logit_cap", "is_cross_attn", "sliding_window_size", "encoder_lens", "sinks", "tree_mask",
    ],
    "rms_norm": ["out", "input", "weight", "epsilon"],
    "convert_weight_packed": ["weight"],
    "weight_packed_linear": ["out", "mat1", "mat2", "bias", "is_vnni"],
    "rotary_embedding": [
        "positions", "query", "key", "head_size", "cos_sin_cache", "is_neox", "rope_dim_offset", "inverse",
    ],
    "cpu_attention_with_kv_cache": [
        "query", "key_cache", "value_cache", "output", "query_start_loc", "seq_lens", "scale", "causal",
        "alibi_slopes", "sliding_window_size", "block_table", "softcap", "scheduler_metadata", "s_aux",
        "dynamic_causal", "k_scale", "v_scale", "kv_cache_dtype",
    ],
    "get_scheduler_metadata": [
        "num_req", "num_heads_q", "num_heads_kv", "head_dim", "seq_lens", "dtype", "query_start_loc", "casual",
        "window_size", "isa_hint", "enable_kv_split", "dynamic_causal", "kv_cache_dtype",
    ],
    "cpu_attn_reshape_and_cache": [
        "key", "value", "key_cache", "value_cache", "slot_mapping", "isa", "k_scale", "v_scale", "kv_cache_dtype",
    ],
}  # fmt: skip


def _library_path() -> Path | str:
    """vllm's `_C` library for this CPU, found without importing vllm; or, in a few words, why
    none is used: turned off, vllm not installed, a CPU where vLLM's CPU platform would load
    another library (no AVX-512 BF16), or vllm without the library."""
    if os.environ.get("TOOLGYM_VLLM_CPU_KERNELS", "1") == "0":
        return "turned off (TOOLGYM_VLLM_CPU_KERNELS=0)"
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return "vllm-cpu not installed"
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.cpu._is_avx512_bf16_supported():
        return "vllm-cpu installed, but its kernels need an x86 CPU with AVX-512 BF16"
    for folder in spec.submodule_search_locations or []:
        path = Path(folder) / "_C.abi3.so"
        if path.is_file():
            return path
    return "vllm is installed without vllm-cpu's library (_C.abi3.so)"


@functools.cache
def _load_failure() -> str | None:
    """Load vllm-cpu's `_C` once per process; None where it loaded, else why not."""
    path = _library_path()
    if isinstance(path, str):
        return path
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:  # a broken install: keep torch's
        logger.warning("vllm-cpu's kernels did not load (%s); using torch's", error)
        return "vllm-cpu's library did not load (see the warning above)"
    return None


@functools.cache
def vllm_op(name: str) -> Any:
    """`torch.ops._C.<name>` from vllm-cpu (one of SIGNATURES), or None where it is not usable
    (see the module doc)."""
    if _load_failure() is not None:
        return None
    try:
        op = getattr(torch.ops._C, name)
    except (AttributeError, RuntimeError):
        logger.warning("vllm-cpu's library has no %s; using torch's", name)
        return None
    names = [argument.name for argument in op.default._schema.arguments]
    if names != SIGNATURES[name]:
        logger.warning("vllm-cpu's %s has another signature (%s); using torch's", name, names)
        return None
    return op


def kernels_available() -> bool:
    """Whether every op this module calls loaded (what `kernels="vllm"` needs)."""
    return all(vllm_op(name) is not None for name in SIGNATURES)


def unavailable_reason() -> str | None:
    """Why `kernels_available()` is False, in a few words for a log line or an error; None where
    the kernels load. Loads nothing that `kernels_available()` would not."""
    failure = _load_failure()
    if failure is not None:
        return failure
    missing = [name for name in SIGNATURES if vllm_op(name) is None]
    if missing:
        return f"vllm-cpu's {', '.join(missing)} not as this version calls them"
    return None


def clear_cache() -> None:
    """Forget what loaded (tests that change TOOLGYM_VLLM_CPU_KERNELS); a loaded library stays."""
    _load_failure.cache_clear()
    vllm_op.cache_clear()


def rms_norm(x: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`F.rms_norm(x, (x.shape[-1],), None, eps)` (no weight) in one pass: the float32 mean square,
    then x * rsqrt(it + eps) rounded once to x's dtype, as HF's RMSNorm before its weight.
    out: where to write it, for contiguous rows x [M, hidden] (agents/kernels/packed_decode.py)."""
    if out is not None:
        vllm_op("rms_norm")(out, x, None, eps)
        return out
    x = x.contiguous()
    out = torch.empty_like(x)
    vllm_op("rms_norm")(out.view(-1, x.shape[-1]), x.view(-1, x.shape[-1]), None, eps)
    return out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int, table: torch.Tensor
) -> None:
    """RoPE in place, rotate-half ("NeoX") style as Qwen's: q [tokens, heads * head_dim] and k
    [tokens, kv_heads * head_dim] (rows may be strided: views of a q/k/v GEMM's output) at
    positions [tokens] (int64); table [max_position, head_dim]: cos in the first half, sin in the
    second (`rope_table`)."""
    vllm_op("rotary_embedding")(positions, q, k, head_dim, table, True, 0, False)


def pack_small_batch_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear's weight [N, K] (bf16/fp16; N a multiple of 16, K of 32) in the blocked (VNNI)
    layout `small_batch_linear` reads: a copy."""
    return vllm_op("convert_weight_packed")(weight.detach().contiguous())


def small_batch_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias, float32) -> [M, out_features] in x's dtype (into `out` if given),
    with SGLang's kernel (`pack_small_batch_weight(W)`): float32 accumulation, rounded once."""
    if out is None:
        out = torch.empty((x.shape[0], out_features), dtype=x.dtype, device=x.device)
    vllm_op("weight_packed_linear")(out, x, packed, bias, True)
    return out


def rope_supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether `rotary_embedding` takes this head size in this dtype. Tried on vllm-cpu 0.32:
    float32 every even size from 4 to 512; bf16 sizes up to 16 and multiples of 16, while
    24, 40, 20, 36, 56 and 72 crash the process (so it must never be called there)."""
    if dtype == torch.float32:
        return True
    return head_dim <= 16 or head_dim % 16 == 0


def rope_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotary_embedding`'s table from agents/model/transformer.py's `rope_cos_sin` tables [positions, D]
    (cos repeated over both halves, sin sign-folded: its second half is plain sin)."""
    half = cos.shape[-1] // 2
    return torch.cat([cos[..., :half], sin[..., half:]], dim=-1).contiguous()


__all__ = [
    "SIGNATURES",
    "Kernels",
    "clear_cache",
    "kernels_available",
    "pack_small_batch_weight",
    "rms_norm",
    "rope_supports",
    "rope_table",
    "rotary_embedding",
    "small_batch_linear",
    "vllm_op",
]
