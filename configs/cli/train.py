"""`toolgym train`: one config in, one run directory out. SFT warm start (when `sft.enabled`), an
eval, the RL loop, a final eval, the final policy exported, plots, and the before/after numbers.

    config, _ = load_config("zorplex_tiny", ["run.steps=20"])
    train(config)                      # a new run directory
    train(config, resume="runs/x")     # continue from its latest checkpoint

`train` reads as: check (nothing starts for a config that cannot work here), the run directory
(new, or resumed: run_dir.py), SFT, build the RL loop (assembly/loop.py), run it
(trainers/loop/rl.py), finish (export, summary, plots).

Resume: a run with an RL checkpoint continues from it (model, optimizer, schedule, RNG, step, the
task streams' positions); metrics.jsonl and the recordings under trajectories/ keep what came up
to that step, so that each redone step is there once. A run whose SFT phase finished
(sft_done.json) starts RL from sft_model/; an SFT phase that was cut short is redone. Overrides
given with --resume are written to the run's config.toml (the previous one: config.toml.bak).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...agents.chat import Renderer
from ...agents.policy import Policy
from ...agents.tokenizer import tokenizer_fingerprint
from ...rollouts.batches import TaskSeedStream
from ...rollouts.metrics import env_metric_names
from ...rollouts.recording.format import RecordingError, RecordingReader, check_recording
from ...trainers.checkpoint import CheckpointManager, export_hf
from ...trainers.distributed import DistInfo, all_gather_objects, barrier
from ...trainers.loop.generators import GeneratorProcesses
from ...trainers.loop.rl import NoLearningError, RLLoop
from ...trainers.metrics_log import MetricsLog, display_name, format_metric, read_metrics, truncate_metrics
from ...trainers.plots import plot_run
from ...trainers.sft import run_sft
from ...trainers.weight_sync import push_weights
from ..assembly.demos import check_demo_rendering, demo_episodes, rl_stream, sft_schedule, sft_trainer_config
from ..assembly.loop import build_loop, generator_process_main, run_generator
from ..assembly.parts import (
    build_policy,
    build_renderer,
    build_trainer,
    chat_template_text,
    check_model,
    describe_policy,
    initial_model,
    load_model,
    model_config,
    policy_max_seq_len,
    resolve_device,
    save_initial_model,
    select_policy_backend,
    setup_distributed,
    with_lora,
)
from ..assembly.placement import generator_layout, generator_placement
from ..checks import check_against_machine, check_async, check_environment
from ..load import ConfigError
from ..run_dir import (
    RunDir,
    create_run_dir,
    cut_recordings,
    default_run_path,
    resume_point,
    stream_position,
    update_run_config,
)
from ..schema import Config

# summary.json's before/after: these and every metric the env reported (envs' info["metrics"]).
SUMMARY_KEYS = ("eval/reward_mean", "eval/turns_mean")


def train(config: Config, resume: str | Path | None = None, progress: bool = True) -> int:
    """Run (or resume) a training run; returns the exit code: 0, 130 (interrupted, checkpoint
    saved) or 1 (a run that cannot learn, trainers/loop/rl.py's NoLearningError: one line on
    stderr, checkpoint saved). Raises ConfigError before anything starts (no run directory, no
    SFT) when the config cannot work here, including against the machine (checks.py)."""
    started = time.perf_counter()
    progress = progress and config.logging.progress_bar
    dist, renderer, tokenizer_file = _check(config)
    if dist.role == "generate":  # a generator rank: rolls out until trainer rank 0 says stop
        return run_generator(config, dist, renderer, config.loop.generator_threads)
    run, point = _open_run(config, resume, dist)
    log = MetricsLog(config.logging, run.metrics, run.tensorboard, enabled=dist.is_main)
    log.print(
        f"run directory: {run.root}" + (f" (resuming at step {point.step})" if resume is not None else "")
    )
    if point.config_backup is not None:
        log.print(
            f"config.toml: updated with this session's settings (the previous one: {point.config_backup})"
        )
    for note in schedule_notes(config):
        log.print(note)
    backend = select_policy_backend(config, model_config(config), dist.device)
    if backend is not None:  # every hardware decision of the torch policy, once, and why
        log.print(f"backend: {backend.describe()}")

    demo_accuracy = None
    if point.redo_sft:
        demo_accuracy = _sft_phase(config, run, dist, renderer, tokenizer_file, log, progress)
    rl = _build_rl(config, run, dist, renderer, tokenizer_file, log, backend, point)
    try:
        code = _run_rl(config, run, rl, log, point, demo_accuracy, progress)
        if code:
            return code
        _finish(config, run, rl, log, tokenizer_file, started)
    finally:
        rl.close()
        log.close()
    return 0


def _check(config: Config) -> tuple[DistInfo, Renderer, Path]:
    """Every check that can refuse the config, before the run directory exists (a directory left
    behind by a refused config would block the retry: "already exists and is not empty"); joins
    the process group on the way. Returns it, the renderer and its tokenizer file."""
    check_async(config, int(os.environ.get("WORLD_SIZE", "1")), resolve_device(config.parallel))
    split = config.loop.generator_ranks if config.loop.mode == "async" else 0
    dist = setup_distributed(config.parallel, split)
    check_environment(config, dist.world_size)
    renderer, tokenizer_file = build_renderer(config)
    check_model(config, model_config(config), renderer)
    check_against_machine(config, model_config(config), renderer, dist.device)
    _check_sft_recording(config, renderer)
    return dist, renderer, tokenizer_file


@dataclasses.dataclass
class ResumePoint:
    """Where a run (re)starts: its latest RL checkpoint (None: RL from step 0), that step, the
    task streams' positions and pending task indices saved with it, whether SFT runs (again),
    and the backup of a config.toml that this session's overrides replaced."""

    latest: Path | None = None
    step: int = 0
    positions: list[int] = dataclasses.field(default_factory=list)
    pending: list[int] = dataclasses.field(default_factory=list)
    redo_sft: bool = False
    config_backup: Path | None = None


