"""TorchEngine: the default `Policy`, a batched, continuously batching torch sampler.

How a request flows:
- `await generate(prompts, params)` validates, queues one request per prompt and returns when all
  their samples are done. Calls made in the same event-loop tick are handed to the worker
  together (micro-batching), so `asyncio.gather` of many one-prompt calls is one prefill.
- One worker thread owns the model and the KV cache (agents/kv_cache.py). Between decode steps
  it admits waiting samples into free slots (continuous batching): one prefill forward per
  admission (the n samples of a prompt share one prefill row), then every running sample
  advances by one token per decode step. Finished samples free their slot at once (running
  samples always fill slots 0..n-1 with their sampling state beside them: agents/slots.py).
- Prompts that start alike share work (agents/prefill.py): a prefill computes its prompts'
  common prefix once (a system prompt, a group's prompt) and keeps it; a later prefill whose
  prompts all start with it copies it instead (the next turns of those episodes).
- A finished sample's k/v are kept in a history pool (agents/history.py); a later prompt that
  continues its conversation (the next turn of an episode) copies them back and prefills only
  its new tokens.
- Sampling (agents/sampling.py) is per row: each request keeps its own temperature, top-k,
  top-p, max_tokens, stop ids and seed inside a mixed batch.

Seeds: sample j of a request with seed s draws its t-th token from u(s, j, t), a counter-based
hash, so what it samples does not depend on the batch it shares or when it was admitted (see
agents/sampling.py for the exact guarantee). Requests without a seed get one from the engine's
own generator (`seed=` at construction).

Weights: `load_weights` waits for running samples to finish (admission pauses), copies the new
tensors into the existing parameters in place, and bumps `policy_version`; every Completion was
sampled by one version and carries it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from .decode_graphs import DecodeGraphs
from .errors import ContextOverflowError, checked_prompt, resolve_future
from .kv_cache import KeyLayout, KVCache
from .model import Transformer
from .packed_linear import pack_model, repack, resolve_packing
from .prefill import Prefiller, padded_chunks
from .sampling import sample_tokens, seed_to_u64
from .slots import Request, Sample, Slots
from .types import Completion, SamplingParams


class EngineStats(msgspec.Struct):
    """Counters since construction (read them to see how requests were batched)."""

    prefill_forwards: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    requests: int = 0
    max_running: int = 0
    shared_prefix_tokens: int = 0  # prompt tokens not recomputed (a common or stored prefix)
    history_tokens: int = 0  # prompt tokens not recomputed (an earlier turn's kept k/v)
    prefill_seconds: float = 0.0  # wall time inside prefill forwards + first-token sampling
    decode_seconds: float = 0.0  # wall time inside decode steps (forward + sampling + bookkeeping)


def _as_decode_fn(tokenizer: Any) -> Callable[[list[int]], str] | None:
    if tokenizer is None or callable(getattr(tokenizer, "decode", None)):
        return None if tokenizer is None else tokenizer.decode
    if callable(tokenizer):
        return tokenizer
    raise TypeError("tokenizer must have .decode(ids) or be a callable ids -> str")


class TorchEngine:
    """Batched sampling from a `Transformer` with a preallocated KV cache (implements `Policy`).

    model: copied (in `dtype` on `device`, default: the model's); the copy changes only through
    `load_weights`, never when the caller trains `model`. max_batch_size: KV-cache
    slots (samples decoded together). max_seq_len: prompt + completion tokens per sample (default
    min(max_position_embeddings, 4096)); a prompt with no room left raises ContextOverflowError,
    a completion that reaches it finishes with "length". max_prefill_tokens: padded prompt
    tokens per prefill forward (bounds its memory). tokenizer: anything with .decode(ids), or a
    callable, for `Completion.text`. pack_weights: run the linears with oneDNN-packed weights
    (agents/packed_linear.py; default: on CPU when available). key_layout: the KV cache's key
    layout (agents/kv_cache.py; default: the fastest for `dtype`). continuous_batching: admit
    waiting requests between decode steps (default); False waits until the running batch is done
    (static micro-batching, for comparison). cuda_graphs: replay decode steps from CUDA graphs at
    bucketed shapes (agents/decode_graphs.py; default: on for a CUDA device). share_prefixes:
    compute a prefill's common prompt prefix once and keep it for later prefills (default; off
    recomputes every prompt in full, for comparison). history_capacity: token positions of KV
    cache that keep finished samples' k/v for their conversation's next turn (agents/history.py;
    default max_batch_size * max_seq_len, which doubles the cache; 0 turns this off).
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
        pack_weights: bool | None = None,
        key_layout: KeyLayout | None = None,
        continuous_batching: bool = True,
        cuda_graphs: bool | None = None,
        share_prefixes: bool = True,
        history_capacity: int | None = None,
    ) -> None:
        cfg = model.config
        self.config = cfg
        dtype, device = dtype or model.dtype, torch.device(device) if device is not None else model.device
        # The engine samples from its own copy: weights change only through load_weights.
        self.model = copy.deepcopy(model).to(dtype=dtype, device=device).eval().requires_grad_(False)
        self.max_seq_len = max_seq_len or min(cfg.max_position_embeddings, 4096)
        if not 2 <= self.max_seq_len <= cfg.max_position_embeddings:
            raise ValueError(
                f"max_seq_len must be in [2, {cfg.max_position_embeddings}], got {self.max_seq_len}"
            )
        if max_batch_size < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch_size and max_prefill_tokens must be >= 1")
        if history_capacity is None:
            history_capacity = max_batch_size * self.max_seq_len
        if history_capacity < 0:
            raise ValueError(f"history_capacity must be >= 0, got {history_capacity}")
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self.continuous_batching = continuous_batching
        self.device, self.dtype = device, dtype
        self.packed = resolve_packing(device, dtype, pack_weights)
        if self.packed:
            pack_model(self.model, batch_hint=max_batch_size)
        self.policy_version = policy_version
        self.stats = EngineStats()
        self._decode_text = _as_decode_fn(tokenizer)
        self._seed_rng = np.random.default_rng(seed)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.inference_mode():
            self.cache = KVCache(
                cfg,
                max_batch_size,
                self.max_seq_len,
                dtype=dtype,
                device=device,
                key_layout=key_layout,
                history_capacity=history_capacity,
            )
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got {device}")
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self._decoder = DecodeGraphs(self.model, self.cache, capture=self.cuda_graphs)
        self._prefiller = Prefiller(self.model, self.cache, share_prefixes=share_prefixes)
        self._slots = Slots(max_batch_size)  # running samples, slot i = self._slots.running[i]
        self._waiting: deque[Request] = deque()
        self._admitting: list[Request] = []
        # Threading: the worker owns everything above; others talk through _cv-guarded fields.
        self._cv = threading.Condition()
        self._incoming: list[Request] = []
        self._paused = False
        self._closed = False
        self._buffer: list[Request] = []
        self._buffer_lock = threading.Lock()
        self._flush_scheduled = False
        self._worker = threading.Thread(target=self._work, name="TorchEngine", daemon=True)
        self._worker.start()

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
        """Copy HF-named tensors into the parameters in place; later samples carry `version`.

        All names and shapes are checked before anything is copied. Waits for running samples to
        finish first (no admission meanwhile), so no Completion mixes two versions.
        """
        updates = list(named_tensors)
        for name, tensor in updates:
            param = self._params.get(name)
            if param is None:
                raise KeyError(f"load_weights: unknown parameter {name!r} for {self.config.model_type}")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
        with self._cv:
            self._check_open()
            self._paused = True
            try:
                self._cv.wait_for(lambda: self._idle or self._closed)
                self._check_open()
                with torch.no_grad():
                    for name, tensor in updates:
                        self._params[name].copy_(tensor)
                    self._prefiller.forget()
                    if self.packed:
                        repack(self.model)
                self.policy_version = version
            finally:
                self._paused = False
                self._cv.notify_all()

    def close(self) -> None:
        """Stop the worker; requests still queued or running fail with RuntimeError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._worker.is_alive() and threading.current_thread() is not self._worker:
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

    def _flush(self) -> None:
        with self._buffer_lock:
            requests, self._buffer = self._buffer, []
            self._flush_scheduled = False
        self._submit(requests)

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

    @property
    def _idle(self) -> bool:  # read under _cv: nothing running in the worker
        return not self._slots.running and not self._busy

    # ---- worker ---------------------------------------------------------------------------------
    _busy = False

    def _work(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                self._cv.wait_for(
                    lambda: (
                        self._closed
                        or self._slots.running
                        or (self._incoming and not self._paused)
                        or (self._waiting and not self._paused)
                    )
                )
                if self._closed:
                    break
                self._waiting.extend(self._incoming)
                self.stats.requests += len(self._incoming)
                self._incoming.clear()
                admit = not self._paused
                self._busy = True
            try:
                with torch.inference_mode():
                    self._drop_cancelled()
                    if admit and (self.continuous_batching or not self._slots.running):
                        self._admit()
                    if self._slots.running:
                        self._decode_step()
            except Exception as error:  # fail what is in flight, keep serving
                self._fail_all(error)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
        self._fail_all(RuntimeError("TorchEngine is closed"))
        with self._cv:
            for r in self._incoming:
                resolve_future(r.future, exception=RuntimeError("TorchEngine is closed"))
            self._incoming.clear()

    def _fail_all(self, error: BaseException) -> None:
        requests = {id(s.request): s.request for s in self._slots.running}
        requests.update((id(r), r) for r in (*self._waiting, *self._admitting))
        self._slots.running.clear()
        self._waiting.clear()
        self._admitting = []
        # A failed prefill may have claimed kept histories it never copied back, or stored part
        # of a prefix: start the kept k/v afresh rather than trust them.
        self._prefiller.forget()
        for r in requests.values():
            resolve_future(r.future, exception=error)

    def _drop_cancelled(self) -> None:
        if any(r.future.cancelled() for r in self._waiting):
            self._waiting = deque(r for r in self._waiting if not r.future.cancelled())
        gone = [i for i, s in enumerate(self._slots.running) if s.request.future.cancelled()]
        self._slots.remove(gone, self.cache.move_slot)

    # ---- admission + prefill --------------------------------------------------------------------
    def _admit(self) -> None:
        groups: list[tuple[Request, int, int]] = []  # (request, first sample index, count)
        free = self._slots.free
        while self._waiting and free:
            request = self._waiting[0]
            count = min(free, request.unadmitted)
            groups.append((request, request.params.n - request.unadmitted, count))
            request.unadmitted -= count
            free -= count
            if not request.unadmitted:
                self._waiting.popleft()
        # Out of the queue, not yet running: a prefill that raises must fail these too.
        self._admitting = [request for request, _, _ in groups]
        # Next turns of finished samples' conversations prefill only their new tokens.
        claims: list[tuple[int, int] | None] = [None] * len(groups)
        if len(self._prefiller.history):
            claims = [self._prefiller.history.claim(g[0].prompt) if g[2] == 1 else None for g in groups]
        continuing = [(g, c) for g, c in zip(groups, claims, strict=True) if c is not None]
        fresh = [(g, None) for g, c in zip(groups, claims, strict=True) if c is None]

        def runs(item: tuple) -> int:  # the prompt tokens its prefill computes
            (request, _, _), claim = item
            return len(request.prompt) - (claim[1] if claim else 0)

        for batch in (continuing, fresh):
            for chunk in padded_chunks(batch, runs, self.max_prefill_tokens):
                self._prefill(chunk)
        self._admitting = []

    def _prefill(self, chunk: list[tuple[tuple[Request, int, int], tuple[int, int] | None]]) -> None:
        """Prefill one chunk: all fresh (claim None) or all continuing a kept history."""
        start = time.perf_counter()
        groups = [group for group, _ in chunk]
        prompts = [request.prompt for request, _, _ in groups]
        lengths = [len(p) for p in prompts]
        first = len(self._slots)
        if chunk[0][1] is not None:
            logits, saved = self._prefiller.continue_(prompts, [claim for _, claim in chunk], first)
            self.stats.history_tokens += saved
        else:
            logits, saved = self._prefiller(prompts, [count for _, _, count in groups], first)
            self.stats.shared_prefix_tokens += saved
        self.stats.prefill_forwards += 1
        self.stats.prompt_tokens += sum(lengths)
        for (request, first_sample, count), length in zip(groups, lengths, strict=True):
            for j in range(first_sample, first_sample + count):
                self._slots.add(Sample(request, j, self.policy_version), length)
        self.stats.max_running = max(self.stats.max_running, len(self._slots))
        self._sample_and_record(logits, first, len(self._slots))
        self.stats.prefill_seconds += time.perf_counter() - start

    # ---- decode ---------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        start = time.perf_counter()
        slots, n = self._slots, len(self._slots)
        logits = self._decoder.forward(slots.next[:n], slots.pos[:n])
        self.stats.decode_steps += 1
        slots.pos[:n] += 1
        self._sample_and_record(logits, 0, n)
        self.stats.decode_seconds += time.perf_counter() - start

    def _sample_and_record(self, logits: torch.Tensor, lo: int, hi: int) -> None:
        """Sample slots lo..hi-1 from their logits rows, append, finish what is done."""
        tokens, logprobs = sample_tokens(logits, **self._slots.sampling_inputs(lo, hi, self.device))
        done = self._slots.record(lo, hi, tokens.tolist(), logprobs.tolist())
        self.stats.generated_tokens += hi - lo
        finished = [(self._slots.running[slot], reason) for slot, reason in done]
        if self._prefiller.history.capacity > 0:
            for (slot, _), (sample, _) in zip(done, finished, strict=True):
                # k/v of the prompt and every sampled token fed back (not the last one)
                self._prefiller.park(slot, sample.request.prompt + sample.tokens[:-1])
        self._slots.remove([slot for slot, _ in done], self.cache.move_slot)
        # Completing wakes the callers' event loop, whose Python work (env steps, rendering) then
        # competes for the GIL with every torch call this thread makes: so copies first.
        for sample, reason in finished:
            self._complete(sample, reason)

    def _complete(self, sample: Sample, reason: str) -> None:
        # The sample has left the slots: if this fails, only its own request can hear of it
        # (_fail_all no longer sees it, nor the other samples finishing in this step).
        request = sample.request
        try:
            text = self._decode_text(sample.tokens) if self._decode_text is not None else ""
        except Exception as error:
            return resolve_future(request.future, exception=error)
        request.results[sample.index] = Completion(
            tokens=sample.tokens,
            logprobs=sample.logprobs,
            finish_reason=reason,  # type: ignore[arg-type]
            text=text,
            policy_version=sample.version,
        )
        request.unfinished -= 1
        if not request.unfinished:
            resolve_future(request.future, result=request.results)


__all__ = ["ContextOverflowError", "EngineStats", "TorchEngine"]
