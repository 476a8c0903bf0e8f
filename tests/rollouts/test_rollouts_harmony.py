"""Episodes in gpt-oss's harmony format (`policy.chat_template = "harmony"`): the oracle wins
Zorplex with harmony calls and its token stream is harmony's rendering of the conversation;
recordings name the format and replay token for token, for the oracle and for a model's own
samples (turns cut mid-message restart from the re-rendering); the env reads the markup."""

import gymnasium
import msgspec
import pytest
import torch
from harmony_reference import harmony_tokenizer
from tokenizers import Tokenizer

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.harmony import HarmonyRenderer
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import build_model
from toolgym.agents.tokenizer import tokenizer_fingerprint
from toolgym.agents.types import Message
from toolgym.configs.assembly.parts import chat_template_extra, make_renderer
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.episodes import build_episodes
from toolgym.rollouts.recording.format import RecordingHeader, RecordingWriter, read_recording
from toolgym.rollouts.recording.replay import recorded_renderer, verify_tokens
from toolgym.rollouts.scripted import OraclePolicy
from toolgym.rollouts.types import StopReason

ENV = ("toolgym/Zorplex-v0", {"tool_format": "harmony", "tier": "compositional"})
OPTIONS = {"reasoning_effort": "low", "current_date": "2026-12-06"}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return harmony_tokenizer()


@pytest.fixture(scope="module")
def renderer(tokenizer) -> HarmonyRenderer:
    built = make_renderer(tokenizer, "harmony", OPTIONS)
    assert isinstance(built, HarmonyRenderer) and built.reasoning_effort == "low"
    return built


def record_and_verify(tmp_path, renderer, trajectories) -> list[list[str]]:
    path = tmp_path / "harmony.jsonl"
    header = RecordingHeader(
        tokenizer_fingerprint=tokenizer_fingerprint(renderer.tokenizer),
        env_id=ENV[0],
        env_kwargs=ENV[1],
        extra=chat_template_extra("harmony", OPTIONS),
    )
    with RecordingWriter(path, header) as writer:
        writer.write_all(trajectories)
    header, recorded = read_recording(path)
    replayer = recorded_renderer(header, renderer.tokenizer)
    assert isinstance(replayer, HarmonyRenderer) and replayer.current_date == "2026-12-06"
    return [verify_tokens(t, replayer) for t in recorded]


def test_the_oracle_wins_in_harmony_and_its_stream_is_harmonys_rendering(tmp_path, renderer):
    env_id, env_kwargs = ENV
    config = EnvRolloutConfig(env_id=env_id, env_kwargs=env_kwargs, group_size=1, max_turns=8)
    trajectories = RolloutRunner(OraclePolicy(renderer), renderer, config).run([0, 1, 2])
    for trajectory in trajectories:
        assert trajectory.stop_reason == StopReason.ANSWERED and trajectory.total_reward > 0
        assert len(trajectory.transitions) >= 3 and trajectory.metrics["sequence_restarts"] == 0
        env = gymnasium.make(env_id, **env_kwargs)
        _, info = env.reset(seed=trajectory.task_seed)
        messages = [
            Message("system", info["instructions"]),
            Message("user", trajectory.transitions[0].observation),
        ]
        for t in trajectory.transitions[:-1]:
            messages.append(Message("assistant", t.action.text))
            messages += [Message("tool", r) for r in t.info["tool_results"]]
        stream = [i for t in trajectory.transitions for i in (*t.observation_tokens, *t.action.tokens)]
        seen = stream[: len(stream) - len(trajectory.transitions[-1].action.tokens)]
        assert seen == renderer.render_prompt(messages, tools=info["tools"])
        text = renderer.decode(stream)
        assert "namespace functions {" in text and "type LOOKUP = (_: {" in text
        assert (
            "<|start|>assistant to=functions.LOOKUP<|channel|>commentary <|constrain|>json<|message|>" in text
        )
        assert "<|start|>functions.LOOKUP to=assistant<|channel|>commentary<|message|>" in text
        assert text.endswith(
            "<|channel|>final<|message|>"
            + trajectory.transitions[-1].action.text.split("<|message|>")[-1]
            + "<|return|>"
        )
    assert record_and_verify(tmp_path, renderer, trajectories) == [[], [], []]
    episodes, _ = build_episodes(trajectories, [1.0] * len(trajectories))
    assert len(episodes) == 3


def test_a_models_own_samples_replay_token_for_token(tmp_path, renderer):
    config = msgspec.structs.replace(ModelConfig.named("test"), vocab_size=1024, max_position_embeddings=2048)
    model = build_model(config, seed=0, dtype=torch.float32)
    policy = TorchEngine(model, max_batch_size=8, max_seq_len=2048, tokenizer=renderer.tokenizer, seed=0)
    env_id, env_kwargs = ENV
    rollout = EnvRolloutConfig(
        env_id=env_id,
        env_kwargs=env_kwargs,
        group_size=2,
        max_turns=3,
        max_tokens_per_turn=12,
        max_tokens_per_episode=36,
        cut_turn="step",  # a cut turn goes to the env: the next one restarts from the re-rendering
    )
    trajectories = RolloutRunner(policy, renderer, rollout).run([0, 1])
    assert len(trajectories) == 4 and all(t.transitions for t in trajectories)
    assert sum(t.metrics["sequence_restarts"] for t in trajectories) > 0  # cut turns re-rendered
    for trajectory in trajectories:
        for t in trajectory.transitions:  # what the env read is the renderer's action text
            assert t.action.text == renderer.action_text(t.action.tokens)
    assert record_and_verify(tmp_path, renderer, trajectories) == [[]] * 4
