"""The run plan: every decision about how a run is laid out, made once from its config and this
machine before anything starts, then only read.

    plan = plan_run(config)       # mode, device, ranks, generator placement, threads, streams
    check_async(config, plan.world_size, plan.placement)  # refuses what cannot run here
    dist = setup_distributed(plan.device, plan.threads, plan.generator_ranks)
    ... every builder takes `plan` instead of deciding again

Fields: `mode` ("sync" | "async"); `device` ("cpu" | "cuda", parallel.device resolved);
`world_size` (torchrun's ranks, 1 when run plainly); `generator_ranks` (async under torchrun: the
last that many ranks generate, the others train); `placement` (where the async torch generator
runs: "process", "thread", "ranks", or None in sync mode and for vLLM; placement.py);
`threads` (this process's torch threads); for the "process" placement, `generator_processes`,
`generator_threads` (each) and `trainer_threads` (placement.py's generator_layout; otherwise 0,
0 and `threads`); `sft` (a warm start before RL); `rl_stream` (the RL task stream's id).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from ..schema import Config
from .demos import rl_stream
from .parts import resolve_device, usable_cores
from .placement import generator_layout, generator_placement


@dataclasses.dataclass(frozen=True)
class RunPlan:
    mode: Literal["sync", "async"]
    device: str
    world_size: int
    generator_ranks: int
    placement: str | None
    threads: int
    generator_processes: int
    generator_threads: int
    trainer_threads: int
    sft: bool
    rl_stream: int
    generator_threads_set: bool = False  # loop.generator_threads split the cores (else shared)

    def describe_placement(self) -> str:
        """Where the generator runs, in words (the "loop: async ..." line; ranks: see train)."""
        if self.placement is None:
            return "the vLLM engine"
        if self.placement == "process":
            shared = "" if self.generator_threads_set else ", sharing the cores"
            return (
                f"{self.generator_processes} process(es) with {self.generator_threads} thread(s) each, "
                f"the trainer {self.trainer_threads}{shared}"
            )
        return "the engine's thread in this process"


def plan_run(config: Config, environ: dict[str, str] | None = None) -> RunPlan:
    """The plan of `config` on this machine: torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE from
    `environ` (default os.environ), parallel.device resolved (ConfigError where CUDA is asked
    for and absent), the cores split between this node's processes (parallel.threads, else the
    usable cores / local processes) and, for generator processes, between them and the trainer."""
    env = os.environ if environ is None else environ
    device = resolve_device(config.parallel)
    world_size = int(env.get("WORLD_SIZE", "1"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world_size))
    threads = config.parallel.threads or max(1, usable_cores() // max(1, local_world))
    placement = generator_placement(config, device)
    processes, generator_threads, trainer_threads = 0, 0, threads
    if placement == "process":
        processes, generator_threads, trainer_threads = generator_layout(config, threads, device)
    return RunPlan(
        mode=config.loop.mode,
        device=device,
        world_size=world_size,
        generator_ranks=config.loop.generator_ranks if config.loop.mode == "async" else 0,
        placement=placement,
        threads=threads,
        generator_processes=processes,
        generator_threads=generator_threads,
        trainer_threads=trainer_threads,
        sft=config.sft.enabled,
        rl_stream=rl_stream(config),
        generator_threads_set=bool(config.loop.generator_threads),
    )
