"""The torch engine's running samples: one KV-cache slot each, and their sampling state.

A request (one prompt, `n` samples) becomes `n` samples; each running sample owns one slot of
the KV cache (agents/engine/kv_cache.py), and running samples always fill slots 0..len-1, so a decode
step reads the cache block [:n] in place. `Slots` keeps, per slot, what the next decode step and
the sampler need as host arrays (position, last token, seed, step, temperature, top-p, top-k),
records each sampled token, says which samples are done, and closes the holes they leave by
moving the last running sample into each (the caller moves its k/v with it).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..types import Completion, SamplingParams
from .sampling import draw_keys, draws_from_keys, sampling_tensors


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    seed: int
    future: concurrent.futures.Future
    stop_ids: frozenset[int]
    limit: int  # max completion tokens: min(max_tokens, max_seq_len - len(prompt))
    results: list[Completion | None] = field(default_factory=list)
    unadmitted: int = 0
    unfinished: int = 0


@dataclass(eq=False)
class Sample:
    request: Request
    index: int  # which of the request's n samples
    version: int  # the policy version that samples it
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # (token index, version) from where weights loaded in flight sample it (Scheduler.retag)
    version_changes: list[tuple[int, int]] = field(default_factory=list)

    def token_versions(self) -> list[int]:
        """Per token, the version that sampled it; [] when one version sampled them all."""
        if not self.version_changes:
            return []
        versions = [self.version] * len(self.tokens)
        for start, version in self.version_changes:
            versions[start:] = [version] * (len(self.tokens) - start)
        return versions


class Slots:
    """Running samples in slots 0..len-1 with their per-slot sampling state (slot i = running[i])."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.running: list[Sample] = []
        self.pos = np.zeros(capacity, np.int64)  # where the slot's next input token goes
        self.next = np.zeros(capacity, np.int64)  # the slot's next input token (last sampled)
        self.seed = np.zeros(capacity, np.uint64)
        self.sample_index = np.zeros(capacity, np.uint64)
        self.draw_key = np.zeros(capacity, np.uint64)  # `draw_keys` of (seed, sample index)
        self.step = np.zeros(capacity, np.uint64)  # tokens sampled so far
        self.temperature = np.zeros(capacity, np.float32)
        self.top_p = np.ones(capacity, np.float32)
        self.top_k = np.zeros(capacity, np.int64)
        self._flags: dict[tuple[int, int], dict] = {}  # sampling flags per slot range, until add/remove

    def __len__(self) -> int:
        return len(self.running)

    @property
    def free(self) -> int:
        return self.capacity - len(self.running)

    def add(self, sample: Sample, prompt_length: int) -> None:
        """Run `sample` in the next slot, its prompt's k/v already there (positions 0..length-1)."""
        slot = len(self.running)
        self.running.append(sample)
        self._flags.clear()
        request, params = sample.request, sample.request.params
        self.pos[slot], self.seed[slot], self.sample_index[slot], self.step[slot] = (
            prompt_length,
            request.seed,
            sample.index,
            0,
        )
        self.draw_key[slot] = draw_keys(self.seed[slot : slot + 1], self.sample_index[slot : slot + 1])[0]
        self.temperature[slot], self.top_p[slot], self.top_k[slot] = (
            params.temperature,
            params.top_p,
            params.top_k,
        )

    def sampling_arrays(self, lo: int, hi: int) -> dict:
        """Slots lo..hi-1's sampling parameters and draws as host arrays, with the flags
        `sample_tokens` takes (agents/engine/sampling.py). The flags are kept per range until the slots
        change, and each sample's draw key is hashed once: a decode step hashes only the steps."""
        temperature, top_p, top_k = self.temperature[lo:hi], self.top_p[lo:hi], self.top_k[lo:hi]
        flags = self._flags.get((lo, hi))
        if flags is None:
            greedy = temperature == 0
            flags = self._flags[(lo, hi)] = dict(
                any_filter=bool(((top_k > 0) | (top_p < 1)).any()),
                any_greedy=bool(greedy.any()),
                all_greedy=bool(greedy.all()),
                any_scaled=bool(((temperature != 0) & (temperature != 1)).any()),
            )
        u = draws_from_keys(self.draw_key[lo:hi], self.step[lo:hi])
        return dict(temperature=temperature, top_k=top_k, top_p=top_p, u=u, **flags)

    def sampling_inputs(self, lo: int, hi: int, device: torch.device) -> dict:
        """`sample_tokens` keyword arguments for slots lo..hi-1: `sampling_arrays` on `device`."""
        return sampling_tensors(self.sampling_arrays(lo, hi), device)

    def record(self, lo: int, hi: int, tokens: list[int], logprobs: list[float]) -> list[tuple[int, str]]:
        """Append slots lo..hi-1's sampled tokens; returns the (slot, finish reason) of those done."""
        self.step[lo:hi] += 1
        self.next[lo:hi] = tokens
        done: list[tuple[int, str]] = []
        for slot, sample, token, logprob in zip(
            range(lo, hi), self.running[lo:hi], tokens, logprobs, strict=True
        ):
            sample.tokens.append(token)
            sample.logprobs.append(logprob)
            if token in sample.request.stop_ids:
                done.append((slot, "stop"))
            elif len(sample.tokens) >= sample.request.limit:
                done.append((slot, "length"))
        return done

    def remove(self, slots: list[int], move: Callable[[int, int, int], None]) -> None:
        """Free `slots`; the last running sample moves into each hole, so slots stay 0..n-1.
        move(source, target, length) moves a running sample's first `length` cache positions."""
        self._flags.clear()
        arrays = (
            self.pos,
            self.next,
            self.seed,
            self.sample_index,
            self.draw_key,
            self.step,
            self.temperature,
            self.top_p,
            self.top_k,
        )
        for slot in sorted(slots, reverse=True):
            last = len(self.running) - 1
            if slot != last:
                move(last, slot, int(self.pos[last]))
                for a in arrays:
                    a[slot] = a[last]
                self.running[slot] = self.running[last]
            self.running.pop()


__all__ = ["Request", "Sample", "Slots"]
