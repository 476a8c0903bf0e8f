"""Where async mode runs: the configs it supports, and the split of the cores.

The torch generator (`loop.generator`, `generator_placement`):
- "process", the default on CPU: `loop.generator_processes` generator processes
  (trainers/loop/generators.py's GeneratorProcesses), each an engine and a producer over its
  share of the task stream, on the trainer's device; the trainer keeps an engine of its own for
  evals. Groups cross a gloo channel on loopback, the weights a shared-memory buffer
  (trainers/weight_sync.py's SharedWeights). Why
  processes: the trainer's forward/backward, and the engine's decode steps and the producer's
  env steps, then run side by side, and neither waits for the other's Python (the GIL). The
  cores (`generator_layout`): by default every generator process has one thread and the trainer
  keeps all of its own, so the two sides share the cores and the OS gives them to whichever is
  not waiting (the trainer for groups, the generators on a full buffer); a set
  `loop.generator_threads` splits them instead, that many to the generators and the rest to the
  trainer. Rolling out a small model gains 1.4x from a second thread, and a second
  process cuts the trainer's wait for groups more; training gains 1.9x from a second core:
  bench/RESULTS.md, "async_vs_sync". On CUDA it is
  one process by default, sharing the GPU as a torchrun generator rank does, but without
  torchrun.
- "thread", the default on CUDA: the engine in this process on its worker thread, sharing the GPU
  with the trainer; new weights are copied device to device between two decode steps. On CPU the
  engine then computes on the producer's thread and shares the trainer's cores.

The vLLM backend is its own engine (its driver thread, and its engine-core process where
`policy.vllm.multiprocess` is set) and takes new weights between requests: VLLMPolicy's
`load_weights` stops admitting, lets the running requests finish and reloads (vLLM 0.32 has no
pause that keeps requests running across a weight reload), so `loop.weight_updates` does not
apply to it and versions change between a turn's requests only.

Under torchrun (`loop.generator_ranks = N`, "ranks"): the last N ranks generate, each with its
engine in its process (as "thread"), and the others train (trainers/loop/generators.py).
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


def check_async(config: Config, world_size: int, placement: str | None) -> None:
    """ConfigError when `loop.mode = "async"` cannot run this config here (`world_size`: all of
    torchrun's ranks; one process, or ranks split by loop.generator_ranks; env rollouts;
    `placement`: the run plan's, plan.py); nothing for sync mode."""
    generators = config.loop.generator_ranks
    if config.distill.enabled and placement in ("process", "ranks"):
        raise ConfigError(
            "distill.teacher",
            f"the teacher scores groups in the trainer's process, and this run's generator runs in "
            f"{placement} of its own: use loop.mode = \"sync\" or loop.generator = \"thread\"",
        )
    if config.judge.enabled and placement in ("process", "ranks"):
        raise ConfigError(
            "judge.url",
            f"the judge scores groups in the trainer's process, and this run's generator runs in "
            f'{placement} of its own: use loop.mode = "sync" or loop.generator = "thread"',
        )
    if config.selfplay.enabled and config.loop.mode == "async":
        raise ConfigError(
            "selfplay.enabled",
            'self-play matches are played in loop.mode = "sync" (an async producer scores one group per '
            "task, and a match gives one per seat)",
        )
    if config.selfplay.enabled and config.agent_program.module:
        raise ConfigError("selfplay.enabled", "self-play plays [env]'s game, not an [agent_program]")
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
    if placement is not None and config.policy.replicas > 1:
        raise ConfigError(
            "policy.replicas",
            "is sync mode's engine processes; async mode's generators are loop.generator_processes "
            '("process") or loop.generator_ranks (torchrun): set policy.replicas = 1',
        )
    if config.agent_program.module:
        raise ConfigError("loop.mode", "async mode rolls out [env] episodes, not an [agent_program]")


def generator_layout(
    config: Config, threads: int | None = None, device: torch.device | str = "cpu"
) -> tuple[int, int, int]:
    """The "process" placement's cores, out of `threads` (default this process's torch threads):
    (generator processes, torch threads each, the trainer's torch threads). Processes:
    loop.generator_processes, or on CPU one per thread up to 4 (each holds the weights and a KV
    cache), on CUDA one. Threads: one each, the trainer keeping all of its own (the cores
    shared), or with loop.generator_threads set, those split between the processes (at least one
    each) and the trainer the rest (at least one)."""
    total = threads or torch.get_num_threads()
    loop = config.loop
    default = max(1, min(total, 4)) if torch.device(device).type == "cpu" else 1
    processes = loop.generator_processes or default
    if not loop.generator_threads:
        return processes, 1, total
    return processes, max(1, loop.generator_threads // processes), max(1, total - loop.generator_threads)


def buffer_capacity(config: Config) -> int:
    """loop.buffer_groups, or groups_per_batch x max_staleness, at least groups_per_batch."""
    groups = config.batch.groups_per_batch
    return config.loop.buffer_groups or max(groups, groups * config.loop.max_staleness)
