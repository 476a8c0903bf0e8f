"""Every way the trainer's new weights reach a policy (any `Policy`: torch engine or vLLM).

- With LoRA (agents/model/lora.py) every path sends the adapters only, after a first full sync
where the policy's base is another copy (generator processes), and each load is checked:
`check_adapters` compares the version and checksum the policy reports applying with the trainer's.
- `push_weights`: into a policy in this process. In process, no disk: the sharded parameters are gathered whole (HF names, the tied lm_head
dropped as in a HF checkpoint) and handed to `policy.load_weights(named_tensors, version)`,
which copies them into the policy's own weights (casting to its dtype) and, for vLLM,
resets the prefix cache. The version is the trainer's step (the number of applied updates).
- To generators in other processes (trainers/loop/generators.py): `SharedWeights`, one flat float32
  buffer in a shared-memory file that generator processes on this machine map, or
  `broadcast_weights` over the channel (trainers/distributed.py) to generator ranks anywhere;
  `flat_weights` / `unflatten_weights` turn named tensors into that one buffer and back.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ..agents.model.lora import adapter_checksum, has_lora, is_adapter_name
from ..agents.policy import Policy
from .distributed import Channel

if TYPE_CHECKING:
    from .trainer import Trainer


class AdapterSyncError(RuntimeError):
    """The policy did not apply the LoRA adapters the trainer sent (version or checksum differ)."""


@torch.no_grad()
def gather_weights(trainer: Trainer, full: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights on the trainer's device, HF names. Collective (all ranks call).

    With LoRA (agents/model/lora.py) only the adapters (`...q_proj.lora_A.weight`, ...), as the
    base is frozen and the policy holds the same one, unless `full` (the first sync to a policy
    built from another copy of the base, e.g. a generator process). With one rank the shards are
    the whole tensors, so nothing is copied.
    """
    single = trainer.dist.world_size == 1
    adapters_only = not full and has_lora(trainer.model)
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in trainer.model.state_dict().items():
        if adapters_only and not is_adapter_name(name):
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local() if single else tensor.full_tensor()
        weights[name] = tensor.detach()
    if getattr(trainer.model_config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    return weights


def push_weights(trainer: Trainer, policy: Policy | None, version: int | None = None) -> float:
    """Gather the weights and load them into `policy` (pass None on ranks without a policy).

    Collective. Returns the wall time of the whole sync in seconds (device work included).
    """
    start = time.perf_counter()
    weights = gather_weights(trainer)
    if policy is not None:
        load_and_check(policy, weights, trainer.step if version is None else version)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    return time.perf_counter() - start


def load_and_check(policy: Policy, weights: Mapping[str, torch.Tensor], version: int) -> None:
    """`policy.load_weights(weights, version)`, then, when `weights` hold LoRA adapters,
    `check_adapters`."""
    policy.load_weights(weights.items(), version)
    if any(is_adapter_name(name) for name in weights):
        check_adapters(policy, weights, version)


def check_adapters(policy: Policy, weights: Mapping[str, torch.Tensor], version: int) -> None:
    """The invariant of an adapter sync: the policy reports (`applied_adapter()`, e.g.
    TorchEngine's) the version it applied and the checksum of its own adapter weights, and both
    equal the trainer's (`adapter_checksum` of the adapters sent, rounded to the policy's adapter
    dtype); else AdapterSyncError, one line naming both versions."""
    report = getattr(policy, "applied_adapter", None)
    if report is None:
        raise AdapterSyncError(f"{type(policy).__name__} cannot report the LoRA adapters it applied")
    applied = report()
    adapters = [(n, t) for n, t in weights.items() if is_adapter_name(n)]
    if applied is None:
        raise AdapterSyncError(
            f"LoRA adapter sync failed: the trainer sent version {version}, the policy applied no adapters"
        )
    expected = adapter_checksum(adapters, applied.dtype)
    if (applied.version, applied.checksum) != (version, expected):
        raise AdapterSyncError(
            f"LoRA adapter sync failed: the trainer sent version {version} (checksum {expected}), "
            f"the policy applied version {applied.version} (checksum {applied.checksum})"
        )


def flat_weights(
    weights: Mapping[str, torch.Tensor],
) -> tuple[list[str], list[list[int]], list[torch.Tensor]]:
    """(names, shapes, each tensor as a flat float32 CPU tensor): the parts of one flat buffer."""
    names = list(weights)
    shapes = [list(weights[n].shape) for n in names]
    parts = [weights[n].detach().reshape(-1).to("cpu", torch.float32) for n in names]
    return names, shapes, parts


def numel_of(shapes: Sequence[Sequence[int]]) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def unflatten_weights(
    flat: torch.Tensor, names: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[tuple[str, torch.Tensor]]:
    """Named views of `flat`, in `names`' order (the inverse of `flat_weights`)."""
    tensors, offset = [], 0
    for name, shape in zip(names, shapes, strict=True):
        size = numel_of([shape])
        tensors.append((name, flat[offset : offset + size].view(list(shape))))
        offset += size
    return tensors


def broadcast_weights(channel: Channel, parts: Sequence[torch.Tensor] | None, numel: int) -> torch.Tensor:
    """Member 0's flat weights (`parts`) on every member of the channel (the others pass None)."""
    if parts is not None:
        return channel.broadcast(torch.cat(list(parts)))
    return channel.broadcast(torch.empty(numel, dtype=torch.float32))


class SharedWeights:
    """One flat float32 buffer in a shared-memory file, mapped by the trainer and by generator
    processes on the same machine. The file is unlinked once every generator has mapped it (the
    mappings stay), so a run leaves none behind unless it dies in between."""

    def __init__(self, numel: int, path: str = "") -> None:
        self.owner = not path
        if self.owner:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            path = os.path.join(folder, f"toolgym-weights-{os.getpid()}-{time.monotonic_ns()}")
        self.path, self.numel = path, numel
        self.buffer = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)

    def unlink(self) -> None:
        if self.owner and os.path.exists(self.path):
            os.unlink(self.path)
