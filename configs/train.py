"""`toolgym train`: one config in, one run directory out. SFT warm start (when `sft.enabled`), an
eval, the RL loop, a final eval, the final policy exported, plots, and the before/after numbers.

    config, _ = load_config("zorplex_tiny", ["run.steps=20"])
    train(config)                      # a new run directory
    train(config, resume="runs/x")     # continue from its latest checkpoint

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
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..agents.chat import Renderer
from ..agents.tokenizer import tokenizer_fingerprint
from ..rollouts.metrics import env_metric_names
from ..rollouts.recording import RecordingError, RecordingReader, RecordingWriter, check_recording
from ..rollouts.sampling import TaskSeedStream
from ..trainers.checkpoint import CheckpointManager, export_hf
from ..trainers.distributed import all_gather_objects, barrier
from ..trainers.weight_sync import push_weights
from .async_rl.placement import check_async, generator_layout, generator_placement
from .async_rl.ranks import GeneratorProcesses, run_generator
from .build import (
    build_policy,
    build_renderer,
    build_trainer,
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
)
from .load import ConfigError, check_against_machine, check_environment, config_to_toml, load_config
from .loop import NoLearningError, RLLoop
from .metrics_log import MetricsLog, display_name, format_metric, read_metrics, truncate_metrics
from .plot import plot_run
from .run_dir import RunDir, create_run_dir, default_run_path
from .schema import Config
from .sft import check_demo_rendering, demo_episodes, rl_stream, run_sft

# summary.json's before/after: these and every metric the env reported (envs/core/info.py).
SUMMARY_KEYS = ("eval/reward_mean", "eval/turns_mean")


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
    """The SFT recording's header (not its episodes): a recording made with another tokenizer, or
    rendered otherwise than the run renders (sft.check_demo_rendering)."""
    if not (config.sft.enabled and config.sft.source == "recording"):
        return
    try:
        header = RecordingReader(config.sft.recording, tokenizer_fingerprint(renderer.tokenizer)).header
    except (RecordingError, OSError) as exc:
        raise ConfigError("sft.recording", str(exc)) from None
    check_demo_rendering(config, renderer, header)


def _update_run_config(run: RunDir, config: Config) -> Path | None:
    """On resume: write `config` to the run's config.toml when it differs (--resume with --set),
    keeping the previous one as config.toml.bak. A later `--resume RUN` (the command printed on
    an interrupt) reads config.toml alone: without this it would run with the old values, e.g.
    the old run.steps, train nothing and exit 0. Returns the backup, or None when unchanged."""
    text = config_to_toml(config)
    try:
        unchanged = config_to_toml(load_config(run.config)[0]) == text
    except ConfigError:  # the old file no longer loads (the overrides may be what fixes it)
        unchanged = False
    if unchanged:
        return None
    backup = run.config.with_name(run.config.name + ".bak")
    shutil.copy2(run.config, backup)
    run.write_text(run.config, text)
    return backup


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


def _resume_point(run: RunDir) -> tuple[Path | None, int, list[int], list[int]]:
    """The latest RL checkpoint (or None), the RL step it holds, the task streams' positions and
    (async mode) the task indices drawn but not trained on by then."""
    latest = CheckpointManager(run.rl_checkpoints).latest()
    if latest is None:
        return None, 0, [], []
    data = json.loads((latest / "meta.json").read_text())["data_position"]
    positions = [int(p) for p in data.get("positions", [0])]
    return latest, int(data.get("rl_step", 0)), positions, [int(i) for i in data.get("pending", [])]


def _drawn_before(group_id: int, positions: list[int]) -> bool:
    """Whether training task `group_id` (its index in the stream) was drawn by the checkpoint's
    steps: rank r of W draws the indices k * W + r for k < positions[r]. A session run with
    another world size drew only indices below where the checkpoint's session started, or (a
    later one, resumed from it) at or past every rank's position: the rule holds for those too."""
    world = len(positions)
    return world > 0 and group_id // world < positions[group_id % world]


