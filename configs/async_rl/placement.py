"""Where async mode runs: the configs it supports, and the split of the cores.

On CPU the generator is a separate process (`agents/engine/replicas.py`'s EngineReplicas, even
for one replica: its weights arrive through shared memory) with `generator_threads` torch
threads, and the trainer keeps the rest of this process's threads. Why a process: the trainer's
forward/backward and the engine's decode steps then run on their own cores, and neither waits
for the other's Python (the GIL).
"""

from __future__ import annotations

import torch

from ..load import ConfigError
from ..schema import Config


def check_async(config: Config, world_size: int, device: torch.device | str) -> None:
    """ConfigError when `loop.mode = "async"` cannot run this config here (one process on CPU,
    the torch backend, env rollouts); nothing for sync mode."""
    if config.loop.mode != "async":
        return
    if world_size > 1:
        raise ConfigError("loop.mode", "async mode runs in one process (torchrun ranks are not split yet)")
    if torch.device(device).type != "cpu":
        raise ConfigError("loop.mode", "async mode runs on CPU (a generator process beside the trainer)")
    if config.policy.backend != "torch":
        raise ConfigError("loop.mode", "async mode needs policy.backend = 'torch'")
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
