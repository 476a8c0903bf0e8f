"""Weight sync: after a push, the policy scores tokens exactly as the trainer does."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainers_testlib import random_episodes, sample_and_score

from toolgym.agents.model.transformer import build_model, causal_lm_logprobs
from toolgym.trainers.config import OptimizerConfig, TrainerConfig
from toolgym.trainers.losses import LossConfig
from toolgym.trainers.trainer import Trainer
from toolgym.trainers.weight_sync import gather_weights, push_weights

torch.set_num_threads(1)


class ModelPolicy:
    """The smallest policy-side receiver: a plain model that takes `load_weights`."""

    def __init__(self, model):
        self.model = model
        self.policy_version = 0

    def load_weights(self, named_tensors, version):
        result = self.model.load_state_dict(dict(named_tensors), strict=False)
        assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
        self.policy_version = version


def _trained(steps=2):
    config = TrainerConfig(
        loss=LossConfig(name="grpo"), micro_batch_tokens=200, optimizer=OptimizerConfig(lr=5e-3)
    )
    trainer = Trainer(build_model("test", seed=0), config, device="cpu")
    for step in range(steps):
        trainer.train_step(random_episodes(6, seed=step))
    return trainer


def test_push_weights_makes_the_policy_score_like_the_trainer():
    trainer = _trained()
    policy = ModelPolicy(build_model("test", seed=42))
    seconds = push_weights(trainer, policy)
    assert seconds >= 0.0 and policy.policy_version == trainer.step == 2
    episodes = random_episodes(4, seed=9)
    got = trainer.compute_logprobs(episodes)
    for episode, row in zip(episodes, got, strict=True):
        expected = causal_lm_logprobs(policy.model, torch.tensor([episode.tokens]))[0].tolist()
        assert max(abs(a - b) for a, b in zip(row[1:], expected, strict=True)) <= 1e-6


def test_gathered_weights_are_whole_and_hf_named():
    trainer = _trained(steps=0)
    weights = gather_weights(trainer)
    reference = build_model("test", seed=0).state_dict()
    reference.pop("lm_head.weight")  # tied: a HF checkpoint and a sync carry it once
    assert weights.keys() == reference.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name


def test_torch_engine_logprobs_match_trainer_after_sync():
    engine_module = pytest.importorskip("toolgym.agents.engine.engine", reason="the torch engine is not written yet")
    trainer = _trained()
    engine = engine_module.TorchEngine(build_model("test", seed=42))
    try:
        push_weights(trainer, engine)
        assert engine.policy_version == trainer.step
        completion, gap = sample_and_score(trainer, engine, [3, 17, 42, 7, 99])
        assert gap <= 1e-5, gap
        print(f"engine vs trainer max |logprob gap| = {gap:.2e}")
        assert completion.policy_version == trainer.step
    finally:
        engine.close()
