"""The RL loop's parts from a config: the rollout runner, the batch source (trainers/loop/
sources.py: sync, async in this process, or async with generator processes or ranks), the
evaluator, the loop's schedule, and the generators' own main.

Which source: `loop.mode = "sync"` -> SyncSource; async -> `placement.py` decides where the
generator runs: "thread" (and vLLM, its own engine) -> ProducerSource; "process" or "ranks" ->
GeneratorSource, whose generators run `run_generator` below.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from ...agents.chat import Renderer
from ...agents.model.checkpoint import read_model
from ...agents.policy import Policy
from ...agents.tokenizer import tokenizer_fingerprint
from ...agents.weight_sets import WeightSets
from ...rollouts.batches import BatchConfig, TaskSeedStream
from ...rollouts.episode.match import MatchRunner
from ...rollouts.episode.opponents import OpponentPool, PoolError
from ...rollouts.episode.runner import RolloutRunner
from ...rollouts.evaluation import EvalReport, evaluate
from ...rollouts.recording.format import (
    JUDGE,
    POLICY_MODEL,
    SCORING,
    TEACHER,
    RecordingHeader,
    RecordingWriter,
    judge_entry,
    policy_model_entry,
    scoring_entry,
    teacher_entry,
)
from ...rollouts.scoring.distill import TeacherScorer
from ...rollouts.scoring.endpoint_teacher import EndpointTeacher
from ...rollouts.scoring.judge import Judge
from ...rollouts.scoring.scorer import OverStale
from ...rollouts.scoring.teacher import GroupTeacher, Teacher
from ...trainers.checkpoint import CheckpointManager
from ...trainers.distributed import DistInfo
from ...trainers.loop.generators import RankGroups, serve_generator
from ...trainers.loop.producer import GroupProducer
from ...trainers.loop.rl import Evaluator, LoopSettings, RLLoop
from ...trainers.loop.sources import POOL_POSITION, BatchSource, GeneratorSource, ProducerSource, SyncSource
from ...trainers.metrics_log import MetricsLog
from ...trainers.trainer import Trainer
from ...trainers.weight_sync import gather_weights, load_and_check
from ..load import ConfigError
from ..run_dir import RunDir
from ..schema import Config
from .parts import (
    build_policy,
    build_renderer,
    initial_model,
    policy_max_seq_len,
    run_chat_template_extra,
    with_lora,
)
from .placement import buffer_capacity
from .plan import RunPlan

if TYPE_CHECKING:
    from ...rollouts.endpoint.agent_runner import AgentRunner


def loop_settings(config: Config) -> LoopSettings:
    return LoopSettings(
        eval=config.eval,
        checkpoint=config.checkpoint,
        logging=config.logging,
        max_steps_without_learning=config.run.max_steps_without_learning,
    )


def over_stale(config: Config) -> OverStale:
    """Async training's rule for over-stale groups ([loop] max_staleness, over_stale, stale_weight)."""
    loop = config.loop
    return OverStale(loop.max_staleness, loop.over_stale, loop.stale_weight)


def build_runner(
    config: Config, policy: Policy, renderer: Renderer, pool: OpponentPool | None = None
) -> RolloutRunner | AgentRunner | MatchRunner:
    """The env runner; with an [agent_program], the runner that drives it through the endpoint;
    with [selfplay], the match runner that plays every seat of the env's game (against `pool`'s
    members with opponent "pool": `build_pool`)."""
    if config.agent_program.module:
        # the endpoint's packages (fastapi, uvicorn, openai) are the `serve` extra: imported when used
        from ...rollouts.endpoint.agent_runner import AgentRunner

        return AgentRunner(policy, renderer, config.agent_program, config.rollout_config())
    runner = RolloutRunner(policy, renderer, config.rollout_config())
    if config.selfplay.enabled:
        return MatchRunner(
            runner,
            learn=config.selfplay.learn,
            opponent=config.selfplay.opponent,
            pool=pool,
            record_opponents=config.logging.record_training,  # every seat of a recorded match
        )
    return runner


def checkpoint_member(directory: str) -> str:
    """A pool checkpoint's member name: its directory's name."""
    return f"ckpt_{Path(directory).name}"


