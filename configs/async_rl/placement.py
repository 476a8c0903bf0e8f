"""Where async mode runs: the configs it supports, and the split of the cores.

The torch generator (`loop.generator`, `generator_placement`):
- "process", the default on CPU: `policy.replicas` generator processes (ranks.py's
  GeneratorProcesses), each an engine and a producer over its share of the task stream, with
  `generator_threads` torch threads between them; the trainer keeps the rest of this process's
  threads and an engine of its own for evals. Groups and weights cross a gloo channel on
  loopback. Why processes: the trainer's forward/backward, and the engine's decode steps and the
  producer's env steps, then run on their own cores, and neither waits for the other's Python
  (the GIL).
- "thread", the default on CUDA: the engine in this process on its worker thread, sharing the GPU
  with the trainer; new weights are copied device to device between two decode steps. On CPU the
  engine then computes on the producer's thread and shares the trainer's cores.

The vLLM backend is its own engine (its driver thread, and its engine-core process where
`policy.vllm.multiprocess` is set) and takes new weights between requests: VLLMPolicy's
`load_weights` stops admitting, lets the running requests finish and reloads (vLLM 0.32 has no
pause that keeps requests running across a weight reload), so `loop.weight_updates` does not
apply to it and versions change between a turn's requests only.

Under torchrun (`loop.generator_ranks = N`, "ranks"): the last N ranks generate, each with its
engine in its process (as "thread"), and the others train (configs/async_rl/ranks.py).
"""

from __future__ import annotations

import torch

from ..load import ConfigError
from ..schema import Config


def generator_placement(config: Config, device: torch.device | str) -> str | None:
    """Where the async torch generator runs, "process", "thread" or "ranks" (module doc); None in
    sync mode and for the vLLM backend (its own engine)."""
    if config.loop.mode != "async" or config.policy.backend != "torch":
        return None
    if config.loop.generator_ranks:
        return "ranks"
    if config.loop.generator != "auto":
        return config.loop.generator
    return "process" if torch.device(device).type == "cpu" else "thread"


def check_async(config: Config, world_size: int, device: torch.device | str) -> None:
    """ConfigError when `loop.mode = "async"` cannot run this config here (`world_size`: all of
    torchrun's ranks; one process, or ranks split by loop.generator_ranks; a generator process
    on CPU only; env rollouts); nothing for sync mode."""
    generators = config.loop.generator_ranks
    if config.loop.mode != "async":
        if generators:
            raise ConfigError("loop.generator_ranks", 'splits the ranks in loop.mode = "async" only')
        return
    if world_size > 1 and not generators:
        raise ConfigError(
            "loop.generator_ranks",
            f"async mode under torchrun splits the {world_size} ranks: set how many of them generate "
            f"(1 to {world_size - 1}; the others train)",
        )
    if generators and not 0 < generators < world_size:
        raise ConfigError(
            "loop.generator_ranks",
            f"{generators} generator rank(s) need torchrun with more ranks than that (this run has "
            f"{world_size}): the others train",
        )
    if generators and config.policy.backend != "torch":
        raise ConfigError("loop.generator_ranks", "generator ranks run the torch engine (policy.backend)")
    if generators and config.policy.replicas > 1:
        raise ConfigError(
            "loop.generator_ranks", "each generator rank runs one engine: set policy.replicas = 1"
        )
    placement = generator_placement(config, device)
    if placement == "process" and torch.device(device).type != "cpu":
        raise ConfigError(
            "loop.generator",
            '"process" runs its generators on CPU; on a GPU use "thread" (or "auto"), or torchrun '
            "with loop.generator_ranks",
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
