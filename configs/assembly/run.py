"""One training run's phases, for `toolgym train` (configs/cli/train.py), each over its run plan
(plan.py): the run directory opened (new, or resumed at its latest checkpoint: run_dir.py), the
SFT warm start, the RL parts (model, policy, generators, trainer, task stream, loop), and the
finish (the final policy exported, summary.json, the before/after lines, the plots).

Resume: a run with an RL checkpoint continues from it (model, optimizer, schedule, RNG, step, the
task streams' positions); metrics.jsonl and the recordings under trajectories/ keep what came up
to that step, so that each redone step is there once. A run whose SFT phase finished
(sft_done.json) starts RL from sft_model/; an SFT phase that was cut short is redone.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...agents.chat import Renderer
from ...agents.policy import Policy
from ...rollouts.batches import TaskSeedStream
from ...rollouts.metrics import env_metric_names
from ...rollouts.recording.format import check_recording
from ...trainers.checkpoint import CheckpointManager, export_hf
from ...trainers.distributed import DistInfo, all_gather_objects, barrier
from ...trainers.loop.generators import GeneratorProcesses
from ...trainers.loop.rl import RLLoop
from ...trainers.metrics_log import MetricsLog, display_name, format_metric, read_metrics, truncate_metrics
from ...trainers.plots import plot_run
from ...trainers.sft import run_sft
from ...trainers.weight_sync import push_weights
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
from .demos import demo_episodes, sft_schedule, sft_trainer_config
from .loop import build_loop, generator_process_main
from .parts import (
    build_policy,
    build_trainer,
    chat_template_text,
    describe_policy,
    initial_model,
    load_model,
    model_config,
    policy_max_seq_len,
    save_initial_model,
    with_lora,
)
from .plan import RunPlan

# summary.json's before/after: these and every metric the env reported (envs' info["metrics"]).
SUMMARY_KEYS = ("eval/reward_mean", "eval/turns_mean")


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


def open_run(
    config: Config, plan: RunPlan, resume: str | Path | None, dist: DistInfo
) -> tuple[RunDir, ResumePoint]:
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
    point.redo_sft = plan.sft and not run.sft_done.is_file() and point.latest is None
    if dist.is_main and resume is not None:
        # What the resumed run redoes goes: its steps after the checkpoint, and the step-0 eval
        # when it starts at step 0 (it runs that eval again).
        last_step = point.step if point.latest is not None and point.step > 0 else -1
        if run.metrics.is_file():
            truncate_metrics(run.metrics, last_step, keep_sft=not point.redo_sft)
        cut_recordings(run, last_step, point.positions, point.pending)
    barrier()
    return run, point


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


def build_rl(
    config: Config,
    plan: RunPlan,
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
    base_dir = rl_base_dir(config, plan, run)
    base_dir = base_dir if base_dir != run.initial_model else None
    model = load_model(base_dir, config.policy.implementation) if base_dir is not None else initial_model(config)
    hf_dir = base_dir
    # vLLM loads its model from disk; LoRA adapters are exported over a base that must be on disk.
    if (config.policy.backend == "vllm" or config.policy.lora.enabled) and hf_dir is None:
        hf_dir = save_initial_model(model, run.initial_model, tokenizer_file, dist.is_main)
    with_lora(config, model)  # SFT trained the whole model; RL trains the adapters over it
    generators: GeneratorProcesses | None = None
    if plan.placement == "process":  # the generator processes and the trainer: their threads
        torch.set_num_threads(plan.trainer_threads)
        generators = GeneratorProcesses(
            generator_process_main, (config, plan), plan.generator_processes, dist.device
        )
        dist = dataclasses.replace(dist, channel=generators.channel, generators=plan.generator_processes)
    policy = build_policy(config, model, hf_dir, renderer, dist.device, backend, plan.placement)
    log.print(describe_policy(policy, config.policy.implementation))
    if plan.mode == "async":
        where = plan.describe_placement()
        if plan.placement == "ranks":
            where = (
                f"torchrun ranks {dist.world_size}..{dist.world_size + dist.generators - 1}, "
                f"the trainer on ranks 0..{dist.world_size - 1}"
            )
        log.print(
            f"loop: async, max_staleness {config.loop.max_staleness} ({config.loop.over_stale} older groups), "
            f"generator: {where}"
        )
    reference = copy.deepcopy(model) if config.trainer.loss.kl_coef > 0 else None
    trainer = build_trainer(
        config.trainer, model, dist.device, reference, sampling=config.policy,
        forward_kl_weight=config.distill.forward_kl,
    )  # fmt: skip
    manager = CheckpointManager(run.rl_checkpoints, config.checkpoint.keep_last)
    stream = TaskSeedStream(stream=plan.rl_stream, rank=dist.rank, world_size=dist.world_size)
    data = None
    if point.latest is not None:
        data = manager.load(trainer, point.latest) or {}
        stream.position = stream_position(data, dist.rank, dist.world_size)
        push_weights(trainer, policy)
    loop = build_loop(
        config, plan, run, dist, trainer, policy, renderer, log, manager, stream, point.step,
        policy_max_seq_len(config, model.config), resumed=data,
    )  # fmt: skip
    return RLParts(loop, policy, generators)


def rl_base_dir(config: Config, plan: RunPlan, run: RunDir) -> Path:
    """The HF directory RL starts from: the SFT model, model.path, else the initial weights'
    directory (written only where needed: vLLM, or LoRA's adapters need their base on disk)."""
    if plan.sft:
        return run.sft_model
    return Path(config.model.path) if config.model.path else run.initial_model


def sft_phase(
    config: Config, run: RunDir, dist: DistInfo, renderer: Renderer, tokenizer_file: Path, log: MetricsLog,
    progress: bool,
) -> float | None:
    """SFT on the configured demonstrations; returns their accuracy (None if unknown)."""
    max_seq_len = policy_max_seq_len(config, model_config(config))
    record_to = run.trajectories / "sft_demos.jsonl" if dist.is_main else None
    if record_to is not None and record_to.exists():
        record_to.unlink()  # a redone SFT phase writes its demos afresh
    if config.sft.source == "oracle":
        log.print(f"sft: recording {config.sft.num_tasks} demonstrations of {config.env.id} with its oracle")
    episodes, data_metrics, source = demo_episodes(
        config, renderer, max_seq_len, record_to, progress and dist.is_main
    )
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


def finish(
    config: Config, plan: RunPlan, run: RunDir, rl: RLParts, log: MetricsLog, tokenizer_file: Path, started: float
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
            base_model=str(rl_base_dir(config, plan, run).resolve()),
        )
    if loop.dist.is_main:
        summary = _summary(run, loop, plan.sft, started, config.logging.headline_metrics)
        run.write_json(run.summary, summary)
        _print_summary(log, summary, config.logging.headline_metrics)
        if config.run.plot and config.logging.jsonl:
            written = plot_run(run.root)
            log.print(f"plots: {', '.join(str(p) for p in written)}")
        elif config.run.plot:  # the plots are drawn from metrics.jsonl, which this run did not write
            log.print("plots: none (they are drawn from metrics.jsonl: set logging.jsonl = true)")
        log.print(f"done in {summary['wall_time_s']:.0f}s: {run.root}")
    barrier()


def _summary(
    run: RunDir, loop: RLLoop, sft: bool, started: float, headline: Sequence[str] = ()
) -> dict[str, Any]:
    evals = [r for r in read_metrics(run.metrics) if r.get("kind") == "eval"]
    if not evals:
        evals = [{"step": s, **m} for s, m in loop.eval_history]
    summary: dict[str, Any] = {"wall_time_s": time.perf_counter() - started, "steps": loop.step}
    if evals:
        first, last = evals[0], evals[-1]
        for name, record in (("before", first), ("after", last)):
            keys = [*SUMMARY_KEYS, *(f"eval/{n}" for n in env_metric_names(record, "eval/"))]
            keys += [f"eval/{n}" for n in headline if f"eval/{n}" in record and f"eval/{n}" not in keys]
            summary[name] = {"step": record["step"], **{k.removeprefix("eval/"): record.get(k) for k in keys}}
        # "before" is the policy RL started from only when it was evaluated at step 0
        # (eval.at_start); else it is the first eval, already after some RL steps
        if first["step"] == 0:
            summary["before"]["label"] = "after SFT" if sft else "initial policy"
        else:
            summary["before"]["label"] = "first eval"
        summary["after"]["label"] = "after RL"
    return summary


def _print_summary(log: MetricsLog, summary: dict[str, Any], headline: Sequence[str]) -> None:
    """The before/after lines: the headline metrics (logging.headline_metrics) and the reward."""
    if "before" not in summary:
        return
    log.print("")
    one_eval = summary["before"]["step"] == summary["after"]["step"]  # the same eval: one line
    for key in ("after",) if one_eval else ("before", "after"):
        s = summary[key]
        metrics = "".join(f"{display_name(n)} {format_metric(s.get(n), '.3f')}  " for n in headline)
        log.print(
            f"{s['label']:>15} (step {s['step']:>4}): {metrics}reward {format_metric(s.get('reward_mean'), '.3f')}"
        )


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


def eval_kept(config: Config, run: RunDir, step: int) -> bool:
    """Whether the run directory holds the eval of `step` whole: its metrics row and, where
    evals are recorded, its recording. A run stopped during the eval that follows a checkpoint
    at the same step has neither (or only the row), and its resume redoes that eval."""
    recorded = not config.eval.record or run.eval_recording(step).is_file()
    rows = read_metrics(run.metrics) if run.metrics.is_file() else []
    return recorded and any(r.get("kind") == "eval" and r.get("step") == step for r in rows)
