"""`toolgym train`: one config in, one run directory out. SFT warm start (when `sft.enabled`), an
eval, the RL loop, a final eval, the final policy exported, plots, and the before/after numbers.

    config, _ = load_config("zorplex_tiny", ["run.steps=20"])
    train(config)                      # a new run directory
    train(config, resume="runs/x")     # continue from its latest checkpoint

`train` reads as: the run plan (assembly/plan.py: mode, placement, ranks, threads, streams; once),
the checks (nothing starts for a config that cannot work here), the run directory (new, or resumed
at its latest checkpoint: assembly/run.py), SFT, the RL parts, the RL loop (trainers/loop/rl.py),
the finish (export, summary, plots). Overrides given with --resume are written to the run's
config.toml (the previous one: config.toml.bak).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from ...agents.chat import Renderer
from ...trainers.distributed import DistInfo
from ...trainers.loop.rl import NoLearningError
from ...trainers.metrics_log import MetricsLog
from ..assembly.loop import run_generator
from ..assembly.parts import (
    build_renderer,
    check_model,
    model_config,
    select_policy_backend,
    setup_distributed,
)
from ..assembly.plan import RunPlan, plan_run
from ..assembly.run import (
    ResumePoint,
    RLParts,
    build_rl,
    eval_kept,
    finish,
    open_run,
    sft_phase,
    sft_shortfall,
)
from ..checks import (
    check_against_machine,
    check_async,
    check_environment,
    check_sft_recording,
    schedule_notes,
    start_env,
    tool_format_notes,
)
from ..run_dir import RunDir
from ..schema import Config

__all__ = ["schedule_notes", "sft_shortfall", "train"]


def train(config: Config, resume: str | Path | None = None, progress: bool = True) -> int:
    """Run (or resume) a training run; returns the exit code: 0, 130 (interrupted, checkpoint
    saved) or 1 (a run that cannot learn, trainers/loop/rl.py's NoLearningError: one line on
    stderr, checkpoint saved). Raises ConfigError before anything starts (no run directory, no
    SFT) when the config cannot work here, including against the machine (checks.py)."""
    started = time.perf_counter()
    progress = progress and config.logging.progress_bar
    plan = plan_run(config)
    dist, renderer, tokenizer_file, format_lines = _check(config, plan)
    if dist.role == "generate":  # a generator rank: rolls out until trainer rank 0 says stop
        return run_generator(config, plan, dist, renderer, config.loop.generator_threads)
    run, point = open_run(config, plan, resume, dist)
    log = MetricsLog(config.logging, run.metrics, run.tensorboard, enabled=dist.is_main)
    log.print(
        f"run directory: {run.root}" + (f" (resuming at step {point.step})" if resume is not None else "")
    )
    if point.config_backup is not None:
        log.print(
            f"config.toml: updated with this session's settings (the previous one: {point.config_backup})"
        )
    for note in [*schedule_notes(config), *format_lines]:
        log.print(note)
    backend = select_policy_backend(config, model_config(config), dist.device)
    if backend is not None:  # every hardware decision of the torch policy, once, and why
        log.print(f"backend: {backend.describe()}")

    demo_accuracy = None
    if point.redo_sft:
        demo_accuracy = sft_phase(config, run, dist, renderer, tokenizer_file, log, progress)
    rl = build_rl(config, plan, run, dist, renderer, tokenizer_file, log, backend, point)
    try:
        code = _run_rl(config, plan, run, rl, log, point, demo_accuracy, progress)
        if code:
            return code
        finish(config, plan, run, rl, log, tokenizer_file, started)
    finally:
        rl.close()
        log.close()
    return 0


def _check(config: Config, plan: RunPlan) -> tuple[DistInfo, Renderer, Path, list[str]]:
    """Every check that can refuse the config, before the run directory exists (a directory left
    behind by a refused config would block the retry: "already exists and is not empty"); joins
    the process group on the way. Returns it, the renderer, its tokenizer file and the tool-format
    lines to print at start. The env of config.env is made once for the checks and notes that
    read it (checks.py's start_env)."""
    check_async(config, plan.world_size, plan.placement)
    dist = setup_distributed(plan.device, plan.threads, plan.generator_ranks)
    with start_env(config) as env:
        check_environment(config, dist.world_size, env)
        renderer, tokenizer_file = build_renderer(config)
        check_model(config, model_config(config), renderer)
        check_against_machine(config, model_config(config), renderer, dist.device, env)
        check_sft_recording(config, renderer)
        format_lines = tool_format_notes(config, renderer, env)
    return dist, renderer, tokenizer_file, format_lines


def _run_rl(
    config: Config,
    plan: RunPlan,
    run: RunDir,
    rl: RLParts,
    log: MetricsLog,
    point: ResumePoint,
    demo_accuracy: float | None,
    progress: bool,
) -> int:
    """The step-0 eval and the RL steps; 0 when they ran to the end (checkpoint saved), 130 on an
    interrupt, 1 when the run cannot learn (both with a checkpoint saved)."""
    loop, dist = rl.loop, rl.loop.dist
    with asyncio.Runner() as runner:
        loop.start(point.positions, point.pending)  # generators roll out while rank 0 evaluates
        if loop.step == 0 and config.eval.at_start:
            metrics = loop.evaluate(runner, "after SFT (step 0)" if plan.sft else "initial policy (step 0)")
            hint = sft_shortfall(demo_accuracy, metrics)
            if hint:
                log.print(hint)
        elif point.latest is not None and loop.eval_due(config.run.steps) and not eval_kept(config, run, loop.step):
            # the run stopped during the eval after its checkpoint: that eval is done again
            loop.evaluate(runner, f"step {loop.step}")
        try:
            loop.run_steps(config.run.steps, runner, progress)
        except KeyboardInterrupt:
            if dist.world_size > 1 or dist.generators:  # the other ranks got the signal too:
                raise  # no collective (nor exchange with a generator rank) is safe
            loop.trainer.optimizer.zero_grad(set_to_none=True)
            loop.save_checkpoint()
            log.print(f"interrupted at step {loop.step}; checkpoint saved: toolgym train --resume {run.root}")
            return 130
        except NoLearningError as exc:  # every rank raises it at the same step
            loop.save_checkpoint()
            if dist.is_main:
                print(f"error: {exc}; checkpoint saved at step {loop.step}", file=sys.stderr)
            return 1
        if config.checkpoint.at_end and (loop.step > point.step or point.latest is None):
            loop.save_checkpoint()
    return 0