def checkpoint_weights(directory: str) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors, HF-named, as a sync sends them (the tied lm_head dropped)."""
    config, tensors = read_model(directory)
    return [(n, t) for n, t in tensors.items() if not (config.tie_word_embeddings and n == "lm_head.weight")]


def build_pool(
    config: Config, run: RunDir, trainer: Trainer, policy: Policy, state: Mapping | None = None
) -> tuple[OpponentPool, Policy]:
    """[selfplay] opponent "pool": the pool (its snapshots served by `policy` through
    WeightSets, whose live view is returned for the run to use in `policy`'s place), restored
    from a checkpoint's `state` when given. Collective (gathers the trainer's weights)."""
    selfplay = config.selfplay
    weights = WeightSets(policy, gather_weights(trainer), trainer.step)
    pool = OpponentPool(
        selfplay.pool_bots,
        weights=weights,
        directory=run.root / "selfplay_pool",
        every=selfplay.pool_every,
        size=selfplay.pool_size,
        sampling=selfplay.pool_sampling,
        elo_k=selfplay.elo_k,
    )
    for directory in selfplay.pool_checkpoints:
        pool.add_checkpoint(checkpoint_member(directory), checkpoint_weights(directory))
    if state is not None:
        try:
            pool.restore(state)
        except PoolError as exc:
            raise ConfigError("selfplay", str(exc)) from exc
    return pool, weights.live


def recording_header(config: Config, run: RunDir, renderer: Renderer) -> Callable[[str], RecordingHeader]:
    """`header(what)`: a run recording's header (the env, the tokenizer, the chat template, the
    base model and its LoRA adapter's shape; for "train", the run's scoring config)."""
    rollout = config.rollout_config()
    fingerprint = tokenizer_fingerprint(renderer.tokenizer)
    lora = config.policy.lora
    base = str(run.sft_model) if config.sft.enabled else config.model.path or config.model.name
    adapter = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}
    extra = run_chat_template_extra(config) | {
        POLICY_MODEL: policy_model_entry(base, adapter if lora.enabled else None)
    }
    if config.distill.enabled:  # the teacher whose logprobs the transitions carry
        extra[TEACHER] = teacher_entry(config.distill.teacher, fingerprint)

    # How the run scores what it trains on: replay's policy gradient and the viewer score a
    # training recording with it (rollouts/recording/format.py); evals are not trained on.
    scoring = {
        SCORING: scoring_entry(
            config.batch.advantage,
            msgspec.to_builtins(config.trainer.loss),
            train_on_infra_failures=config.batch.train_on_infra_failures,
            distill=config.distill if config.distill.enabled else None,
        )
    }
    if config.judge.enabled:  # the judge whose scores (and transcripts) the trained episodes carry
        scoring[JUDGE] = judge_entry(config.judge)

    def header(what: str) -> RecordingHeader:
        return RecordingHeader(
            tokenizer_fingerprint=fingerprint,
            env_id=rollout.env_id,
            env_kwargs=dict(rollout.env_kwargs),
            policy_id=f"{run.root.name} {what}",
            extra=dict(extra) | (scoring if what == "train" else {}),
        )

    return header


def build_evaluator(
    config: Config,
    run: RunDir,
    policy: Policy,
    renderer: Renderer,
    runner: RolloutRunner | AgentRunner | MatchRunner,
    header: Callable[[str], RecordingHeader],
) -> Evaluator:
    """Rank 0's held-out eval: the env rollouts of `policy`, or the agent program's; its
    recordings get `header` (`recording_header`)."""
    eval_config = config.eval.to_eval_config()
    rollout = config.rollout_config()

    def run_eval(loop: asyncio.Runner) -> EvalReport:
        if isinstance(runner, RolloutRunner | MatchRunner):  # a game's eval: its env's seat against its bot
            report = loop.run(evaluate(policy, renderer, rollout, eval_config))
            for bot in config.selfplay.eval_opponents:  # the seat against each other bot too
                versus = config.rollout_config({**config.env.kwargs, "opponent": bot})
                metrics = loop.run(evaluate(policy, renderer, versus, eval_config, keep_trajectories=False)).metrics
                report.metrics.update({f"eval/vs_{bot}/{k[5:]}": v for k, v in metrics.items() if k.startswith("eval/")})
            return report
        from ...rollouts.endpoint.agent_runner import evaluate_agent  # the `serve` extra, as above

        return loop.run(evaluate_agent(runner, eval_config))

    return Evaluator(
        run=run_eval,
        header=header,
        recording=run.eval_recording if config.eval.record else None,
    )


def build_source(
    config: Config,
    plan: RunPlan,
    dist: DistInfo,
    runner: RolloutRunner | AgentRunner | MatchRunner,
    policy: Policy,
    stream: TaskSeedStream,
    batch_config: BatchConfig,
    teacher: TeacherScorer | None = None,
    judge: Judge | None = None,
) -> BatchSource:
    """The loop's batch source (module doc). `dist.generators`: generator processes or ranks
    joined over `dist.channel` (0: none); `teacher`: on-policy distillation's, `judge`: the
    [judge]'s (both sync and in-process async only: configs/assembly/placement.py refuses the
    others)."""
    if plan.mode == "sync":
        return SyncSource(runner, stream, batch_config, policy, teacher, judge)
    if not dist.generators:
        return ProducerSource(
            runner,
            stream,
            batch_config,
            policy,
            buffer_capacity(config),
            over_stale(config),
            teacher,
            judge,
        )
    groups = None
    if dist.is_main:  # trainer rank 0 speaks to the generators; processes on this machine share memory
        groups = RankGroups(dist.channel, dist.generators, shared_weights=plan.placement == "process")
    return GeneratorSource(groups, stream.stream, batch_config, policy, over_stale(config))


def build_loop(
    config: Config,
    plan: RunPlan,
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
    resumed: Mapping | None = None,
) -> RLLoop:
    """The RL loop over this config's source; `max_seq_len`: the policy's, for batch.max_seq_len 0;
    `resumed`: the data position of the checkpoint it resumes from."""
    split = dist.generators > 0  # every trainer takes the whole batch from the generators
    groups = config.batch.groups_per_batch // (1 if split else dist.world_size)
    batch_config = msgspec.structs.replace(
        config.batch, groups_per_batch=groups, max_seq_len=config.batch.max_seq_len or max_seq_len
    )
    pool = None
    if config.selfplay.enabled and config.selfplay.opponent == "pool":
        pool, policy = build_pool(config, run, trainer, policy, (resumed or {}).get(POOL_POSITION))
    runner = build_runner(config, policy, renderer, pool)
    teacher = build_teacher(config, renderer, dist.device, log)
    judge = build_judge(config, log)
    source = build_source(config, plan, dist, runner, policy, stream, batch_config, teacher, judge)
    header = recording_header(config, run, renderer)  # the tokenizer's fingerprint, the template: once
    writer = None
    if config.logging.record_training and (dist.is_main or not split):  # split: rank 0 has the groups
        writer = RecordingWriter(run.train_recording(dist.rank), header("train"))
    return RLLoop(
        loop_settings(config),
        source,
        trainer,
        policy,
        build_evaluator(config, run, policy, renderer, runner, header),
        log,
        checkpoints,
        dist,
        start_step,
        writer,
    )


def build_teacher(
    config: Config, renderer: Renderer, device: torch.device | str, log: MetricsLog
) -> GroupTeacher | None:
    """[distill]'s teacher (None when distill.teacher is ""): a checkpoint on the run's device
    (rollouts/scoring/teacher.py), or an endpoint URL (endpoint_teacher.py); its tokenizer must be
    the student's."""
    if not config.distill.enabled:
        return None
    fingerprint = tokenizer_fingerprint(renderer.tokenizer)
    temperature = config.policy.temperature
    teacher: GroupTeacher
    if config.distill.endpoint:
        teacher = EndpointTeacher(config.distill, student_fingerprint=fingerprint, temperature=temperature)
    else:
        teacher = Teacher(
            config.distill, student_fingerprint=fingerprint, temperature=temperature, device=device
        )
    log.print(teacher.describe())
    return teacher