def cut_recordings(run: RunDir, last_step: int, positions: list[int], pending: Sequence[int] = ()) -> None:
    """On resume: leave the recordings as they were at the checkpoint, so each step the resumed
    run redoes is recorded once (the writers append). Evals after `last_step` are deleted (they
    are redone, like their metrics records); train_rank*.jsonl keeps the episodes of the tasks
    the checkpoint's steps drew (task index = group id, below the streams' positions: this holds
    for surplus and dropped groups too, and needs no step number in the file), less the `pending`
    ones (async mode: drawn but not trained on by the checkpoint, so rolled out again), and is
    rewritten through a RecordingWriter, header kept. No checkpoint (`positions` empty): RL starts over,
    and the file goes."""
    for path in run.trajectories.glob("eval_step_*.jsonl"):
        step = path.stem.removeprefix("eval_step_")
        if step.isdigit() and int(step) > last_step:
            path.unlink()
    redone = set(pending)
    for path in run.trajectories.glob("train_rank*.jsonl"):
        reader = RecordingReader(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        kept = 0
        with RecordingWriter(tmp, reader.header) as writer:
            for trajectory in reader:
                if _drawn_before(trajectory.group_id, positions) and trajectory.group_id not in redone:
                    writer.write(trajectory)
                    kept += 1
        if kept:
            tmp.replace(path)
        else:  # the run starts over: its writer makes a new file, with this session's header
            tmp.unlink()
            path.unlink()


def _stream_position(data: dict[str, Any], rank: int, world_size: int) -> int:
    positions = [int(p) for p in data.get("positions", [0])]
    if len(positions) == world_size:
        return positions[rank]
    # Another world size: start past every task index the old ranks drew (index = k * W + r).
    return math.ceil(max(positions) * len(positions) / world_size)


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
    trainer = run_sft(config, initial_model(config), episodes, log, dist.device, progress and dist.is_main)
    export_hf(trainer, run.sft_model, tokenizer_file)
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
        log.print(f"{s['label']:>15} (step {s['step']:>4}): {metrics}reward {format_metric(s.get('reward_mean'), '.3f')}")


def train(config: Config, resume: str | Path | None = None, progress: bool = True) -> int:
    """Run (or resume) a training run; returns the exit code: 0, 130 (interrupted, checkpoint
    saved) or 1 (a run that cannot learn, loop.py's NoLearningError: one line on stderr,
    checkpoint saved). Raises ConfigError before anything starts (no run directory, no SFT) when
    the config cannot work here, including against the machine (load.py, check_against_machine)."""
    started = time.perf_counter()
    progress = progress and config.logging.progress_bar
    # Every check that can refuse the config comes before the run directory exists: a directory
    # left behind by a refused config would block the retry ("already exists and is not empty").
    check_async(config, int(os.environ.get("WORLD_SIZE", "1")), resolve_device(config.parallel))
    split = config.loop.generator_ranks if config.loop.mode == "async" else 0
    dist = setup_distributed(config.parallel, split)
    check_environment(config, dist.world_size)
    renderer, tokenizer_file = build_renderer(config)
    check_model(config, model_config(config), renderer)
    check_against_machine(config, model_config(config), renderer, dist.device)
    _check_sft_recording(config, renderer)
    if dist.role == "generate":  # a generator rank: rolls out until trainer rank 0 says stop
        return run_generator(config, dist, renderer, config.loop.generator_threads)
    run = _prepare_run_dir(config, resume, dist.is_main)
    if resume is not None and dist.is_main:  # first: a resume refused for a damaged file changes nothing
        for path in sorted(run.trajectories.glob("train_rank*.jsonl")):
            check_recording(path)  # RecordingError: path, line, reason (cut_recordings rewrites these)
    # before config.toml is rewritten: a `latest` pointer refused (trainers/checkpoint.py) changes nothing
    latest, resume_step, positions, pending = _resume_point(run) if resume is not None else (None, 0, [], [])
    config_backup = _update_run_config(run, config) if resume is not None and dist.is_main else None
    sft_done = run.sft_done.is_file()
    redo_sft = config.sft.enabled and not sft_done and latest is None
    if dist.is_main and resume is not None:
        # What the resumed run redoes goes: its steps after the checkpoint, and the step-0 eval
        # when it starts at step 0 (it runs that eval again).
        last_step = resume_step if latest is not None and resume_step > 0 else -1
        if run.metrics.is_file():
            truncate_metrics(run.metrics, last_step, keep_sft=not redo_sft)
        cut_recordings(run, last_step, positions, pending if latest is not None else ())
    barrier()
    log = MetricsLog(config.logging, run.metrics, run.tensorboard, enabled=dist.is_main)
    log.print(
        f"run directory: {run.root}" + (f" (resuming at step {resume_step})" if resume is not None else "")
    )
    if config_backup is not None:
        log.print(f"config.toml: updated with this session's settings (the previous one: {config_backup})")
    for note in schedule_notes(config):
        log.print(note)
    backend = select_policy_backend(config, model_config(config), dist.device)
    if backend is not None:  # every hardware decision of the torch policy, once, and why
        log.print(f"backend: {backend.describe()}")

    demo_accuracy = None
    if redo_sft:
        demo_accuracy = _sft_phase(config, run, dist, renderer, tokenizer_file, log, progress)
    base_dir = (
        run.sft_model if config.sft.enabled else (Path(config.model.path) if config.model.path else None)
    )
    model = load_model(base_dir) if base_dir is not None else initial_model(config)
    hf_dir = base_dir
    if config.policy.backend == "vllm" and hf_dir is None:
        hf_dir = save_initial_model(model, run.initial_model, tokenizer_file, dist.is_main)
    placement = generator_placement(config, dist.device)
    generators: GeneratorProcesses | None = None
    where = "the vLLM engine" if placement is None else "the engine's thread in this process"
    if placement == "process":  # the generator processes and the trainer: their threads
        count, threads, trainer_threads = generator_layout(config, device=dist.device)
        torch.set_num_threads(trainer_threads)
        generators = GeneratorProcesses(config, count, threads, dist.device)
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
    if latest is not None:
        data = manager.load(trainer, latest) or {}
        stream.position = _stream_position(data, dist.rank, dist.world_size)
        push_weights(trainer, policy)
    loop = RLLoop(
        config, run, dist, trainer, policy, renderer, log, manager, stream, resume_step,
        policy_max_seq_len(config, model.config),
    )  # fmt: skip
    loop.pending_groups = pending if latest is not None else []
    loop.resume_positions = positions if latest is not None else []
    total = config.run.steps
    try:
        with asyncio.Runner() as runner:
            loop.start_generators()  # split async: they roll out while rank 0 evaluates
            if loop.step == 0 and config.eval.at_start:
                metrics = loop.evaluate(
                    runner, "after SFT (step 0)" if config.sft.enabled else "initial policy (step 0)"
                )
                hint = sft_shortfall(demo_accuracy, metrics)
                if hint:
                    log.print(hint)
            try:
                loop.run_steps(total, runner, progress)
            except KeyboardInterrupt:
                if dist.world_size > 1 or dist.generators:  # the other ranks got the signal too:
                    raise  # no collective (nor exchange with a generator rank) is safe
                trainer.optimizer.zero_grad(set_to_none=True)
                loop.save_checkpoint()
                log.print(
                    f"interrupted at step {loop.step}; checkpoint saved: toolgym train --resume {run.root}"
                )
                return 130
            except NoLearningError as exc:  # every rank raises it at the same step
                loop.save_checkpoint()
                if dist.is_main:
                    print(f"error: {exc}; checkpoint saved at step {loop.step}", file=sys.stderr)
                return 1
            if loop.step > resume_step or latest is None:
                loop.save_checkpoint()
        if config.run.export_hf:
            export_hf(trainer, run.final_model, tokenizer_file)
        if dist.is_main:
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
    finally:
        loop.close()  # tells the generators to stop
        if generators is not None:
            generators.close()
        policy.close()
        log.close()
    return 0
