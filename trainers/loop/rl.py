"""The RL loop: take a batch from the source -> train on it -> hand the new weights to the
source -> repeat, with an eval on the held-out seeds every N steps and checkpoints between.

    configs/assembly/loop.py builds it            trainers/loop/sources.py
    ----------------------------------         ---------------------------------------------
    RLLoop.start()  ------------------------>  source.start(trainer, positions, pending)
    RLLoop.evaluate("step 0")                  (generators begin rolling out meanwhile)
    RLLoop.run_steps(total):
      batch = source.next_batch(...)   <-----  SyncSource | ProducerSource | GeneratorSource
      trainer.train_step(batch.episodes)       (rollouts, grading, advantages: rollouts/)
      source.publish(trainer)          ----->  new weights to the policy / the generators
      log, check learning, checkpoint (source.position()), eval

The loop has no mode: sync, async in this process, and async with generator processes or ranks
are the three sources. Under torchrun every rank runs the loop; the trainer's and the sources'
collectives keep the ranks in lockstep. Rank 0 logs, evaluates and records.

Data position (for resume): the loop's step and the source's position, saved in each
checkpoint's meta.json.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from tqdm import tqdm

from ...agents.policy import Policy
from ...rollouts.evaluation import EvalReport
from ...rollouts.recording.format import RecordingHeader, RecordingWriter
from ...rollouts.scoring.judge import JudgeError
from ...rollouts.scoring.teacher import TeacherError
from ..checkpoint import CheckpointManager
from ..config import CheckpointConfig
from ..distributed import DistInfo
from ..metrics_log import LoggingConfig, MetricsLog, eval_line, peak_memory_metrics, train_line
from ..trainer import Trainer
from .sources import BatchSource


class EvalSchedule(msgspec.Struct, kw_only=True):
    """When the loop evaluates (a config's [eval] section extends it): every_steps between evals
    (0: only at start and end), at_start, at_end."""

    every_steps: int = 10
    at_start: bool = True
    at_end: bool = True


class LoopSettings(msgspec.Struct, kw_only=True, frozen=True):
    """The loop's schedule, made of the config's own sections rather than copies of their fields:
    eval (EvalSchedule), checkpoint (every_steps; 0: only at the end), logging (every_steps between
    console lines; headline_metrics: the env metrics shown on the console and the bar), and
    max_steps_without_learning: consecutive steps that changed nothing before NoLearningError
    (0: never)."""

    eval: EvalSchedule = msgspec.field(default_factory=EvalSchedule)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    max_steps_without_learning: int = 5


class NoLearningError(RuntimeError):
    """The run cannot learn: run.max_steps_without_learning steps in a row changed nothing, or
    on-policy distillation's teacher failed distill.max_consecutive_failures groups in a row, or
    the judge judge.max_consecutive_failures (`str()` names the cause and the setting). `train` ends the run with exit code 1."""


def no_learning_cause(metrics: Mapping[str, float], updated_before: bool = False) -> str | None:
    """Why a step's update could not change the policy (None: it could): every group dropped by
    dynamic sampling, no trainable (sampled) token, or a non-finite loss or gradient. Every rank
    reads the same combined metrics, so every rank decides alike. updated_before: the run has
    applied an update; then every group getting one reward is a converged policy (nothing left to
    learn from, not a failure) and does not count."""
    if metrics.get("train/episodes", 0.0) == 0:
        rolled = metrics.get("dynamic_sampling/groups_rolled_out", 0.0)
        if rolled and metrics.get("batch/groups_scoring_failed", 0.0) >= rolled:
            return "the teacher's or judge's scoring failed for every group (distill.teacher, judge.url)"
        if rolled and metrics.get("batch/groups_without_trainable", 0.0) >= rolled:
            return "0 trainable tokens (no sampled token in any episode)"
        if updated_before:
            return None
        return (
            "batch.dynamic_sampling dropped every group (each group's episodes got one reward; reward "
            f"mean {metrics.get('rollout/reward_mean', 0.0):.3f}: a constant reward, or a converged policy)"
        )
    if metrics.get("batch/sampled_tokens", 1.0) == 0:
        return "0 trainable tokens (no sampled token in any episode)"
    if metrics.get("train/skipped"):
        return "the update was skipped (non-finite loss or gradient)"
    return None


@dataclass(frozen=True)
class Evaluator:
    """How rank 0 evaluates: `run(asyncio_runner) -> EvalReport` on the held-out seeds; each
    eval's trajectories go to `recording(step)` (None: not recorded) with `header(what)`."""

    run: Callable[[asyncio.Runner], EvalReport]
    header: Callable[[str], RecordingHeader]
    recording: Callable[[int], Path] | None = None


class RLLoop:
    """Owns the per-run objects (source, trainer, eval policy); built once, stepped many times."""

    def __init__(
        self,
        settings: LoopSettings,
        source: BatchSource,
        trainer: Trainer,
        policy: Policy,
        evaluator: Evaluator,
        log: MetricsLog,
        checkpoints: CheckpointManager,
        dist: DistInfo,
        start_step: int = 0,
        train_writer: RecordingWriter | None = None,
    ) -> None:
        """`policy`: the one rank 0 evaluates; `train_writer`: where this rank records the
        trajectories it rolls out (None: not recorded)."""
        self.settings, self.source, self.trainer, self.policy = settings, source, trainer, policy
        self.evaluator, self.log, self.checkpoints, self.dist = evaluator, log, checkpoints, dist
        self.step = start_step
        self.steps_without_learning = 0  # consecutive, with the cause of the last one
        self._no_learning_cause = ""
        self.eval_history: list[tuple[int, dict[str, float]]] = []
        self._train_writer = train_writer

    def start(self, positions: Sequence[int] = (), pending: Sequence[int] = ()) -> None:
        """Start the source at the checkpoint's positions and pending tasks (collective)."""
        self.source.start(self.trainer, positions, pending)

    # ---- checkpoints ------------------------------------------------------------------------

    def data_position(self) -> dict[str, Any]:
        """Collective: the step and the source's position."""
        return {"rl_step": self.step, **self.source.position()}

    def save_checkpoint(self) -> None:
        self.checkpoints.save(self.trainer, self.data_position())

    # ---- eval -------------------------------------------------------------------------------

    def evaluate(self, runner: asyncio.Runner, label: str) -> dict[str, float] | None:
        """Rank 0 evaluates its policy on the held-out seeds, logs, prints a few transcripts."""
        if not self.dist.is_main:
            return None
        report = self.evaluator.run(runner)
        metrics = dict(report.metrics)
        metrics["eval/policy_version"] = float(self.policy.policy_version)
        self.log.log("eval", self.step, metrics)
        for example in report.examples:
            self.log.print(example)
        self.log.print(eval_line(label, metrics, self.settings.logging.headline_metrics))
        if self.evaluator.recording is not None:
            path = self.evaluator.recording(self.step)
            # One file per eval, written afresh: the writer appends, and a resumed run that
            # redoes this eval must not leave two copies of it (replay would count both).
            path.unlink(missing_ok=True)
            with RecordingWriter(path, self.evaluator.header(f"eval step {self.step}")) as w:
                w.write_all(report.trajectories)
        self.eval_history.append((self.step, metrics))
        return metrics

    def eval_due(self, total: int) -> bool:
        """Whether the schedule evaluates at this step of a run of `total` steps."""
        schedule = self.settings.eval
        every = schedule.every_steps
        return (every > 0 and self.step % every == 0) or (self.step == total and schedule.at_end)

    # ---- one step ---------------------------------------------------------------------------

    def train_one_step(self, runner: asyncio.Runner) -> dict[str, float]:
        """Take a batch, train, publish the weights. Collective. Returns the step's metrics (all
        ranks combined)."""
        started = time.perf_counter()
        try:
            batch = self.source.next_batch(runner, self.trainer.step)
        except (TeacherError, JudgeError) as exc:  # the collector raises them; every rank's count alike
            raise NoLearningError(str(exc)) from exc
        rolled = time.perf_counter()
        train: dict[str, float] = {}
        sync_s = 0.0
        if batch.total_episodes > 0:
            train = self.trainer.train_step(batch.episodes, sharded=self.source.sharded)
            trained = time.perf_counter()
            if not train["skipped"]:
                sync_s = self.source.publish(self.trainer)
        else:  # every group was dropped (zero variance): nothing to learn from this step
            trained = rolled
        self.step += 1
        if self._train_writer is not None:
            self._train_writer.write_all(batch.trajectories)
        metrics = dict(batch.metrics)
        metrics.update({f"train/{k}": v for k, v in train.items()})
        metrics.update(
            {
                "time/rollout_s": rolled - started,
                "time/train_s": trained - rolled,
                "time/sync_s": sync_s,
                "time/step_s": time.perf_counter() - started,
                "train/episodes": batch.total_episodes,
                "policy_version": float(self.trainer.step),
                **peak_memory_metrics(self.trainer.device),
            }
        )
        return metrics

    def run_steps(self, total: int, runner: asyncio.Runner, progress: bool) -> None:
        """Steps self.step+1 .. total, evals and checkpoints as configured."""
        settings = self.settings
        with tqdm(
            total=total,
            initial=self.step,
            desc="rl",
            unit="step",
            disable=not (progress and self.dist.is_main),
            dynamic_ncols=True,
        ) as bar:
            while self.step < total:
                metrics = self.train_one_step(runner)
                self.log.log("train", self.step, metrics)
                if metrics.get("train/skipped"):
                    self.log.print(f"step {self.step}: non-finite loss or grad norm; update skipped")
                if self.step % settings.logging.every_steps == 0 or self.step == total:
                    self.log.print(train_line(self.step, total, metrics, settings.logging.headline_metrics))
                bar.update(1)
                headline = {
                    name: f"{metrics.get(f'rollout/{name}', 0.0):.2f}"
                    for name in settings.logging.headline_metrics
                }
                bar.set_postfix(
                    {"reward": f"{metrics.get('rollout/reward_mean', 0.0):.2f}", **headline}, refresh=False
                )
                self._check_learning(metrics)
                every_ckpt = settings.checkpoint.every_steps
                if every_ckpt and self.step % every_ckpt == 0 and self.step != total:
                    self.save_checkpoint()
                if self.eval_due(total):
                    self.evaluate(runner, f"step {self.step}")

    def _check_learning(self, metrics: Mapping[str, float]) -> None:
        """Count the steps in a row that could not change the policy; raise NoLearningError when
        they reach max_steps_without_learning (a run that would otherwise finish "successfully"
        having learned nothing)."""
        cause = no_learning_cause(metrics, updated_before=self.trainer.step > 0)
        self.steps_without_learning = 0 if cause is None else self.steps_without_learning + 1
        self._no_learning_cause = cause or ""
        limit = self.settings.max_steps_without_learning
        if limit and self.steps_without_learning >= limit:
            raise NoLearningError(
                f"the run cannot learn: {self.steps_without_learning} steps in a row (up to step "
                f"{self.step}) changed nothing; last cause: {self._no_learning_cause} "
                f"(run.max_steps_without_learning = {limit}; 0 never stops)"
            )

    def close(self) -> None:
        self.source.close()
        if self._train_writer is not None:
            self._train_writer.close()
