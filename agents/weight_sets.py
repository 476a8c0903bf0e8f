"""One policy serving several weight sets (a self-play run's own snapshots) one at a time.

    WeightSets(policy, live_tensors, version)
      .live            a Policy: the trainer's weights; syncs go through it (load_weights)
      .add(name, ...)  a stored set (HF-named tensors on the CPU, in the form the syncs send:
      .view(name)      the whole model, or the LoRA adapters alone) and a Policy that samples it

Every view samples through the one underlying policy (the torch engine or vLLM); a request of a
set that is not loaded waits until the loaded set's requests in flight finish, then the set is
swapped in with `policy.load_weights` (its own version, so its Completions carry it), and every
request of that set already waiting runs together. A set's requests that arrive while another
set waits are held back (first come, first swapped in), so no set starves. The swap is the policy's ordinary weight load: the
engine drops its cached prefixes and histories, which were computed by other weights.

The trainer's syncs go to `live.load_weights`: a CPU copy is kept (to swap back to) and, when
live is loaded, applied at once. Callers that use the underlying policy directly (an eval) must
do so only while `live` is loaded: `restore_live()` swaps it back once nothing is in flight.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Mapping

import torch

from .model.lora import AppliedAdapter
from .policy import Policy
from .types import Completion, SamplingParams

LIVE = "live"


def _cpu_copy(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in named_tensors}


class WeightSets:
    """Named weight sets sampled by one policy, swapped in as their requests come (module doc)."""

    def __init__(self, policy: Policy, live: Mapping[str, torch.Tensor], version: int) -> None:
        """`live`: the weights `policy` holds now, in the form the trainer's syncs carry (the
        whole model, or the LoRA adapters alone), at `version`."""
        self.policy = policy
        self._sets: dict[str, tuple[dict[str, torch.Tensor], int]] = {
            LIVE: (_cpu_copy(live.items()), version)
        }
        self._loaded = LIVE
        self._in_flight = 0
        self._waiting: dict[int, str] = {}  # ticket -> set, in arrival order
        self._tickets = itertools.count()
        # the last ticket issued, and the last one issued when the loaded set was swapped in
        self._issued = self._phase_ticket = -1
        self._condition: asyncio.Condition | None = None
        self._condition_loop: asyncio.AbstractEventLoop | None = None
        self.swaps = 0
        self.live = SetPolicy(self, LIVE)

    # ---- the sets -------------------------------------------------------------------------
    @property
    def loaded(self) -> str:
        return self._loaded

    def names(self) -> list[str]:
        return [name for name in self._sets if name != LIVE]

    def add(self, name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SetPolicy:
        """Store a set (copied to the CPU); its view."""
        if name == LIVE or name in self._sets:
            raise ValueError(f"weight set {name!r} exists already")
        self._sets[name] = (_cpu_copy(named_tensors), version)
        return SetPolicy(self, name)

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """A set's stored tensors (CPU; not to be modified)."""
        return self._sets[name][0]

    def remove(self, name: str) -> None:
        """Drop a stored set; it must not be loaded or have requests waiting."""
        if name == LIVE:
            raise ValueError("the live set cannot be removed")
        if name == self._loaded or name in self._waiting.values():
            raise RuntimeError(f"weight set {name!r} is in use")
        del self._sets[name]

    def view(self, name: str) -> SetPolicy:
        if name not in self._sets:
            raise KeyError(f"no weight set {name!r}: the sets are {list(self._sets)}")
        return SetPolicy(self, name)

    def version(self, name: str) -> int:
        return self._sets[name][1]

    def restore_live(self) -> None:
        """Swap the live weights back in (nothing may be in flight): before the underlying policy
        is used directly (an eval) or given new weights another way."""
        if self._in_flight:
            raise RuntimeError("restore_live with requests in flight")
        if self._loaded != LIVE:
            self._load(LIVE)

    def load_live(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """A sync of the trainer's weights: kept, and applied at once when live is loaded."""
        if self._loaded != LIVE and self._in_flight:  # refused before anything is kept
            raise RuntimeError("a sync of the live weights while another set's requests are in flight")
        tensors = list(named_tensors)
        kept = self._sets[LIVE][0]  # a sync may carry part of the set (adapters after a full one)
        with torch.no_grad():
            for name, tensor in tensors:
                held = kept.get(name)
                if held is not None and held.shape == tensor.shape and held.dtype == tensor.dtype:
                    held.copy_(tensor)  # in place: no new CPU copy of the model per sync
                else:
                    kept[name] = tensor.detach().to("cpu", copy=True)
        self._sets[LIVE] = (kept, version)
        if self._loaded == LIVE:
            self.policy.load_weights(tensors, version)
        else:
            self._load(LIVE)

    # ---- sampling -------------------------------------------------------------------------
    async def generate(self, name: str, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample `prompts` with set `name`, once its turn comes (module doc)."""
        if name not in self._sets:
            raise KeyError(f"no weight set {name!r}")
        condition = self._get_condition()
        ticket = self._issued = next(self._tickets)
        async with condition:
            self._waiting[ticket] = name
            try:
                await condition.wait_for(lambda: self._may_run(name, ticket))
            finally:
                del self._waiting[ticket]
                condition.notify_all()  # a request given up on (cancelled) must not hold the others
            if self._loaded != name:
                self._load(name)
                self._phase_ticket = self._issued  # its requests waiting now all run in this phase
            self._in_flight += 1
            condition.notify_all()  # the set's other waiters may run now
        try:
            return await self.policy.generate(prompts, params)
        finally:
            async with condition:
                self._in_flight -= 1
                condition.notify_all()

    def _may_run(self, name: str, ticket: int) -> bool:
        """The loaded set's requests run while no other set waits, and those that were waiting
        when it was swapped in run even then; another set is swapped in when nothing is in
        flight and none of those is left, the one whose request came first."""
        foreign = [t for t, n in self._waiting.items() if n != self._loaded]
        if name == self._loaded:
            return not foreign or ticket <= self._phase_ticket
        if self._in_flight or any(
            n == self._loaded and t <= self._phase_ticket for t, n in self._waiting.items()
        ):
            return False
        return ticket == min(foreign)

    def _load(self, name: str) -> None:
        tensors, version = self._sets[name]
        self.policy.load_weights(tensors.items(), version)
        self._loaded = name
        self.swaps += 1

    def _get_condition(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        if self._condition is None or self._condition_loop is not loop:
            if self._in_flight or self._waiting:
                raise RuntimeError("WeightSets used from two event loops at once")
            self._condition, self._condition_loop = asyncio.Condition(), loop
        return self._condition


class SetPolicy:
    """One weight set of a `WeightSets` as a Policy. The live set's `load_weights` is the
    trainer's sync; a stored set's weights are fixed."""

    def __init__(self, sets: WeightSets, name: str) -> None:
        self.sets, self.name = sets, name

    @property
    def policy_id(self) -> str:
        return f"weights:{self.name}"

    @property
    def policy_version(self) -> int:
        return self.sets.version(self.name)

    @property
    def max_seq_len(self) -> int | None:
        return self.sets.policy.max_seq_len

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return await self.sets.generate(self.name, prompts, params)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self.name != LIVE:
            raise TypeError(f"weight set {self.name!r} is a fixed snapshot; only the live set takes syncs")
        self.sets.load_live(named_tensors, version)

    def applied_adapter(self) -> AppliedAdapter | None:
        """The underlying policy's (trainers/weight_sync.py checks it after each live sync)."""
        report = getattr(self.sets.policy, "applied_adapter", None)
        return None if report is None else report()

    def close(self) -> None:
        """The underlying policy is closed by its owner."""


__all__ = ["LIVE", "SetPolicy", "WeightSets"]
