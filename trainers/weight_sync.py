"""Push the trainer's new weights into the policy (any `Policy`: torch engine or vLLM).

In process, no disk: the sharded parameters are gathered whole (HF names, the tied lm_head
dropped as in a HF checkpoint) and handed to `policy.load_weights(named_tensors, version)`,
which copies them into the policy's own weights (casting to its dtype) and, for vLLM,
resets the prefix cache. The version is the trainer's step (the number of applied updates).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ..agents.policy import Policy

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
