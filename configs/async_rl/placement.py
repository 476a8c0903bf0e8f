"""Where async mode runs: the configs it supports, and the split of the cores.

On CPU the torch generator is a separate process (`agents/engine/replicas.py`'s EngineReplicas,
even for one replica: its weights arrive through shared memory) with `generator_threads` torch
threads, and the trainer keeps the rest of this process's threads. Why a process: the trainer's
forward/backward and the engine's decode steps then run on their own cores, and neither waits
for the other's Python (the GIL).

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


def check_async(config: Config, world_size: int, device: torch.device | str) -> None:
    """ConfigError when `loop.mode = "async"` cannot run this config here (one process, on
    CPU for the torch backend, env rollouts); nothing for sync mode."""
    if config.loop.mode != "async":
        return
    if world_size > 1:
        raise ConfigError("loop.mode", "async mode runs in one process (torchrun ranks are not split yet)")
    if config.policy.backend == "torch" and torch.device(device).type != "cpu":
        raise ConfigError(
            "loop.mode", "async mode with the torch backend runs on CPU (a generator process beside the trainer)"
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