def _open_run(config: Config, resume: str | Path | None, dist: DistInfo) -> tuple[RunDir, ResumePoint]:
    """The run directory, new or resumed; on resume its recordings and metrics are cut back to
    the checkpoint and its config.toml takes this session's overrides (rank 0; collective)."""
    run = _prepare_run_dir(config, resume, dist.is_main)
    if resume is not None and dist.is_main:  # first: a resume refused for a damaged file changes nothing
        for path in sorted(run.trajectories.glob("train_rank*.jsonl")):
            check_recording(path)  # RecordingError: path, line, reason (cut_recordings rewrites these)
    point = ResumePoint()
    if resume is not None:  # before config.toml is rewritten: a `latest` pointer refused changes nothing
        point.latest, point.step, point.positions, point.pending = resume_point(run)
        if point.latest is None:
            point.positions, point.pending = [], []
    if resume is not None and dist.is_main:
        point.config_backup = update_run_config(run, config)
    point.redo_sft = config.sft.enabled and not run.sft_done.is_file() and point.latest is None
    if dist.is_main and resume is not None:
        # What the resumed run redoes goes: its steps after the checkpoint, and the step-0 eval
        # when it starts at step 0 (it runs that eval again).
        last_step = point.step if point.latest is not None and point.step > 0 else -1
        if run.metrics.is_file():
            truncate_metrics(run.metrics, last_step, keep_sft=not point.redo_sft)
        cut_recordings(run, last_step, point.positions, point.pending)
    barrier()
    return run, point


@dataclasses.dataclass
class RLParts:
    """What the RL phase holds: the loop (its trainer, source and policy), the generator
    processes of the "process" placement, the policy to close."""

    loop: RLLoop
    policy: Policy
    generators: GeneratorProcesses | None

    def close(self) -> None:
        self.loop.close()  # tells the generators to stop
        if self.generators is not None:
            self.generators.close()
        self.policy.close()


def _build_rl(
    config: Config,
    run: RunDir,
    dist: DistInfo,
    renderer: Renderer,
    tokenizer_file: Path,
    log: MetricsLog,
    backend: Any,
    point: ResumePoint,
) -> RLParts:
    """The model (after SFT, from model.path, or initial), the policy, the generators, the
    trainer (restored from the checkpoint), the task stream, and the loop over them."""
    base_dir = rl_base_dir(config, run)
    base_dir = base_dir if base_dir != run.initial_model else None
    model = load_model(base_dir) if base_dir is not None else initial_model(config)
    hf_dir = base_dir
    # vLLM loads its model from disk; LoRA adapters are exported over a base that must be on disk.
    if (config.policy.backend == "vllm" or config.policy.lora.enabled) and hf_dir is None:
        hf_dir = save_initial_model(model, run.initial_model, tokenizer_file, dist.is_main)
    with_lora(config, model)  # SFT trained the whole model; RL trains the adapters over it
    placement = generator_placement(config, dist.device)
    generators: GeneratorProcesses | None = None
    where = "the vLLM engine" if placement is None else "the engine's thread in this process"
    if placement == "process":  # the generator processes and the trainer: their threads
        count, threads, trainer_threads = generator_layout(config, device=dist.device)
        torch.set_num_threads(trainer_threads)
        generators = GeneratorProcesses(generator_process_main, (config, threads), count, dist.device)
        dist = dataclasses.replace(dist, channel=generators.channel, generators=count)
        shared = "" if config.loop.generator_threads else ", sharing the cores"
        where = f"{count} process(es) with {threads} thread(s) each, the trainer {trainer_threads}{shared}"
    policy = build_policy(config, model, hf_dir, renderer, dist.device, backend)
    log.print(describe_policy(policy))
    if config.loop.mode == "async":
        if placement == "ranks":
            where = (
                f"torchrun ranks {dist.world_size}..{dist.world_size + dist.generators - 1}, "
                f"the trainer on ranks 0..{dist.world_size - 1}"
            )
        log.print(
            f"loop: async, max_staleness {config.loop.max_staleness} ({config.loop.over_stale} older groups), "
            f"generator: {where}"
        )
    reference = copy.deepcopy(model) if config.trainer.loss.kl_coef > 0 else None
    trainer = build_trainer(config.trainer, model, dist.device, reference, sampling=config.policy)
    manager = CheckpointManager(run.rl_checkpoints, config.checkpoint.keep_last)
    stream = TaskSeedStream(stream=rl_stream(config), rank=dist.rank, world_size=dist.world_size)
    if point.latest is not None:
        data = manager.load(trainer, point.latest) or {}
        stream.position = stream_position(data, dist.rank, dist.world_size)
        push_weights(trainer, policy)
    loop = build_loop(
        config, run, dist, trainer, policy, renderer, log, manager, stream, point.step,
        policy_max_seq_len(config, model.config),
    )  # fmt: skip
    return RLParts(loop, policy, generators)


