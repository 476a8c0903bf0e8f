"""Where async mode runs: the configs it supports, and the split of the cores.

The torch generator (`loop.generator`, `generator_placement`):
- "process", the default on CPU: a separate process (`agents/engine/replicas.py`'s
  EngineReplicas, even for one replica: its weights arrive through shared memory) with
  `generator_threads` torch threads; the trainer keeps the rest of this process's threads. Why a
  process: the trainer's forward/backward and the engine's decode steps then run on their own
  cores, and neither waits for the other's Python (the GIL).
- "thread", the default on CUDA: the engine in this process on its worker thread, sharing the GPU
  with the trainer; new weights are copied device to device between two decode steps. On CPU the
  engine then computes on the producer's thread and shares the trainer's cores.

The vLLM backend is its own engine (its driver thread, and its engine-core process where
`policy.vllm.multiprocess` is set) and takes new weights between requests: VLLMPolicy's
`load_weights` stops admitting, lets the running requests finish and reloads (vLLM 0.32 has no
pause that keeps requests running across a weight reload), so `loop.weight_updates` does not
apply to it and versions change between a turn's requests only.
"""

from __future__ import annotations

import torch

from ..load import ConfigError
from ..schema import Config


def generator_placement(config: Config, device: torch.device | str) -> str | None:
    """Where the async torch generator runs, "process" or "thread" (module doc); None in sync
    mode and for the vLLM backend (its own engine)."""
    if config.loop.mode != "async" or config.policy.backend != "torch":
        return None
    if config.loop.generator != "auto":
        return config.loop.generator
    return "process" if torch.device(device).type == "cpu" else "thread"


def check_async(config: Config, world_size: int, device: torch.device | str) -> None:
    """ConfigError when `loop.mode = "async"` cannot run this config here (one process, a
    generator process on CPU only, env rollouts); nothing for sync mode."""
    if config.loop.mode != "async":
        return
    if world_size > 1:
        raise ConfigError("loop.mode", "async mode runs in one process (torchrun ranks are not split yet)")
    placement = generator_placement(config, device)
    if placement == "process" and torch.device(device).type != "cpu":
        raise ConfigError(
            "loop.generator",
            '"process" shares weights through CPU shared memory; on a GPU use "thread" (or "auto")',
        )
    if placement == "thread" and config.policy.replicas > 1:
        raise ConfigError(
            "loop.generator", '"thread" runs one engine in this process: set policy.replicas = 1'
        )
    if config.agent_program.module:
        raise ConfigError("loop.mode", "async mode rolls out [env] episodes, not an [agent_program]")


def thread_split(config: Config, threads: int | None = None) -> tuple[int, int]:
    """(generator threads, trainer threads) out of `threads` (default this process's torch
    threads): loop.generator_threads, or half, at least 1 each."""
    total = threads or torch.get_num_threads()
    generator = config.loop.generator_threads or max(1, total // 2)
    return generator, max(1, total - generator)


def buffer_capacity(config: Config) -> int:
    """loop.buffer_groups, or groups_per_batch x max_staleness, at least groups_per_batch."""
    groups = config.batch.groups_per_batch
    return config.loop.buffer_groups or max(groups, groups * config.loop.max_staleness)