def build_judge(config: Config, log: MetricsLog) -> Judge | None:
    """[judge]'s judge (None when judge.url is ""): rollouts/scoring/judge.py."""
    if not config.judge.enabled:
        return None
    judge = Judge(config.judge)
    log.print(judge.describe())
    return judge


def run_generator(
    config: Config, plan: RunPlan, dist_info: DistInfo, renderer: Renderer, threads: int = 0
) -> int:
    """A generator's whole run (a torchrun rank's, or a GeneratorProcesses process's): its engine
    (the trainer's weights replace the initial ones before its first rollout), its share of the
    task stream, until trainer rank 0 says stop. `threads`: its torch threads (0: as set)."""
    if threads:
        torch.set_num_threads(threads)
    # With LoRA its first weights are the whole model (base and adapters), later ones the adapters.
    model = with_lora(config, initial_model(config))
    policy = build_policy(config, model, None, renderer, dist_info.device, placement=plan.placement)
    runner = RolloutRunner(policy, renderer, config.rollout_config())
    max_seq_len = config.batch.max_seq_len or policy_max_seq_len(config, model.config)
    batch_config = msgspec.structs.replace(config.batch, max_seq_len=max_seq_len)
    share = dist_info.generators

    def make_producer(stream: TaskSeedStream, replay: list[int]) -> GroupProducer:
        return GroupProducer(
            runner,
            stream,
            batch_config,
            concurrent_groups=-(-config.batch.groups_per_batch // share),
            capacity=-(-buffer_capacity(config) // share),
            replay=replay,
        )

    del model
    try:

        def load(tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
            load_and_check(policy, dict(tensors), version)

        return serve_generator(dist_info, plan.rl_stream, load, make_producer)
    finally:
        policy.close()


def generator_process_main(config: Config, plan: RunPlan, info: DistInfo) -> None:
    """A spawned generator process's main (trainers/loop/generators.py's GeneratorProcesses)."""
    renderer, _ = build_renderer(config)
    run_generator(config, plan, info, renderer, plan.generator_threads)
