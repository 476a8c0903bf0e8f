"""Every way the trainer's new weights reach a policy (any `Policy`: torch engine or vLLM).

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

from ..agents.policy import Policy
from .distributed import Channel

if TYPE_CHECKING:
    from .trainer import Trainer


@torch.no_grad()
def gather_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The whole model's weights on the trainer's device, HF names. Collective (all ranks call).

    With one rank the shards are the whole tensors, so nothing is copied.
    """
    single = trainer.dist.world_size == 1
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in trainer.model.state_dict().items():
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
        policy.load_weights(weights.items(), trainer.step if version is None else version)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    return time.perf_counter() - start


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
