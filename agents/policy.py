"""The policy interface every generation backend implements (torch engine, vLLM)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from .types import Completion, SamplingParams


@runtime_checkable
class Policy(Protocol):
    """An async token-in, token-out sampler with swappable weights.

    `generate` returns `len(prompts) * params.n` Completions in prompt-major order:
    [p0 s0, p0 s1, ..., p0 s(n-1), p1 s0, ...]. Concurrent calls may be served in one batch.
    `load_weights` takes Hugging Face-named tensors (the names `save_hf_checkpoint` writes) and
    the new policy version; later samples use the new weights and carry the new version.
    `max_seq_len` is the longest sequence (prompt + completion) it takes, or None for a policy
    with no bound of its own (a scripted one): the rollout runner and the endpoint cap every
    request's room by it.
    A policy that serves LoRA adapters (agents/model/lora.py) also has `applied_adapter()`,
    returning the version and checksum of the adapters it holds (an `AppliedAdapter`), which
    every adapter sync checks (trainers/weight_sync.py).
    """

    @property
    def policy_version(self) -> int:
        """The version of the weights new samples are drawn with (set by `load_weights`)."""
        ...

    @property
    def max_seq_len(self) -> int | None:
        """The longest prompt + completion this policy takes; None: no bound of its own."""
        ...

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def close(self) -> None: ...
