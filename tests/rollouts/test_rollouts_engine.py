"""The runner with the real torch engine (a tiny random model): batching, Episodes, limits."""

import pytest
import torch
from rollouts_fakes import TextPolicy

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.errors import ContextOverflowError
from toolgym.agents.model.config import NAMED_CONFIGS, ModelConfig
from toolgym.agents.model.transformer import Transformer
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.episodes import trajectory_to_episode
from toolgym.rollouts.types import StopReason


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = ModelConfig(**{**NAMED_CONFIGS["test"], "vocab_size": tokenizer.get_vocab_size()})
    return Transformer(config).eval()


def rollout(**kw):
    base = {"env_id": "toolgym/Zorplex-v0", "env_kwargs": {"tier": "compositional"}, "group_size": 2}
    return EnvRolloutConfig(**{**base, "max_turns": 3, "max_tokens_per_turn": 12, **kw})


def test_engine_batches_concurrent_episodes(model, renderer):
    with TorchEngine(model, tokenizer=renderer.tokenizer, max_seq_len=512) as engine:
        trajectories = RolloutRunner(engine, renderer, rollout()).run([0, 1, 2])
        stats = engine.stats
    assert len(trajectories) == 6 and all(t.error is None for t in trajectories)
    requests = sum(len(t.transitions) for t in trajectories)
    assert stats.requests == requests and stats.max_running >= 6  # turn 0 of all 6 went in together
    assert stats.prefill_forwards < requests
    for t in trajectories:
        assert t.stop_reason in set(StopReason) - {StopReason.ENV_ERROR, StopReason.TIMEOUT}
        episode = trajectory_to_episode(t, 1.0)
        sampled = [tok for tr in t.transitions for tok in tr.action.tokens]
        assert [x for x, m in zip(episode.tokens, episode.loss_mask, strict=True) if m] == sampled
        assert all(lp <= 0.0 for lp, m in zip(episode.sampler_logprobs, episode.loss_mask, strict=True) if m)
        assert all(tr.action.text == renderer.decode(tr.action.tokens, True) for tr in t.transitions)
    # the two samples of a group differ (distinct sampling seeds)
    assert trajectories[0].transitions[0].action.tokens != trajectories[1].transitions[0].action.tokens


def test_runner_is_reproducible_with_the_engine(model, renderer):
    runs = []
    for _ in range(2):
        with TorchEngine(model, tokenizer=renderer.tokenizer, max_seq_len=512) as engine:
            runs.append(RolloutRunner(engine, renderer, rollout(seed=7)).run([3]))
    assert [t.transitions for t in runs[0]] == [t.transitions for t in runs[1]]


def test_engine_context_limit_becomes_context_overflow(model, renderer):
    with TorchEngine(model, tokenizer=renderer.tokenizer, max_seq_len=300) as engine:
        runner = RolloutRunner(engine, renderer, rollout(max_turns=8, max_tokens_per_turn=64, group_size=1))
        assert runner.context_length == 300
        trajectories = runner.run([0, 1])
    for t in trajectories:
        total = sum(len(tr.observation_tokens) + len(tr.action.tokens) for tr in t.transitions)
        assert total <= 300
    assert any(t.stop_reason == StopReason.CONTEXT_OVERFLOW for t in trajectories)


class OverflowingPolicy(TextPolicy):
    async def generate(self, prompts, params):
        raise ContextOverflowError("too long", prompt_len=9, max_seq_len=8)


def test_backend_context_overflow_error_is_mapped(renderer):
    (t,) = RolloutRunner(OverflowingPolicy(renderer), renderer, rollout(group_size=1)).run([0])
    assert t.stop_reason == StopReason.CONTEXT_OVERFLOW and "too long" in t.error


def test_cli_with_a_checkpoint_directory(model, tokenizer, tmp_path, capsys):
    from toolgym.agents.model.checkpoint import save_hf_checkpoint
    from toolgym.configs.cli.main import main

    tokenizer.save(str(tmp_path / "tok.json"))
    ckpt = save_hf_checkpoint(model, model.config, tmp_path / "ckpt", tokenizer_path=tmp_path / "tok.json")
    env = ["--env", "toolgym/Zorplex-v0", "--env-kwargs", '{"tier": "simple"}', "--policy", str(ckpt)]
    limits = ["--max-tokens-per-turn", "8", "--max-turns", "2"]
    assert main(["eval", *env, *limits, "--tasks", "3", "--examples", "1"]) == 0
    text = capsys.readouterr().out
    assert "task seed 0" in text and "accuracy" in text
    out = tmp_path / "model.jsonl"
    assert (
        main(
            ["record", *env, *limits, "--tasks", "2", "--group-size", "2", "--out", str(out), "--no-progress"]
        )
        == 0
    )
    # the checkpoint's own tokenizer.json was used (and recorded): replay needs the same one
    assert main(["replay", str(out), "--verify", "--tokenizer", str(ckpt / "tokenizer.json")]) == 0
    assert "verify: 4/4 episodes replay exactly" in capsys.readouterr().out
