"""RLLoop built directly from small real parts, once per batch source (sync collection, a
producer in this process, a generator process), without the CLI or a Config: two steps, an eval,
a checkpoint, the policy on the trainer's weights, the source's position for resume."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from loop_parts import BATCH, ROLLOUT, STREAM, engine, generator_main, model, renderer, runner

from toolgym.rollouts.batches import TaskSeedStream
from toolgym.rollouts.evaluation import EvalConfig, evaluate
from toolgym.rollouts.recording.format import RecordingHeader, read_recording
from toolgym.rollouts.scoring.scorer import OverStale
from toolgym.trainers.checkpoint import CheckpointManager
from toolgym.trainers.config import CheckpointConfig, TrainerConfig
from toolgym.trainers.distributed import init_distributed
from toolgym.trainers.loop.generators import GeneratorProcesses, RankGroups
from toolgym.trainers.loop.rl import EvalSchedule, Evaluator, LoopSettings, RLLoop
from toolgym.trainers.loop.sources import GeneratorSource, ProducerSource, SyncSource
from toolgym.trainers.metrics_log import LoggingConfig, MetricsLog, read_metrics
from toolgym.trainers.trainer import Trainer

pytestmark = pytest.mark.slow

OVER_STALE = OverStale(max_staleness=1, rule="drop", weight=0.5)


def build_loop(tmp_path, kind: str):
    chat = renderer()
    weights = model()
    policy = engine(weights, chat, **({} if kind == "sync" else {"weight_updates": "in_flight"}))
    trainer = Trainer(weights, TrainerConfig(micro_batch_tokens=2048), device="cpu")
    dist = init_distributed("cpu")
    generators = None
    stream = TaskSeedStream(stream=STREAM)
    if kind == "sync":
        source = SyncSource(runner(policy, chat), stream, BATCH, policy)
    elif kind == "producer":
        source = ProducerSource(runner(policy, chat), stream, BATCH, policy, 4, OVER_STALE)
    else:
        generators = GeneratorProcesses(generator_main, (), 1, "cpu")
        dist = dataclasses.replace(dist, channel=generators.channel, generators=1)
        groups = RankGroups(generators.channel, 1, shared_weights=True)
        source = GeneratorSource(groups, STREAM, BATCH, policy, OVER_STALE)
    evaluator = Evaluator(
        run=lambda loop: loop.run(evaluate(policy, chat, ROLLOUT, EvalConfig(num_tasks=2, num_examples=0))),
        header=lambda what: RecordingHeader(tokenizer_fingerprint="", env_id=ROLLOUT.env_id, policy_id=what),
        recording=lambda step: tmp_path / f"eval_{step}.jsonl",
    )
    log = MetricsLog(LoggingConfig(console=False), tmp_path / "metrics.jsonl", tmp_path / "tb")
    settings = LoopSettings(eval=EvalSchedule(every_steps=2, at_start=False), checkpoint=CheckpointConfig(every_steps=1))
    checkpoints = CheckpointManager(tmp_path / "checkpoints", keep_last=1)
    loop = RLLoop(settings, source, trainer, policy, evaluator, log, checkpoints, dist)
    return loop, policy, generators, log


@pytest.mark.parametrize("kind", ["sync", "producer", "generator"])
def test_the_loop_runs_each_batch_source_without_the_cli(tmp_path, kind):
    loop, policy, generators, log = build_loop(tmp_path, kind)
    try:
        with asyncio.Runner() as runner_:
            loop.start()
            loop.run_steps(3, runner_, progress=False)
            position = loop.data_position()
    finally:
        loop.close()
        if generators is not None:
            generators.close()
        log.close()
        policy.close()
    assert loop.step == 3 and loop.trainer.step == 3
    rows = read_metrics(tmp_path / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["train/episodes"] == 4 for r in train)  # 2 groups of 2, whatever the source
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [2, 3]  # every 2 steps, and at the end
    assert len(read_recording(tmp_path / "eval_2.jsonl")[1]) == 2
    # the eval policy samples from the trainer's latest weights
    assert policy.policy_version == loop.trainer.step
    # a checkpoint every step but the last (the caller saves that one), the latest kept, with the
    # source's position for resume: 2 task seeds a step from the stream
    meta = json.loads(next((tmp_path / "checkpoints").rglob("meta.json")).read_text())
    assert meta["step"] == 2 and meta["data_position"]["rl_step"] == 2
    assert meta["data_position"]["stream"] == position["stream"] == STREAM
    if kind == "sync":
        assert meta["data_position"]["positions"] == [4] and position["positions"] == [6]
    else:  # async sources roll out ahead of the trainer: the groups not yet trained are pending
        assert meta["data_position"]["positions"][0] >= 4 and "pending" in position
