"""Small real parts for RLLoop tests built without the CLI or a Config: the shipped tokenizer,
the 'test' model shape, a TorchEngine, the env runner on SumDigits-v0 (one short turn), and a
generator process's main for GeneratorSource. Module-level, so a spawned generator imports it."""

from __future__ import annotations

import msgspec
import torch

from toolgym import envs  # noqa: F401 (registers toolgym/SumDigits-v0)
from toolgym.agents.chat import ChatRenderer
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import Transformer, build_model
from toolgym.agents.tokenizer import load_tokenizer
from toolgym.configs.load import SHIPPED_TOKENIZER
from toolgym.rollouts.batches import BatchConfig, ScoredGroup, TaskSeedStream
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.trainers.distributed import DistInfo
from toolgym.trainers.loop.generators import serve_generator
from toolgym.trainers.loop.producer import GroupProducer
from toolgym.trainers.weight_sync import load_and_check

ROLLOUT = EnvRolloutConfig(
    env_id="toolgym/SumDigits-v0",
    env_kwargs={"min_count": 2, "max_count": 2, "min_value": 10, "max_value": 99},
    group_size=2,
    max_turns=1,
    max_tokens_per_turn=6,
    max_tokens_per_episode=6,
)
BATCH = BatchConfig(groups_per_batch=2, max_seq_len=256)
STREAM = 0


def renderer() -> ChatRenderer:
    return ChatRenderer(load_tokenizer(SHIPPED_TOKENIZER))


def model(seed: int = 0) -> Transformer:
    config = msgspec.structs.replace(ModelConfig.named("test"), vocab_size=1024)
    return build_model(config, seed=seed, dtype=torch.float32)


def engine(m: Transformer, chat: ChatRenderer, **kwargs) -> TorchEngine:
    return TorchEngine(m, max_batch_size=8, max_seq_len=256, tokenizer=chat.tokenizer, seed=0, **kwargs)


def runner(policy: TorchEngine, chat: ChatRenderer) -> RolloutRunner:
    return RolloutRunner(policy, chat, ROLLOUT)


def generator_main(info: DistInfo) -> None:
    """A generator process: its own engine (the trainer's weights arrive before its first
    rollout) and producer over its share of the stream, until the trainer says stop."""
    torch.set_num_threads(1)
    chat = renderer()
    policy = engine(model(seed=1), chat, weight_updates="in_flight")  # other weights: the sync must replace them
    rollouts = runner(policy, chat)

    def make_producer(stream: TaskSeedStream, replay: list[int]) -> GroupProducer:
        return GroupProducer(rollouts, stream, BATCH, concurrent_groups=2, capacity=4, replay=replay)

    def load(tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        load_and_check(policy, dict(tensors), version)

    try:
        serve_generator(info, STREAM, load, make_producer)
    finally:
        policy.close()


__all__ = ["BATCH", "ROLLOUT", "STREAM", "ScoredGroup", "engine", "generator_main", "model", "renderer", "runner"]
