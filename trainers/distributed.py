"""Process group and FSDP2 wrapping: torchrun (gloo on CPU, NCCL on GPU) or one plain process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | torch.device | None = None) -> DistInfo:
    """Join the process group torchrun describes, or make a one-process group when run plainly.

    Under torchrun (RANK/WORLD_SIZE set) this is init_process_group(env://) with gloo for CPU
    tensors and NCCL for CUDA ones. Without torchrun it is a world of one on an in-memory store,
    so FSDP2 and every collective below work unchanged. Calling it again reuses the group.
    device: "cpu", "cuda" or None (CUDA when available).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank if device.index is None else device.index)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def device_mesh(info: DistInfo) -> DeviceMesh:
    return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp",))


def shard_model(model: nn.Module, mesh: DeviceMesh, precision: str = "fp32") -> nn.Module:
    """`fsdp_wrap(model, ...)`, except in a world of one, where the model is returned as it is:
    there FSDP2 does not shard, only copies every parameter and gradient each step
    (bench/RESULTS.md, "bench/sft_step.py"). For bf16 the Trainer then runs its forwards under
    `torch.autocast` (bf16 matmuls and attention, fp32 weights and residual stream), faster on CPU
    than FSDP2's bf16 parameters (bench/RESULTS.md, "bench/vs_trl.py")."""
    if mesh.size() == 1:
        return model
    return fsdp_wrap(model, mesh, precision)


def fsdp_wrap(model: nn.Module, mesh: DeviceMesh, precision: str = "fp32") -> nn.Module:
    """FSDP2: one unit per decoder block (`model.model.layers[i]`) and the root (embeddings, head).

    bf16: parameters are gathered and computed in bf16, gradients reduced in fp32, and the sharded
    master weights (and so the optimizer) stay fp32. Gradients are summed across ranks, not
    averaged: the losses are already divided by step-wide (all-rank) counts.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError("shard_model needs a model with `model.model.layers` (the decoder blocks)")
    if precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    for block in layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def all_reduce(values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
    """All-reduce a few numbers (a float64 CPU tensor: gloo serves CPU tensors in both setups)."""
    if dist.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def all_gather_objects(obj: Any) -> list[Any]:
    if dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
