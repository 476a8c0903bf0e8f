"""The RL loop: sample task seeds -> roll out groups -> grade -> advantages (and DAPO dynamic
sampling) -> train -> push the new weights into the policy -> repeat, with an eval on the held-out
seeds every N steps.

`loop.mode = "sync"` (default) does these one after the other. `loop.mode = "async"` rolls out on
a background producer (configs/async_rl/) while the trainer trains: each step takes finished
groups from its buffer under the staleness bound, trains, and pushes the weights, which the
generator takes between requests. Its checkpoints also store the task indices drawn but not yet
trained on (`pending`), which a resumed run rolls out first.

Async mode under torchrun (`loop.generator_ranks`) splits the ranks: generator ranks roll out,
trainer rank 0 takes their groups (configs/async_rl/ranks.py' RankGroups) and broadcasts each
batch to the other trainers, which train on their share; the weights go back to the generators
after each step. Rank 0 keeps its own policy for evals.

Otherwise, under torchrun every rank has its own policy, rolls out its share of the groups from its own
(rank-disjoint) task seed stream, and trains on its own episodes (`train_step(sharded=True)`: the
trainer's counts are all-reduced, so the update is the whole batch's). Every rank's policy gets
the new weights. Rank 0 logs, evaluates and records; checkpoints are collectives. The ranks stay
in lockstep through the trainer's collectives and the per-step metrics gather.

Data position (for resume): the loop's step and every rank's task-stream position, saved in each
checkpoint's meta.json.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from tqdm import tqdm

from ..agents.chat import ChatRenderer, Renderer
from ..agents.policy import Policy
from ..agents.tokenizer import tokenizer_fingerprint
from ..rollouts.batches import BatchConfig, RolloutBatch, TaskSeedStream, collect_batch
from ..rollouts.evaluation import EvalReport, evaluate
from ..rollouts.recording.format import CHAT_TEMPLATE, RecordingHeader, RecordingWriter, chat_template_entry
from ..rollouts.runner import EnvRolloutConfig, RolloutRunner
from ..trainers.checkpoint import CheckpointManager
from ..trainers.distributed import DistInfo, all_gather_objects, all_reduce, broadcast_object
from ..trainers.trainer import Trainer
from ..trainers.weight_sync import gather_weights, push_weights
from .async_rl.batch import take_batch
from .async_rl.placement import buffer_capacity, generator_placement
from .async_rl.producer import GroupProducer
from .async_rl.ranks import RankGroups
from .metrics_log import MetricsLog, eval_line, train_line
from .run_dir import RunDir
from .schema import Config

if TYPE_CHECKING:
    from ..rollouts.endpoint.agent_runner import AgentRunner

# Per-rank batch metrics that add up over ranks (the rest are means over episodes, or maxima).
_SUMMED = (
    "rollout/episodes",
    "rollout/tokens_generated",
    "rollout/errors",
    "rollout/episodes_per_s",
    "rollout/tokens_per_s",
    "batch/groups",
    "batch/tokens",
    "batch/sampled_tokens",
    "batch/groups_without_trainable",
    "dynamic_sampling/groups_rolled_out",
    "dynamic_sampling/surplus_groups",
)
_MAXED = ("rollout/time_s", "dynamic_sampling/rounds")


def combine_rank_metrics(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One step's rollout metrics over all ranks: sums of counts, episode-weighted means of the rest."""
    if len(parts) == 1:
        return dict(parts[0])
    weights = [float(p.get("rollout/episodes", 0.0)) for p in parts]
    total = sum(weights)
    out: dict[str, float] = {}
    for key in sorted({k for p in parts for k in p}):
        values = [float(p.get(key, 0.0)) for p in parts]
        if key in _SUMMED or key.startswith(("rollout/errors/", "episodes/")):
            out[key] = sum(values)
        elif key in _MAXED:
            out[key] = max(values)
        elif total > 0:
            out[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / total
        else:
            out[key] = sum(values) / len(values)
    return out


def chat_template_extra(config: Config, renderer: Renderer) -> dict[str, Any]:
    """A run recording's header `extra`: the chat template the run renders with
    (policy.chat_template and its variables), so `replay` rebuilds the same renderer; {} for
    plain ChatML."""
    if isinstance(renderer, ChatRenderer) or not config.policy.chat_template:
        return {}
    from ..agents.chat_template import load_chat_template
    from .load import chat_template_path

    template = load_chat_template(chat_template_path(config.policy.chat_template))
    return {CHAT_TEMPLATE: chat_template_entry(template, config.policy.chat_template_kwargs)}


class NoLearningError(RuntimeError):
    """The run cannot learn: run.max_steps_without_learning steps in a row changed nothing
    (`str()` names the cause and the setting). `train` ends the run with exit code 1."""


def no_learning_cause(metrics: Mapping[str, float], updated_before: bool = False) -> str | None:
    """Why a step's update could not change the policy (None: it could): every group dropped by
    dynamic sampling, no trainable (sampled) token, or a non-finite loss or gradient. Every rank
    reads the same combined metrics, so every rank decides alike. updated_before: the run has
    applied an update; then every group getting one reward is a converged policy (nothing left to
    learn from, not a failure) and does not count."""
    if metrics.get("train/episodes", 0.0) == 0:
        rolled = metrics.get("dynamic_sampling/groups_rolled_out", 0.0)
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


class RLLoop:
    """Owns the per-run objects (runner, policy, trainer, stream); built once, stepped many times."""

    def __init__(
        self,
        config: Config,
        run: RunDir,
        dist: DistInfo,
        trainer: Trainer,
        policy: Policy,
        renderer: Renderer,
        log: MetricsLog,
        checkpoints: CheckpointManager,
        stream: TaskSeedStream,
        start_step: int = 0,
        max_seq_len: int | None = None,
    ) -> None:
        self.config, self.run, self.dist = config, run, dist
        self.trainer, self.policy, self.renderer, self.log = trainer, policy, renderer, log
        self.checkpoints, self.stream = checkpoints, stream
        self.step = start_step
        self.steps_without_learning = 0  # consecutive, with the cause of the last one
        self._no_learning_cause = ""
        self.rollout: EnvRolloutConfig = config.rollout_config()
        self.split = dist.generators > 0  # async across ranks: generator ranks roll out
        groups = config.batch.groups_per_batch // (1 if self.split else dist.world_size)
        self.batch_config: BatchConfig = msgspec.structs.replace(
            config.batch, groups_per_batch=groups, max_seq_len=config.batch.max_seq_len or max_seq_len
        )
        self.runner: RolloutRunner | AgentRunner
        if config.agent_program.module:  # an agent program, through the endpoint
            from ..rollouts.endpoint.agent_runner import AgentRunner

            self.runner = AgentRunner(policy, renderer, config.agent_program, self.rollout)
        else:
            self.runner = RolloutRunner(policy, renderer, self.rollout)
        self.eval_history: list[tuple[int, dict[str, float]]] = []
        self._fingerprint = tokenizer_fingerprint(renderer.tokenizer)
        self._header_extra = chat_template_extra(config, renderer)
        self.producer: GroupProducer | None = None  # async mode: started at the first step
        self.pending_groups: list[int] = []  # async resume: task indices to roll out first
        self.resume_positions: list[int] = []  # split async resume: each generator's stream position
        # split async: rank 0 speaks to the generators (it always tells them to stop, in close)
        self.rank_groups = None
        if self.split and dist.is_main:  # generator processes on this machine share the weights' memory
            shared = generator_placement(config, dist.device) == "process"
            self.rank_groups = RankGroups(dist.channel, dist.generators, shared_weights=shared)
        self._generators_started = False
        self._train_writer: RecordingWriter | None = None
        if config.logging.record_training and (dist.is_main or not self.split):  # split: rank 0 has the groups
            self._train_writer = RecordingWriter(run.train_recording(dist.rank), self._header("train"))

    # ---- checkpoints ------------------------------------------------------------------------

    def data_position(self) -> dict[str, Any]:
        """Collective: every rank's stream position; in async mode (one rank) also the task
        indices drawn and not yet trained on, which a resumed run rolls out first."""
        if self.split:  # rank 0's view is the one saved
            if self.rank_groups is not None and self._generators_started:
                positions, pending = self.rank_groups.position()
            else:
                positions, pending = self.resume_positions, sorted(self.pending_groups)
            stream = self.stream.stream
            return {"rl_step": self.step, "stream": stream, "positions": positions, "pending": pending}
        if self.config.loop.mode == "async":
            position, pending = (
                self.producer.position()
                if self.producer is not None
                else (self.stream.position, sorted(self.pending_groups))
            )
            return {
                "rl_step": self.step,
                "stream": self.stream.stream,
                "positions": [position],
                "pending": pending,
            }
        positions = all_gather_objects(self.stream.position)
        return {"rl_step": self.step, "stream": self.stream.stream, "positions": positions}

    def save_checkpoint(self) -> None:
        self.checkpoints.save(self.trainer, self.data_position())

    # ---- eval -------------------------------------------------------------------------------

    def _header(self, what: str) -> RecordingHeader:
        return RecordingHeader(
            tokenizer_fingerprint=self._fingerprint,
            env_id=self.rollout.env_id,
            env_kwargs=dict(self.rollout.env_kwargs),
            policy_id=f"{self.run.root.name} {what}",
            extra=dict(self._header_extra),
        )

    def evaluate(self, runner: asyncio.Runner, label: str) -> dict[str, float] | None:
        """Rank 0 evaluates its policy on the held-out seeds, logs, prints a few transcripts."""
        if not self.dist.is_main:
            return None
        eval_config = self.config.eval.to_eval_config()
        if isinstance(self.runner, RolloutRunner):
            report: EvalReport = runner.run(evaluate(self.policy, self.renderer, self.rollout, eval_config))
        else:
            from ..rollouts.endpoint.agent_runner import evaluate_agent

            report = runner.run(evaluate_agent(self.runner, eval_config))
        metrics = dict(report.metrics)
        metrics["eval/policy_version"] = float(self.policy.policy_version)
        self.log.log("eval", self.step, metrics)
        for example in report.examples:
            self.log.print(example)
        self.log.print(eval_line(label, metrics, self.config.logging.headline_metrics))
        if self.config.eval.record:
            path = self.run.eval_recording(self.step)
            # One file per eval, written afresh: the writer appends, and a resumed run that
            # redoes this eval must not leave two copies of it (replay would count both).
            path.unlink(missing_ok=True)
            with RecordingWriter(path, self._header(f"eval step {self.step}")) as w:
                w.write_all(report.trajectories)
        self.eval_history.append((self.step, metrics))
        return metrics

    def _eval_due(self, total: int) -> bool:
        every = self.config.eval.every_steps
        return (every > 0 and self.step % every == 0) or (self.step == total and self.config.eval.at_end)

    # ---- one step ---------------------------------------------------------------------------

    def train_one_step(self, runner: asyncio.Runner) -> dict[str, float]:
        """Roll out, train, sync. Collective. Returns the step's metrics (all ranks combined)."""
        started = time.perf_counter()
        if self.config.loop.mode == "async":
            batch = self._take_async_batch()
        else:
            batch = runner.run(collect_batch(self.runner, self.stream, self.batch_config))
        rolled = time.perf_counter()
        # split: every trainer holds the whole batch and trains on its share
        (episodes,) = [float(len(batch.episodes))] if self.split else all_reduce([float(len(batch.episodes))])
        train: dict[str, float] = {}
        sync_s = 0.0
        if episodes > 0:
            train = self.trainer.train_step(batch.episodes, sharded=not self.split)
            trained = time.perf_counter()
            if not train["skipped"]:
                sync_s = self._sync_weights()
        else:  # every group was dropped (zero variance): nothing to learn from this step
            trained = rolled
        self.step += 1
        if self._train_writer is not None:
            self._train_writer.write_all(batch.trajectories)
        if self.split:  # rank 0's, broadcast with the batch
            metrics = dict(batch.metrics)
        else:
            metrics = combine_rank_metrics(all_gather_objects(batch.metrics))
        metrics.update({f"train/{k}": v for k, v in train.items()})
        metrics.update(
            {
                "time/rollout_s": rolled - started,
                "time/train_s": trained - rolled,
                "time/sync_s": sync_s,
                "time/step_s": time.perf_counter() - started,
                "train/episodes": episodes,
                "policy_version": float(self.trainer.step),
            }
        )
        return metrics

    def _sync_weights(self) -> float:
        """The trainer's new weights into this rank's policy and (split) the generator ranks'.
        Collective; returns its wall time."""
        if not self.split:
            return push_weights(self.trainer, self.policy)
        started = time.perf_counter()
        weights = gather_weights(self.trainer)
        self.policy.load_weights(weights.items(), self.trainer.step)
        if self.rank_groups is not None:
            self.rank_groups.send_weights(weights, self.trainer.step)
        return time.perf_counter() - started

    def start_generators(self) -> None:
        """Split async: send the generator ranks their stream positions and the weights, which
        starts their rollouts (collective: every trainer gathers the weights). Called before the
        step-0 eval, so the generators' warm-up (a CUDA engine compiles and captures graphs on its
        first requests) and first groups overlap it; otherwise at the first step. A no-op once
        done, and outside the split."""
        if not self.split or self._generators_started:
            return
        weights = gather_weights(self.trainer)
        if self.rank_groups is not None:
            self.rank_groups.start(self.resume_positions, sorted(self.pending_groups))
            self.rank_groups.send_weights(weights, self.trainer.step)
        self._generators_started = True

    def _take_split_batch(self) -> RolloutBatch:
        """Split async: rank 0 takes the batch from the generator ranks (started first, if not
        yet) and broadcasts its episodes and metrics to the other trainers."""
        self.start_generators()
        batch = None
        if self.rank_groups is not None:
            loop = self.config.loop
            batch = take_batch(
                self.rank_groups, self.batch_config, self.trainer.step,
                loop.max_staleness, loop.over_stale, loop.stale_weight,
            )  # fmt: skip
        episodes, metrics = broadcast_object((batch.episodes, batch.metrics) if batch is not None else None)
        if batch is None:
            batch = RolloutBatch(episodes=episodes, trajectories=[], advantages=[], kept=[], metrics=metrics)
        return batch

    def _take_async_batch(self) -> RolloutBatch:
        """The next batch from the producer (started on first use), under the staleness bound."""
        if self.split:
            return self._take_split_batch()
        if self.producer is None:
            self.producer = GroupProducer(
                self.runner,
                self.stream,
                self.batch_config,
                concurrent_groups=self.batch_config.groups_per_batch,
                capacity=buffer_capacity(self.config),
                replay=self.pending_groups,
            )
        loop = self.config.loop
        return take_batch(
            self.producer,
            self.batch_config,
            self.trainer.step,
            loop.max_staleness,
            loop.over_stale,
            loop.stale_weight,
        )

    def run_steps(self, total: int, runner: asyncio.Runner, progress: bool) -> None:
        """Steps self.step+1 .. total, evals and checkpoints as configured."""
        every_ckpt = self.config.checkpoint.every_steps
        every_log = self.config.logging.every_steps
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
                if self.step % every_log == 0 or self.step == total:
                    self.log.print(train_line(self.step, total, metrics, self.config.logging.headline_metrics))
                bar.update(1)
                headline = {
                    name: f"{metrics.get(f'rollout/{name}', 0.0):.2f}"
                    for name in self.config.logging.headline_metrics
                }
                bar.set_postfix(
                    {"reward": f"{metrics.get('rollout/reward_mean', 0.0):.2f}", **headline}, refresh=False
                )
                self._check_learning(metrics)
                if every_ckpt and self.step % every_ckpt == 0 and self.step != total:
                    self.save_checkpoint()
                if self._eval_due(total):
                    self.evaluate(runner, f"step {self.step}")

    def _check_learning(self, metrics: Mapping[str, float]) -> None:
        """Count the steps in a row that could not change the policy; raise NoLearningError when
        they reach run.max_steps_without_learning (a run that would otherwise finish "successfully"
        having learned nothing)."""
        cause = no_learning_cause(metrics, updated_before=self.trainer.step > 0)
        self.steps_without_learning = 0 if cause is None else self.steps_without_learning + 1
        self._no_learning_cause = cause or ""
        limit = self.config.run.max_steps_without_learning
        if limit and self.steps_without_learning >= limit:
            raise NoLearningError(
                f"the run cannot learn: {self.steps_without_learning} steps in a row (up to step "
                f"{self.step}) changed nothing; last cause: {self._no_learning_cause} "
                f"(run.max_steps_without_learning = {limit}; 0 never stops)"
            )

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.rank_groups is not None:
            self.rank_groups.close()
        if self._train_writer is not None:
            self._train_writer.close()
