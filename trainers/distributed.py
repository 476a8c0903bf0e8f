"""Process group and FSDP2 wrapping: torchrun (gloo on CPU, NCCL on GPU) or one plain process.

Async RL's rank split (`init_distributed(..., generator_ranks=N)`): torchrun's W ranks become
trainers (ranks 0..W-N-1, the default process group, so FSDP2, the collectives and checkpoints
below see the trainers alone) and generators (the last N, in no default group). A gloo group of
its own, the *channel*, joins trainer rank 0 (member 0) and the generators (members 1..N), built
from torchrun's store; `Channel` carries bytes and tensors over it (trainers/loop/generators.py
speaks its protocol).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


@dataclass(frozen=True)
class DistInfo:
    """rank / world_size: in the default process group (the trainers' when torchrun's ranks are
    split; a generator's index among the generators). role, channel, generators: the split
    (module doc); channel is None on trainer ranks other than 0 and without a split."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    role: Literal["train", "generate"] = "train"
    channel: Any = None  # dist.ProcessGroupGloo: trainer rank 0 and the generator ranks
    generators: int = 0

    @property
    def is_main(self) -> bool:
        return self.role == "train" and self.rank == 0


def init_distributed(device: str | torch.device | None = None, generator_ranks: int = 0) -> DistInfo:
    """Join the process group torchrun describes, or make a one-process group when run plainly.

    Under torchrun (RANK/WORLD_SIZE set) this is init_process_group(env://) with gloo for CPU
    tensors and NCCL for CUDA ones. Without torchrun it is a world of one on an in-memory store,
    so FSDP2 and every collective below work unchanged. Calling it again reuses the group.
    device: "cpu", "cuda" or None (CUDA when available). generator_ranks > 0 (under torchrun):
    the last that many ranks generate (module doc); local rank r then takes GPU r mod the GPUs,
    so on one GPU a generator shares it with the trainer (processes, not threads: no shared GIL).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if generator_ranks and not dist.is_initialized():  # more ranks than GPUs: they share, round-robin
        gpus = torch.cuda.device_count()
        return _init_split(_resolve_device(device, local_rank % max(gpus, 1)), generator_ranks, local_rank)
    device = _resolve_device(device, local_rank)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def _resolve_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank if device.index is None else device.index)
        torch.cuda.set_device(device)
    return device


def _init_split(device: torch.device, generators: int, local_rank: int) -> DistInfo:
    """torchrun's ranks split into trainers and generators (module doc)."""
    store, rank, world = next(dist.rendezvous("env://"))
    trainers = world - generators
    if trainers < 1:
        raise ValueError(f"{generators} generator ranks leave no trainer among {world} ranks")
    channel = None
    if rank == 0 or rank >= trainers:
        channel = channel_group(store, 0 if rank == 0 else rank - trainers + 1, generators)
    if rank >= trainers:
        return DistInfo(rank - trainers, generators, local_rank, device, "generate", channel, generators)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore("toolgym/train", store),
        rank=rank,
        world_size=trainers,
        device_id=device if device.type == "cuda" else None,
    )
    return DistInfo(rank, trainers, local_rank, device, "train", channel, generators)


def channel_group(store: dist.Store, member: int, generators: int) -> dist.ProcessGroup:
    """The channel (module doc): member 0 the trainer, 1..generators the generators; built from
    `store` (torchrun's, or a local TCPStore for generator processes). Blocks until all joined.
    The timeout is long: a generator waits on it while the trainers train, evaluate and save."""
    group = dist.ProcessGroupGloo(
        dist.PrefixStore("toolgym/async", store), member, generators + 1, timedelta(hours=2)
    )
    return cast(dist.ProcessGroup, group)  # it has broadcast/send/recv; torch's stubs omit them


class Channel:
    """Bytes and tensors over the channel's gloo group (`channel_group`); member 0 is trainer rank 0."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()
        return tensor

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Member 0's `data` on every member (the others pass None)."""
        size = self.broadcast(torch.tensor([len(data) if data is not None else 0], dtype=torch.int64))
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(int(size), dtype=torch.uint8)
        )
        return self.broadcast(buffer).numpy().tobytes() if int(size) else b""

    def send_bytes(self, data: bytes, dst: int = 0) -> None:
        self.group.send([torch.tensor([len(data)], dtype=torch.int64)], dst, 0).wait()
        if data:
            self.group.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], dst, 1).wait()

    def recv_bytes(self, src: int) -> bytes:
        size = torch.zeros(1, dtype=torch.int64)
        self.group.recv([size], src, 0).wait()
        if not int(size):
            return b""
        buffer = torch.empty(int(size), dtype=torch.uint8)
        self.group.recv([buffer], src, 1).wait()
        return buffer.numpy().tobytes()


def device_mesh(info: DistInfo) -> DeviceMesh:
    return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp",))


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 matmuls natively: CUDA with bf16 support, or a CPU with
    AVX-512 BF16 or AMX (oneDNN says which). Elsewhere bf16 is emulated: on an AVX2-only CPU a
    bf16 matmul is tens of times slower than fp32 (docs/engine.md, "Training precision")."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def training_precision(precision: str, device: torch.device) -> str:
    """The precision the trainer computes in: "auto" is bf16 where `native_bf16(device)`, else
    fp32; "fp32" and "bf16" are kept as asked (bf16 where it is emulated, with a warning)."""
    native = native_bf16(device)
    if precision == "auto":
        return "bf16" if native else "fp32"
    if precision == "bf16" and not native:
        warnings.warn(
            f"precision bf16 on a {device.type} without native bf16 matmuls (no AVX-512 BF16 or AMX "
            "on a CPU): it is emulated, many times slower than fp32; precision = \"auto\" picks fp32 here",
            RuntimeWarning,
            stacklevel=2,
        )
    return precision


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


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (pickled; the others pass anything)."""
    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