def rl_base_dir(config: Config, run: RunDir) -> Path:
    """The HF directory RL starts from: the SFT model, model.path, else the initial weights'
    directory (written only where needed: vLLM, or LoRA's adapters need their base on disk)."""
    if config.sft.enabled:
        return run.sft_model
    return Path(config.model.path) if config.model.path else run.initial_model


def _run_rl(
    config: Config,
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
            metrics = loop.evaluate(
                runner, "after SFT (step 0)" if config.sft.enabled else "initial policy (step 0)"
            )
            hint = sft_shortfall(demo_accuracy, metrics)
            if hint:
                log.print(hint)
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


def _finish(
    config: Config, run: RunDir, rl: RLParts, log: MetricsLog, tokenizer_file: Path, started: float
) -> None:
    """The final policy exported, summary.json, the before/after lines and the plots."""
    loop = rl.loop
    if config.run.export_hf:
        export_hf(
            loop.trainer,
            run.final_model,
            tokenizer_file,
            chat_template=chat_template_text(config),
            adapter_directory=run.final_adapter if config.policy.lora.enabled else None,
            base_model=str(rl_base_dir(config, run).resolve()),
        )
    if loop.dist.is_main:
        summary = _summary(run, loop, config.sft.enabled, started)
        run.write_json(run.summary, summary)
        _print_summary(log, summary, config.logging.headline_metrics)
        if config.run.plot and config.logging.jsonl:
            written = plot_run(run.root)
            log.print(f"plots: {', '.join(str(p) for p in written)}")
        elif config.run.plot:  # the plots are drawn from metrics.jsonl, which this run did not write
            log.print("plots: none (they are drawn from metrics.jsonl: set logging.jsonl = true)")
        log.print(f"done in {summary['wall_time_s']:.0f}s: {run.root}")
    barrier()


def _prepare_run_dir(config: Config, resume: str | Path | None, is_main: bool) -> RunDir:
    """A new run directory (rank 0 makes it; every rank gets its path), or the one to resume."""
    if resume is not None:
        return RunDir(resume, config.checkpoint.directory)
    error, path = None, str(default_run_path(config))
    if is_main:
        try:
            create_run_dir(Path(path), config)
        except ConfigError as exc:
            error = exc
    error, path = all_gather_objects((error, path))[0]
    if error is not None:
        raise error
    return RunDir(path, config.checkpoint.directory)


def _check_sft_recording(config: Config, renderer: Renderer) -> None:
    """The SFT recording: every record readable (rollouts/recording/format.py's check_recording), made
    with the run's tokenizer and rendered as the run renders (assembly/demos.py's
    check_demo_rendering); ConfigError (sft.recording) otherwise."""
    if not (config.sft.enabled and config.sft.source == "recording"):
        return
    fingerprint = tokenizer_fingerprint(renderer.tokenizer)
    try:  # every record: a damaged one found after the run directory exists would leave it behind
        check_recording(config.sft.recording, fingerprint)
        header = RecordingReader(config.sft.recording, fingerprint).header
    except (RecordingError, OSError) as exc:
        raise ConfigError("sft.recording", str(exc)) from None
    check_demo_rendering(config, renderer, header)


def schedule_notes(config: Config) -> list[str]:
    """A line for each decaying LR schedule that ends before its phase does: the steps after
    `total_steps` run at lr x min_lr_ratio. This is how a resume with `--set run.steps=N` (more
    steps) behaves, since the stored config.toml fixed total_steps at the old run.steps;
    stretching the schedule mid-run would change the LR of steps already planned, so it is the
    user's call, and the note says how."""
    notes = []
    phases = [("trainer.optimizer", config.trainer.optimizer, "run.steps", config.run.steps)]
    if config.sft.enabled:
        phases.append(("sft.optimizer", config.sft.optimizer, "sft.steps", config.sft.steps))
    for key, optimizer, steps_key, steps in phases:
        if optimizer.decay != "constant" and steps > optimizer.total_steps:
            notes.append(
                f"note: {key}.total_steps={optimizer.total_steps} < {steps_key}={steps}: the {optimizer.decay} "
                f"LR schedule ends at step {optimizer.total_steps} and later steps run at lr x "
                f"min_lr_ratio={optimizer.min_lr_ratio:g} (--set {key}.total_steps={steps} stretches it)"
            )
    return notes


def _sft_phase(
    config: Config, run: RunDir, dist, renderer, tokenizer_file: Path, log: MetricsLog, progress: bool
) -> float | None:
    """SFT on the configured demonstrations; returns their accuracy (None if unknown)."""
    max_seq_len = policy_max_seq_len(config, model_config(config))
    record_to = run.trajectories / "sft_demos.jsonl" if dist.is_main else None
    if record_to is not None and record_to.exists():
        record_to.unlink()  # a redone SFT phase writes its demos afresh
    episodes, data_metrics, source = demo_episodes(config, renderer, max_seq_len, record_to)
    log.log("sft", 0, data_metrics)
    headline = ", ".join(
        f"{display_name(name)} {data_metrics[f'sft_data/{name}']:.2f}"
        for name in config.logging.headline_metrics
        if f"sft_data/{name}" in data_metrics
    )
    log.print(f"sft: {len(episodes)} demonstrations from {source}" + (f": {headline}" if headline else ""))
    trainer = run_sft(
        initial_model(config), episodes, sft_trainer_config(config), config.policy, sft_schedule(config),
        log, dist.device, progress and dist.is_main,
    )  # fmt: skip
    export_hf(trainer, run.sft_model, tokenizer_file, chat_template=chat_template_text(config))
    if dist.is_main:
        run.write_json(run.sft_done, {"steps": config.sft.steps, "episodes": len(episodes), "source": source})
    barrier()
    return data_metrics.get("sft_data/accuracy")


def sft_shortfall(demo_accuracy: float | None, eval_metrics: dict[str, float] | None) -> str | None:
    """A hint when the policy after SFT answers far less accurately than its demonstrations: SFT
    has not taught the task yet, and RL from there mostly learns the format, not the answers."""
    accuracy = (eval_metrics or {}).get("eval/accuracy")
    if demo_accuracy is None or accuracy is None or demo_accuracy < 0.5 or accuracy >= 0.5 * demo_accuracy:
        return None
    return (
        f"note: held-out accuracy after SFT is {accuracy:.2f}, the demonstrations' {demo_accuracy:.2f}: "
        "SFT has not taught the task yet (a skill such as copying a tool's answer can form late; "
        "bench/sft_copy.py). Consider more SFT steps (--set sft.steps=N)."
    )


def _summary(run: RunDir, loop: RLLoop, sft: bool, started: float) -> dict[str, Any]:
    evals = [r for r in read_metrics(run.metrics) if r.get("kind") == "eval"]
    if not evals:
        evals = [{"step": s, **m} for s, m in loop.eval_history]
    summary: dict[str, Any] = {"wall_time_s": time.perf_counter() - started, "steps": loop.step}
    if evals:
        first, last = evals[0], evals[-1]
        for name, record in (("before", first), ("after", last)):
            keys = [*SUMMARY_KEYS, *(f"eval/{n}" for n in env_metric_names(record, "eval/"))]
            summary[name] = {"step": record["step"], **{k.removeprefix("eval/"): record.get(k) for k in keys}}
        summary["before"]["label"] = "after SFT" if sft else "initial policy"
        summary["after"]["label"] = "after RL"
    return summary


def _print_summary(log: MetricsLog, summary: dict[str, Any], headline: Sequence[str]) -> None:
    """The before/after lines: the headline metrics (logging.headline_metrics) and the reward."""
    if "before" not in summary:
        return
    log.print("")
    for key in ("before", "after"):
        s = summary[key]
        metrics = "".join(f"{display_name(n)} {format_metric(s.get(n), '.3f')}  " for n in headline)
        log.print(
            f"{s['label']:>15} (step {s['step']:>4}): {metrics}reward {format_metric(s.get('reward_mean'), '.3f')}"
        )
