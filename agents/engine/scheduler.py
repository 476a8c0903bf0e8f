"""The torch engine's scheduler: admission, prefill, decode steps and completion of requests.

`step(admit)` is one turn of the engine: drop what callers cancelled, admit waiting samples into
free slots (one prefill forward per chunk of admissions; the n samples of a prompt share one
prefill row; prompts that continue a kept history prefill only their new tokens), then advance
every running sample by one token. Finished samples free their slot at once and their request's
future is resolved when its last sample finishes.

Not thread-safe: the engine (agents/engine/engine.py) calls it from one thread at a time, under its lock.
If a step raises, everything in flight (waiting, being admitted, running) fails with that error
and the kept k/v are dropped; the scheduler itself stays usable.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import msgspec
import torch

from ..errors import resolve_future
from ..model.chunks import padded_chunks
from ..types import Completion, Routes
from .decode import DecodeGraphs
from .kv_cache import KVCache
from .prefill import Prefiller
from .routes import RouteRecorder
from .sampling import sample_tokens
from .slots import Request, Sample, Slots

# An admitted group (request, first sample, samples) and its kept history's (pool start, length),
# or None for a fresh prefill.
_Claimed = tuple[tuple[Request, int, int], tuple[int, int] | None]


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


class Scheduler:
    def __init__(
        self,
        cache: KVCache,
        prefiller: Prefiller,
        decoder: DecodeGraphs,
        *,
        max_batch_size: int,
        max_prefill_tokens: int,
        continuous_batching: bool,
        device: torch.device,
        decode_text: Callable[[list[int]], str] | None,
        policy_version: int,
        routes: RouteRecorder | None = None,
    ) -> None:
        self.cache, self.prefiller, self.decoder = cache, prefiller, decoder
        self.max_prefill_tokens = max_prefill_tokens
        self.continuous_batching = continuous_batching
        self.device = device
        self.decode_text = decode_text
        self.routes = routes  # each finished sample's routing, read from its slot (or None)
        self.policy_version = policy_version  # the version new samples are drawn from
        self.stats = EngineStats()
        self.slots = Slots(max_batch_size)  # running samples, slot i = self.slots.running[i]
        self.waiting: deque[Request] = deque()
        self._admitting: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.slots.running or self.waiting)

    def retag(self, version: int) -> None:
        """New weights, loaded between steps with samples running (in flight): new samples are
        drawn from `version`, and the running ones' next tokens are recorded as its."""
        self.policy_version = version
        for sample in self.slots.running:
            sample.version_changes.append((len(sample.tokens), version))

    def enqueue(self, requests: list[Request]) -> None:
        self.waiting.extend(requests)
        self.stats.requests += len(requests)

    def step(self, admit: bool = True) -> None:
        """Drop cancelled requests, admit waiting ones (if `admit`), then one decode step."""
        try:
            with torch.inference_mode():
                self._drop_cancelled()
                if admit and (self.continuous_batching or not self.slots.running):
                    self._admit()
                if self.slots.running:
                    self._decode_step()
        except Exception as error:  # fail what is in flight, keep serving
            self.fail_all(error)

    def fail_all(self, error: BaseException) -> None:
        """Fail every request in flight (waiting, being admitted, running) with `error`."""
        requests = {id(s.request): s.request for s in self.slots.running}
        requests.update((id(r), r) for r in (*self.waiting, *self._admitting))
        self.slots.running.clear()
        self.waiting.clear()
        self._admitting = []
        # A failed prefill may have claimed kept histories it never copied back, or stored part
        # of a prefix: start the kept k/v afresh rather than trust them.
        self.prefiller.forget()
        for r in requests.values():
            resolve_future(r.future, exception=error)

    def _drop_cancelled(self) -> None:
        if any(r.future.cancelled() for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if not r.future.cancelled())
        gone = [i for i, s in enumerate(self.slots.running) if s.request.future.cancelled()]
        self.slots.remove(gone, self.cache.move_slot)

    # ---- admission + prefill --------------------------------------------------------------------
    def _admit(self) -> None:
        groups: list[tuple[Request, int, int]] = []  # (request, first sample index, count)
        free = self.slots.free
        while self.waiting and free:
            request = self.waiting[0]
            count = min(free, request.unadmitted)
            groups.append((request, request.params.n - request.unadmitted, count))
            request.unadmitted -= count
            free -= count
            if not request.unadmitted:
                self.waiting.popleft()
        # Out of the queue, not yet running: a prefill that raises must fail these too.
        self._admitting = [request for request, _, _ in groups]
        # Next turns of finished samples' conversations prefill only their new tokens.
        claims: list[tuple[int, int] | None] = [None] * len(groups)
        if len(self.prefiller.history):
            claims = [self.prefiller.history.claim(g[0].prompt) if g[2] == 1 else None for g in groups]
        continuing: list[_Claimed] = [(g, c) for g, c in zip(groups, claims, strict=True) if c is not None]
        fresh: list[_Claimed] = [(g, None) for g, c in zip(groups, claims, strict=True) if c is None]

        def runs(item: tuple) -> int:  # the prompt tokens its prefill computes
            (request, _, _), claim = item
            return len(request.prompt) - (claim[1] if claim else 0)

        for batch in (continuing, fresh):
            for chunk in padded_chunks(batch, runs, self.max_prefill_tokens):
                self._prefill(chunk)
        self._admitting = []

    def _prefill(self, chunk: list[_Claimed]) -> None:
        """Prefill one chunk: all fresh (claim None) or all continuing a kept history."""
        start = time.perf_counter()
        groups = [group for group, _ in chunk]
        prompts = [request.prompt for request, _, _ in groups]
        lengths = [len(p) for p in prompts]
        first = len(self.slots)
        if chunk[0][1] is not None:
            claims = [claim for _, claim in chunk if claim is not None]  # every one: a continuing chunk
            logits, saved = self.prefiller.continue_(prompts, claims, first)
            self.stats.history_tokens += saved
        else:
            logits, saved = self.prefiller(prompts, [count for _, _, count in groups], first)
            self.stats.shared_prefix_tokens += saved
        self.stats.prefill_forwards += 1
        self.stats.prompt_tokens += sum(lengths)
        for (request, first_sample, count), length in zip(groups, lengths, strict=True):
            for j in range(first_sample, first_sample + count):
                self.slots.add(Sample(request, j, self.policy_version), length)
        self.stats.max_running = max(self.stats.max_running, len(self.slots))
        self._sample_and_record(logits, first, len(self.slots))
        self.stats.prefill_seconds += time.perf_counter() - start

    # ---- decode ---------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        start = time.perf_counter()
        slots, n = self.slots, len(self.slots)
        logits = self.decoder.forward(slots.next[:n], slots.pos[:n])
        self.stats.decode_steps += 1
        slots.pos[:n] += 1
        self._record(0, n, *self.decoder.sample(logits, slots.sampling_arrays(0, n)))
        self.stats.decode_seconds += time.perf_counter() - start

    def _sample_and_record(self, logits: torch.Tensor, lo: int, hi: int) -> None:
        """Sample slots lo..hi-1 from their logits rows, then `_record`."""
        self._record(lo, hi, *sample_tokens(logits, **self.slots.sampling_inputs(lo, hi, self.device)))

    def _record(self, lo: int, hi: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Append slots lo..hi-1's sampled tokens, finish what is done."""
        done = self.slots.record(lo, hi, tokens.tolist(), logprobs.tolist())
        self.stats.generated_tokens += hi - lo
        finished = [(self.slots.running[slot], reason) for slot, reason in done]
        # The routing of every position the model ran: the prompt and each sampled token but the last.
        routes = [
            self.routes.read(slot, len(sample.request.prompt) + len(sample.tokens) - 1)
            if self.routes is not None
            else None
            for (slot, _), (sample, _) in zip(done, finished, strict=True)
        ]
        if self.prefiller.history.capacity > 0:
            for (slot, _), (sample, _) in zip(done, finished, strict=True):
                # k/v of the prompt and every sampled token fed back (not the last one); not
                # where weights changed in flight: part of those k/v are the old weights'
                if not sample.version_changes:
                    self.prefiller.park(slot, sample.request.prompt + sample.tokens[:-1])
        self.slots.remove([slot for slot, _ in done], self.cache.move_slot)
        # With a worker thread, completing wakes the callers' event loop, whose Python work (env
        # steps, rendering) then competes for the GIL with every torch call made here: copies first.
        for (sample, reason), sample_routes in zip(finished, routes, strict=True):
            self._complete(sample, reason, sample_routes)

    def _complete(self, sample: Sample, reason: str, routes: Routes | None = None) -> None:
        # The sample has left the slots: if this fails, only its own request can hear of it
        # (fail_all no longer sees it, nor the other samples finishing in this step).
        request = sample.request
        try:
            text = self.decode_text(sample.tokens) if self.decode_text is not None else ""
        except Exception as error:
            return resolve_future(request.future, exception=error)
        request.results[sample.index] = Completion(
            tokens=sample.tokens,
            logprobs=sample.logprobs,
            finish_reason=reason,  # type: ignore[arg-type]
            text=text,
            policy_version=sample.version,
            token_versions=sample.token_versions(),
            routes=routes,
        )
        request.unfinished -= 1
        if not request.unfinished:
            resolve_future(request.future, result=request.results)


__all__ = ["EngineStats", "Scheduler"]
