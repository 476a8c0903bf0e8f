"""TorchEngine: the default `Policy`, a batched, continuously batching torch sampler.

How a request flows:
- `await generate(prompts, params)` validates, queues one request per prompt and returns when all
  their samples are done. Calls made in the same event-loop tick are queued together
  (micro-batching), so `asyncio.gather` of many one-prompt calls is one prefill.
- The scheduler (agents/engine/scheduler.py) runs them: between decode steps it admits waiting samples
  into free slots of the KV cache (continuous batching; one prefill forward per admission, the n
  samples of a prompt sharing one prefill row), then every running sample advances by one token.
  Finished samples free their slot at once (running samples always fill slots 0..n-1 with their
  sampling state beside them: agents/engine/slots.py).
- Prompts that start alike share work (agents/engine/prefill.py): a prefill computes its prompts'
  common prefix once (a system prompt, a group's prompt) and keeps it; a later prefill whose
  prompts all start with it copies it instead (the next turns of those episodes).
- A finished sample's k/v are kept in a history pool (agents/engine/history.py); a later prompt that
  continues its conversation (the next turn of an episode) copies them back and prefills only
  its new tokens.
- Sampling (agents/engine/sampling.py) is per row: each request keeps its own temperature, top-k,
  top-p, max_tokens, stop ids and seed inside a mixed batch.

Hardware: every choice (device, dtype, layer form, kernels, KV-cache layout, CUDA graphs, the
thread that computes) is the `Backend` that agents/engine/backend.py's `select_backend` returns;
`backend.describe()` says what was chosen and why, in one line.

Which thread computes (the backend's `worker_thread`):
- off, the default on CPU: the thread that drives the engine computes. Async callers get a
  driver task on their event loop that runs one engine step and then yields, so the callers' own
  work (env steps, rendering, their next requests) runs between steps; `generate_sync` and
  `load_weights` run the steps they need themselves. Why: torch's CPU kernels run on OpenMP,
  and its runtime (libgomp) keeps one thread pool per thread that ever ran a parallel region.
  Once the pools' threads outnumber the cores, no pool spins between regions any more: every
  region then waits for its helper threads to wake, which made decode steps and training steps
  markedly slower while an engine thread existed (bench/RESULTS.md, 'bench/generate.py').
  Computing on the caller's thread keeps one pool per process.
  The engine is then driven by one thread at a time: calls from several threads are safe (a
  lock orders the steps) but each computes on its own thread.
- on, the default on CUDA: one worker thread owns the model and the KV cache, and callers only
  queue requests and wait; the event loop keeps running env steps while the GPU decodes.

Seeds: sample j of a request with seed s draws its t-th token from u(s, j, t), a counter-based
hash, so what it samples does not depend on the batch it shares or when it was admitted (see
agents/engine/sampling.py for the exact guarantee). Requests without a seed get one from the engine's
own generator (`seed=` at construction).

LoRA: a model with adapters (agents/model/lora.py) is served merged by default (the layers hold
W0 + s·BA, refolded on each sync, so packing and fusing apply: agents/engine/merged_lora.py), or
unmerged on plain layers (`select_backend(..., lora="unmerged")`); a sync may carry the adapters
only, and the engine then reports what it applied (`applied_adapter`).

Weights: `load_weights` copies the new tensors into the existing parameters in place and bumps
`policy_version`. With `weight_updates="drain"` (the default) the running samples finish on the
old weights first (nothing new is admitted meanwhile), so every Completion was sampled by one
version and carries it. With "in_flight" the copy happens between two decode steps without
draining: running samples go on with the new weights (their k/v so far stay as the old weights
computed them, as a partial rollout's do; such a sample's k/v are not kept for its
conversation's next turn) and their Completions record, per token, the version that sampled it
(`Completion.token_versions`); the trainer corrects for the gap with its off-policy losses
(trainers/losses.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, cast

import numpy as np
import torch

from ..errors import ContextOverflowError, checked_prompt, checked_weights, resolve_future
from ..model.lora import (
    AppliedAdapter,
    adapter_checksum,
    adapter_tensors,
    has_lora,
    is_adapter_name,
    keep_adapter_dtype,
)
from ..model.transformer import Transformer
from ..types import Completion, SamplingParams
from .backend import Backend, select_backend
from .cache_attention import Forwards
from .decode import DecodeGraphs
from .kv_cache import KVCache
from .merged_lora import MergedAdapters
from .prefill import Prefiller
from .routes import RouteRecorder
from .sampling import seed_to_u64
from .scheduler import EngineStats, Scheduler
from .slots import Request


def _as_decode_fn(tokenizer: Any) -> Callable[[list[int]], str] | None:
    if tokenizer is None or callable(getattr(tokenizer, "decode", None)):
        return None if tokenizer is None else tokenizer.decode
    if callable(tokenizer):
        return cast(Callable[[list[int]], str], tokenizer)
    raise TypeError("tokenizer must have .decode(ids) or be a callable ids -> str")


class TorchEngine:
    """Batched sampling from a `Transformer` with a preallocated KV cache (implements `Policy`).

    model: copied (in `dtype` on `device`, default: the model's); the copy changes only through
    `load_weights`, never when the caller trains `model`. max_batch_size: KV-cache
    slots (samples decoded together). max_seq_len: prompt + completion tokens per sample (default
    min(max_position_embeddings, 4096)); a prompt with no room left raises ContextOverflowError,
    a completion that reaches it finishes with "length". max_prefill_tokens: padded prompt
    tokens per prefill forward (bounds its memory). tokenizer: anything with .decode(ids), or a
    callable, for `Completion.text`. backend: every hardware choice (layer form, kernels, KV-cache
    layout, CUDA graphs, worker thread; agents/engine/backend.py), default
    `select_backend(model.config, device, dtype)`: this machine's defaults; its device and dtype
    must be the engine's.
    continuous_batching: admit waiting requests between decode steps (default); False waits
    until the running batch is done (static micro-batching, for comparison). share_prefixes:
    compute a prefill's common prompt prefix once and keep it for later prefills (default; off
    recomputes every prompt in full, for comparison). history_capacity: token positions of KV
    cache that keep finished samples' k/v for their conversation's next turn
    (agents/engine/history.py; default max_batch_size * max_seq_len, which doubles the cache; 0
    turns this off). weight_updates: "drain" or "in_flight", how `load_weights` treats running
    samples (module doc). record_routes: a mixture of experts' chosen experts at every position
    go into each `Completion.routes` (agents/engine/routes.py; decode then runs eagerly, without
    CUDA graphs), for the trainer's routing replay.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        max_batch_size: int = 64,
        max_seq_len: int | None = None,
        max_prefill_tokens: int = 16384,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tokenizer: Any = None,
        seed: int = 0,
        policy_version: int = 0,
        backend: Backend | None = None,
        continuous_batching: bool = True,
        share_prefixes: bool = True,
        history_capacity: int | None = None,
        weight_updates: Literal["drain", "in_flight"] = "drain",
        record_routes: bool = False,
    ) -> None:
        if weight_updates not in ("drain", "in_flight"):
            raise ValueError(f"weight_updates must be 'drain' or 'in_flight', got {weight_updates!r}")
        self.weight_updates = weight_updates
        cfg = model.config
        self.config = cfg
        lora = has_lora(model)
        if backend is None:
            dtype, device = dtype or model.dtype, torch.device(device) if device is not None else model.device
            backend = select_backend(cfg, device, dtype, lora="merged" if lora else None)
        else:
            dtype, device = (
                dtype or backend.dtype,
                torch.device(device) if device is not None else backend.device,
            )
            if (dtype, device) != (backend.dtype, backend.device):
                raise ValueError(
                    f"backend is for {backend.dtype} on {backend.device}, the engine for {dtype} on {device}"
                )
        unmerged = lora and backend.lora == "unmerged"
        if unmerged and (backend.packed or backend.fused):
            raise ValueError(
                "unmerged LoRA adapters run on plain layers: select_backend(..., lora='unmerged')"
            )
        # A backend chosen for another model: what this one's layers or windows cannot run on.
        if cfg.own_layers is not None and (backend.fused or (backend.packed and not backend.own_layers)):
            raise ValueError(
                f"{cfg.model_type} has {cfg.own_layers}: a backend that keeps the model's own layers"
            )
        if (torch_only := cfg.torch_attention_only) is not None and backend.attention != "torch":
            raise ValueError(f"{cfg.model_type} has {torch_only}: a backend with torch's attention")
        self.backend = backend
        backend.prepare_process()
        # The engine samples from its own copy: weights change only through load_weights.
        self.model = copy.deepcopy(model).to(dtype=dtype, device=device).eval().requires_grad_(False)
        keep_adapter_dtype(self.model)
        # LoRA served merged (the default; agents/engine/merged_lora.py): plain weights W0 + s·BA
        self._merged = MergedAdapters(self.model) if lora and not unmerged else None
        if self._merged is not None:
            self._merged.fold(dict(self.model.named_parameters()))
        self._adapter: AppliedAdapter | None = None  # what the last load_weights applied (LoRA)
        self.max_seq_len = max_seq_len or min(cfg.max_position_embeddings, 4096)
        if not 2 <= self.max_seq_len <= cfg.max_position_embeddings:
            raise ValueError(
                f"max_seq_len must be in [2, {cfg.max_position_embeddings}], got {self.max_seq_len}"
            )
        if max_batch_size < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch_size and max_prefill_tokens must be >= 1")
        if history_capacity is None:  # none for Gated DeltaNet layers (agents/engine/kv_cache.py)
            history_capacity = 0 if cfg.linear_attention else max_batch_size * self.max_seq_len
        if history_capacity < 0:
            raise ValueError(f"history_capacity must be >= 0, got {history_capacity}")
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self.continuous_batching = continuous_batching
        self.device, self.dtype = device, dtype
        self.fused, self.packed = backend.fused, backend.packed
        self._seed_rng = np.random.default_rng(seed)
        route_shape = RouteRecorder.shape(self.model) if record_routes else None
        if record_routes and route_shape is None:
            raise ValueError(f"record_routes: {cfg.model_type} has no mixture-of-experts layers to route")
        with torch.inference_mode():
            self.cache = KVCache(
                cfg, max_batch_size, self.max_seq_len, backend, history_capacity=history_capacity,
                routes=route_shape,
            )  # fmt: skip
            forwards = Forwards(self.cache, cfg)  # each forward's description and attention
        backend.prepare_model(self.model, batch_hint=max_batch_size)
        routes = RouteRecorder(self.model, self.cache) if record_routes else None
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        # what load_weights takes: the parameters, and the adapters a merged engine keeps aside
        self._loadable = self._params | dict(self._merged.tensors() if self._merged is not None else ())
        self.cuda_graphs = backend.cuda_graphs and not record_routes
        self._decoder = DecodeGraphs(
            self.model, self.cache, capture=self.cuda_graphs, forwards=forwards, routes=routes
        )
        self._prefiller = Prefiller(
            self.model, self.cache, share_prefixes=share_prefixes, forwards=forwards, routes=routes
        )
        self._scheduler = Scheduler(
            self.cache,
            self._prefiller,
            self._decoder,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            continuous_batching=continuous_batching,
            device=device,
            decode_text=_as_decode_fn(tokenizer),
            policy_version=policy_version,
            routes=routes,
        )
        self.stats: EngineStats = self._scheduler.stats
        # Threading: _cv guards the fields below and orders the steps of whichever thread computes.
        self._cv = threading.Condition()
        self._incoming: list[Request] = []
        self._paused = False  # worker thread: load_weights waits for the running samples
        self._busy = False  # worker thread: inside a step
        self._loading = False  # worker thread: an in-flight load_weights waits for the step to end
        self._closed = False
        # No worker thread: the task that steps for each event loop that has called `generate`.
        self._drivers: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}
        # Requests of the current event-loop tick, per loop, until that loop's `_flush` runs.
        self._buffers: dict[asyncio.AbstractEventLoop, list[Request]] = {}
        self._buffer_lock = threading.Lock()
        self.worker_thread = backend.worker_thread
        self._worker: threading.Thread | None = None
        if self.worker_thread:
            self._worker = threading.Thread(target=self._work, name="TorchEngine", daemon=True)
            self._worker.start()

    @property
    def policy_version(self) -> int:
        return self._scheduler.policy_version

    # ---- public API -----------------------------------------------------------------------------
    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * params.n Completions, prompt-major. Raises ContextOverflowError."""
        requests = self._make_requests(prompts, params)
        loop = asyncio.get_running_loop()
        with self._buffer_lock:
            buffer = self._buffers.setdefault(loop, [])
            schedule = not buffer
            buffer.extend(requests)
        if schedule:  # runs after every task that is ready now has queued its request
            loop.call_soon(self._flush, loop)
        results = await asyncio.gather(*(asyncio.wrap_future(r.future) for r in requests))
        return [c for per_prompt in results for c in per_prompt]

    def generate_sync(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Blocking `generate` for scripts and benchmarks. Without a worker thread it computes on
        the calling thread (serving whatever else is queued or running meanwhile)."""
        requests = self._make_requests(prompts, params)
        self._submit(requests)
        if self._worker is None:
            while not all(r.future.done() for r in requests):
                with self._cv:
                    if not self._step_here() and not all(r.future.done() for r in requests):
                        raise RuntimeError("TorchEngine: requests left unserved with nothing to run")
        return [c for r in requests for c in r.future.result()]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy HF-named tensors into the parameters in place; later tokens carry `version`.

        All names and shapes are checked before anything is copied. "drain": running samples
        finish on the old weights first (nothing new is admitted meanwhile), so no Completion
        mixes two versions. "in_flight": the copy waits only for the step in progress; running
        samples continue on the new weights (module doc).
        """
        updates = checked_weights(named_tensors, self._loadable, self.config.model_type)
        with self._cv:
            self._check_open()
            if self.weight_updates == "in_flight":
                # Steps run under _cv (no worker) or flag _busy under it (worker): between two.
                # _loading holds the worker back once its step ends (it would retake _cv first).
                self._loading = True
                try:
                    self._cv.wait_for(lambda: not self._busy or self._closed)
                    self._check_open()
                    self._copy_weights(updates, version)
                finally:
                    self._loading = False
                    self._cv.notify_all()
                return
            if self._worker is None:
                while self._scheduler.slots.running:
                    self._scheduler.step(admit=False)
                self._copy_weights(updates, version)
                return
            self._paused = True
            try:
                self._cv.wait_for(lambda: self._idle or self._closed)
                self._check_open()
                self._copy_weights(updates, version)
            finally:
                self._paused = False
                self._cv.notify_all()

    def close(self) -> None:
        """Stop serving; requests still queued or running fail with RuntimeError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            if self._worker is None:
                self._fail_pending()
        if (
            self._worker is not None
            and self._worker.is_alive()
            and threading.current_thread() is not self._worker
        ):
            self._worker.join()

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- submission -----------------------------------------------------------------------------
    def _make_requests(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Request]:
        self._check_open()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.config.vocab_size
        requests = []
        for i, prompt in enumerate(prompts):
            prompt = checked_prompt(i, prompt, max_seq_len=self.max_seq_len, vocab_size=vocab)
            seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**63))
            request = Request(
                prompt=prompt,
                params=params,
                seed=seed_to_u64(seed),
                future=concurrent.futures.Future(),
                stop_ids=frozenset(params.stop_token_ids),
                limit=min(params.max_tokens, self.max_seq_len - len(prompt)),
                results=[None] * params.n,
                unadmitted=params.n,
                unfinished=params.n,
            )
            requests.append(request)
        return requests

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._buffer_lock:
            requests = self._buffers.pop(loop, [])
            for stale in [other for other in self._buffers if other.is_closed()]:
                del self._buffers[stale]  # never flushed: their callers went with their loop
        self._submit(requests)
        if self._worker is None:
            with self._cv:
                for stale in [other for other in self._drivers if other.is_closed()]:
                    del self._drivers[stale]
                # One driver per loop: another loop's may be paused (its loop stopped, not closed)
                # and a driver its loop cancelled steps no more.
                driver = self._drivers.get(loop)
                if not self._closed and (driver is None or driver.done()):
                    self._drivers[loop] = loop.create_task(self._drive())

    def _submit(self, requests: list[Request]) -> None:
        with self._cv:
            if self._closed:
                for r in requests:
                    resolve_future(r.future, exception=RuntimeError("TorchEngine is closed"))
                return
            self._incoming.extend(requests)
            self._cv.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TorchEngine is closed")

    def _copy_weights(self, updates: list[tuple[str, torch.Tensor]], version: int) -> None:
        carries_adapters = any(is_adapter_name(name) for name, _ in updates)
        with torch.no_grad():
            if self._merged is not None:
                updates = self._merged.load(updates)
            for name, tensor in updates:
                self._params[name].copy_(tensor)
            folded = self._merged.fold(self._params) if self._merged is not None else []
            self._prefiller.forget()
            # adapters alone change only the adapted linears: repack just their layers
            self.backend.refresh_model(self.model, None if updates else folded)
        if carries_adapters:
            adapters = self.adapter_tensors()
            self._adapter = AppliedAdapter(version, adapter_checksum(adapters), adapters[0][1].dtype)
        self._scheduler.retag(version)

    def adapter_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The LoRA adapter weights this engine holds, named as the trainer's (empty without
        LoRA): those it folds into its weights when serving them merged, else its model's."""
        return list(self._merged.tensors() if self._merged is not None else adapter_tensors(self.model))

    def applied_adapter(self) -> AppliedAdapter | None:
        """The LoRA adapters the last `load_weights` that carried them applied: its version and
        the checksum of this engine's own adapter weights (trainers/weight_sync.py checks them
        against the trainer's); None before any."""
        return self._adapter

    def _enqueue_incoming(self) -> None:  # under _cv
        self._scheduler.enqueue(self._incoming)
        self._incoming = []

    def _fail_pending(self) -> None:  # under _cv
        error = RuntimeError("TorchEngine is closed")
        self._scheduler.fail_all(error)
        for r in self._incoming:
            resolve_future(r.future, exception=error)
        self._incoming.clear()

    # ---- computing on the driving thread (no worker thread) ---------------------------------------
    def _step_here(self) -> bool:
        """One engine step on this thread (under _cv); False when there was nothing to do."""
        if self._closed:
            return False
        self._enqueue_incoming()
        if not self._scheduler.has_work:
            return False
        self._scheduler.step()
        return True

    async def _drive(self) -> None:
        """Step while there is work, yielding to the event loop between steps."""
        loop, this = asyncio.get_running_loop(), asyncio.current_task()
        while True:
            with self._cv:
                if not self._step_here():
                    if self._drivers.get(loop) is this:  # under _cv: a later submit starts a new one
                        del self._drivers[loop]
                    return
            await asyncio.sleep(0)

    # ---- the worker thread ------------------------------------------------------------------------
    @property
    def _idle(self) -> bool:  # read under _cv: nothing running in the worker
        return not self._scheduler.slots.running and not self._busy

    def _work(self) -> None:
        scheduler = self._scheduler
        while True:
            with self._cv:
                self._cv.wait_for(
                    lambda: (
                        self._closed
                        or (scheduler.slots.running and not self._loading)
                        or ((self._incoming or scheduler.waiting) and not self._paused and not self._loading)
                    )
                )
                if self._closed:
                    break
                self._enqueue_incoming()
                admit = not self._paused
                self._busy = True
            try:
                scheduler.step(admit)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
        with self._cv:
            self._fail_pending()


__all__ = ["ContextOverflowError", "EngineStats", "TorchEngine"]
