"""EngineReplicas: N TorchEngines in N worker processes, one CPU core each (implements `Policy`).

Why: a CPU decode step of a small model is a few hundred small ops whose cost is per-op overhead
and memory latency, not FLOPs, so one intra-op thread decodes about as fast as two and the second
core of a process mostly waits. Two engines in two processes, one thread each, decode two halves
of a batch at once, faster than one engine on both cores; two engines on two threads of one
process are slower still, as the GIL serialises the Python between their ops (bench/RESULTS.md,
'bench/generate.py --replicas').

- Requests: a `generate` call's prompts are dealt to the replicas one prompt at a time, each to
  the replica with the fewest samples in flight; the n samples of a prompt stay on one replica,
  so they share its prefill. Calls made together reach a replica together and are batched there
  as in one TorchEngine. Results come back prompt-major, as from one engine. With
  `SamplingParams.seed` the samples are those one TorchEngine would draw (the draws depend on
  (seed, sample, step) only); without one, each replica draws request seeds from its own
  generator (`seed + replica`).
- Prompts are checked here (empty, too long, unknown ids) with the errors a TorchEngine raises,
  before anything is sent.
- Weights: this process keeps the model's parameters in shared memory. `load_weights` copies the
  new tensors into them and every replica then loads them into its own engine (as
  TorchEngine.load_weights, with the engines' `weight_updates`: running samples finish first, or
  go on with the new weights), in parallel; it returns when all have.
- A replica that fails or exits fails its requests in flight with a RuntimeError that says so;
  `close` (or leaving the `with` block, or the interpreter exiting) ends every worker.

A conversation's next turn may go to another replica than the one that keeps its k/v, which then
prefills it in full: correct, only slower.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
import traceback
import weakref
from collections.abc import Iterable
from typing import Any

import msgspec
import torch
import torch.multiprocessing as mp

from ..errors import checked_prompt, checked_weights, resolve_future
from ..model.transformer import Transformer
from ..types import Completion, SamplingParams
from .scheduler import EngineStats

_START_TIMEOUT_S = 300.0


class EngineReplicas:
    """`replicas` TorchEngines, each in its own process with `threads_per_replica` torch threads
    (default: this process's threads // replicas, at least 1). `engine_kwargs` go to every
    TorchEngine (max_batch_size, max_seq_len, dtype, backend, ...: per replica); `seed` seeds
    replica r with seed + r. `tokenizer` must be picklable (a `tokenizers.Tokenizer` is). CPU only."""

    def __init__(
        self,
        model: Transformer,
        *,
        replicas: int = 2,
        threads_per_replica: int | None = None,
        seed: int = 0,
        policy_version: int = 0,
        **engine_kwargs: Any,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if str(engine_kwargs.get("device", model.device)).startswith("cuda"):
            raise ValueError("EngineReplicas runs CPU engines; on a GPU use one TorchEngine")
        self.config = model.config
        self.policy_version = policy_version
        self.backend = engine_kwargs.get("backend")  # None: each replica selects its own default
        threads = threads_per_replica or max(1, torch.get_num_threads() // replicas)
        self.threads_per_replica = threads
        # Shared-memory copies of the parameters (a tied pair stays one tensor under both names).
        by_param: dict[int, torch.Tensor] = {}
        self._shared = {
            name: by_param.setdefault(id(p), p.detach().clone().share_memory_())
            for name, p in model.named_parameters(remove_duplicate=False)
        }
        self._calls = itertools.count()
        self._lock = threading.Lock()
        self._pending: list[dict[int, concurrent.futures.Future]] = [{} for _ in range(replicas)]
        self._in_flight = [0] * replicas
        self._stats = [EngineStats() for _ in range(replicas)]
        self._send_locks = [threading.Lock() for _ in range(replicas)]
        self._closed = False
        context = mp.get_context("spawn")
        self._connections, self._processes = [], []
        for r in range(replicas):
            parent_end, child_end = context.Pipe()
            kwargs = dict(engine_kwargs, seed=seed + r, policy_version=policy_version)
            process = context.Process(
                target=_serve,
                args=(child_end, self.config, self._shared, kwargs, threads),
                name=f"toolgym-engine-{r}",
                daemon=True,
            )
            process.start()
            child_end.close()
            self._connections.append(parent_end)
            self._processes.append(process)
        self._finalizer = weakref.finalize(self, _stop, self._connections, self._processes)
        for r, connection in enumerate(self._connections):  # each replica says it is ready
            if not connection.poll(_START_TIMEOUT_S):
                self.close()
                raise RuntimeError(f"engine replica {r} did not start in {_START_TIMEOUT_S:.0f} s")
            try:
                _, max_seq_len, error, _ = connection.recv()
            except EOFError:
                error = f"exited with code {self._processes[r].exitcode}"
            if error is not None:
                self.close()
                raise RuntimeError(f"engine replica {r} failed to start: {_headline(error)}\n{error}")
            self.max_seq_len = max_seq_len  # the engines' own (their default when not given)
        for r in range(replicas):
            threading.Thread(
                target=self._read, args=(r,), name=f"toolgym-engine-{r}-reader", daemon=True
            ).start()

    @property
    def replicas(self) -> int:
        return len(self._processes)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (to watch their CPU time or memory)."""
        return [process.pid for process in self._processes]

    @property
    def stats(self) -> EngineStats:
        """The replicas' counters summed (as of each one's last reply)."""
        fields = EngineStats.__struct_fields__
        return EngineStats(**{f: sum(getattr(s, f) for s in self._stats) for f in fields})

    # ---- Policy ---------------------------------------------------------------------------------
    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * params.n Completions, prompt-major. Raises ContextOverflowError."""
        parts, futures = self._dispatch(prompts, params)
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        return _prompt_major(len(prompts), parts, results)

    def generate_sync(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        parts, futures = self._dispatch(prompts, params)
        return _prompt_major(len(prompts), parts, [f.result() for f in futures])

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy HF-named tensors into the shared parameters; every replica loads them (names and
        shapes checked first, nothing copied on a mismatch) before this returns."""
        updates = checked_weights(named_tensors, self._shared, self.config.model_type)
        with torch.no_grad():
            for name, tensor in updates:
                self._shared[name].copy_(tensor)
        names = [name for name, _ in updates]
        for future in [self._send(r, "load", names, version) for r in range(self.replicas)]:
            future.result()
        self.policy_version = version

    def close(self) -> None:
        """End every worker; requests in flight fail with RuntimeError."""
        with self._lock:
            self._closed = True
        self._finalizer()
        for r in range(self.replicas):
            self._fail(r, RuntimeError("EngineReplicas is closed"))

    def __enter__(self) -> EngineReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests and replies -------------------------------------------------------------------
    def _dispatch(self, prompts: list[list[int]], params: SamplingParams):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.config.vocab_size
        checked = [
            checked_prompt(i, p, max_seq_len=self.max_seq_len, vocab_size=vocab)
            for i, p in enumerate(prompts)
        ]
        parts: dict[int, list[int]] = {}
        with self._lock:
            load = list(self._in_flight)
        for i in range(len(checked)):
            r = min(range(self.replicas), key=load.__getitem__)
            parts.setdefault(r, []).append(i)
            load[r] += params.n
        futures = []
        for r, indices in parts.items():
            futures.append(
                self._send(
                    r, "generate", [checked[i] for i in indices], params, weight=len(indices) * params.n
                )
            )
        return list(parts.values()), futures

    def _send(self, r: int, kind: str, *payload: Any, weight: int = 0) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("EngineReplicas is closed")
            if not self._processes[r].is_alive():
                raise RuntimeError(f"engine replica {r} exited (code {self._processes[r].exitcode})")
            call = next(self._calls)
            self._pending[r][call] = future
            self._in_flight[r] += weight
        future.add_done_callback(lambda _: self._done(r, weight))
        # Not under _lock: a full pipe waits for the worker, whose replies need the reader, which
        # takes _lock.
        try:
            with self._send_locks[r]:
                self._connections[r].send((kind, call, *payload))
        except OSError as error:  # a broken pipe: the replica died after the check above
            self._processes[r].join(1)
            exited = RuntimeError(f"engine replica {r} exited (code {self._processes[r].exitcode})")
            with self._lock:
                self._pending[r].pop(call, None)
            resolve_future(future, exception=exited)
            raise exited from error
        return future

    def _done(self, r: int, weight: int) -> None:
        with self._lock:
            self._in_flight[r] -= weight

    def _read(self, r: int) -> None:
        connection = self._connections[r]
        while True:
            try:
                call, result, error, stats = connection.recv()
            except (EOFError, OSError):
                code = self._processes[r].exitcode
                self._fail(r, RuntimeError(f"engine replica {r} exited (code {code})"))
                return
            if stats is not None:
                self._stats[r] = stats
            with self._lock:
                future = self._pending[r].pop(call, None)
            if future is not None:
                if error is None:
                    resolve_future(future, result=result)
                else:
                    message = f"engine replica {r} failed: {_headline(error)}\n{error}"
                    resolve_future(future, exception=RuntimeError(message))

    def _fail(self, r: int, error: Exception) -> None:
        with self._lock:
            pending, self._pending[r] = self._pending[r], {}
        for future in pending.values():
            resolve_future(future, exception=error)


def _headline(remote_traceback: str) -> str:
    """The last line of a worker's traceback: the exception and its message."""
    lines = [line for line in remote_traceback.strip().splitlines() if line.strip()]
    return lines[-1] if lines else remote_traceback


def _prompt_major(count: int, parts: list[list[int]], results: list[list[Completion]]) -> list[Completion]:
    per_prompt: list[list[Completion]] = [[] for _ in range(count)]
    for indices, completions in zip(parts, results, strict=True):
        n = len(completions) // len(indices)
        for j, i in enumerate(indices):
            per_prompt[i] = completions[j * n : (j + 1) * n]
    return [c for group in per_prompt for c in group]


def _stop(connections: list, processes: list) -> None:
    for connection in connections:
        with contextlib.suppress(OSError, ValueError):  # already closed, or the worker is gone
            connection.send(("close", -1))
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
    for connection in connections:
        connection.close()


# ---- the worker process ---------------------------------------------------------------------------
def _serve(connection, config, shared: dict[str, torch.Tensor], engine_kwargs: dict, threads: int) -> None:
    """A replica: one TorchEngine driven by an event loop that reads requests from `connection`."""
    torch.set_num_threads(threads)
    try:
        from .engine import TorchEngine

        with torch.device("meta"):  # no initialisation: the weights are the shared ones
            model = Transformer(config)
        model.load_state_dict(shared, assign=True)
        model.tie_weights()
        engine = TorchEngine(model, **engine_kwargs)  # which copies them
    except BaseException:
        connection.send((-1, None, traceback.format_exc(), None))
        return
    connection.send((-1, engine.max_seq_len, None, None))
    try:
        asyncio.run(_serve_requests(connection, engine, shared))
    finally:
        engine.close()


async def _serve_requests(connection, engine, shared: dict[str, torch.Tensor]) -> None:
    loop = asyncio.get_running_loop()
    closing = asyncio.Event()
    tasks: set[asyncio.Task] = set()

    def reply(call: int, result: Any = None, error: str | None = None) -> None:
        connection.send((call, result, error, msgspec.structs.replace(engine.stats)))

    def finished(call: int, task: asyncio.Task) -> None:
        tasks.discard(task)
        if task.cancelled():
            return reply(call, error="cancelled")
        error = task.exception()
        if error is not None:
            return reply(call, error="".join(traceback.format_exception(error)))
        reply(call, task.result())

    def on_readable() -> None:
        while connection.poll():
            try:
                kind, call, *payload = connection.recv()
            except EOFError:  # the parent went away
                closing.set()
                return
            if kind == "close":
                closing.set()
                return
            if kind == "generate":
                task = loop.create_task(engine.generate(*payload))
                tasks.add(task)
                task.add_done_callback(lambda t, call=call: finished(call, t))
            elif kind == "load":
                names, version = payload
                try:
                    engine.load_weights([(name, shared[name]) for name in names], version)
                except Exception:
                    reply(call, error=traceback.format_exc())
                else:
                    reply(call)

    loop.add_reader(connection.fileno(), on_readable)
    await closing.wait()
    loop.remove_reader(connection.fileno())
    for task in tasks:
        task.cancel()


__all__ = ["EngineReplicas"]
