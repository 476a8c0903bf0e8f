"""The runner with a model's own chat template: a multi-turn JSON tool-call episode's token stream is
the template's rendering of the final conversation (token for token as transformers renders it),
and where the template is not append-only the episode splits into training sequences, counted."""

import itertools

import gymnasium
import numpy as np
import pytest
from chat_templates_testlib import (
    QWEN3_LIKE,
    QWEN3_NO_TOOLS,
    QWEN25_LIKE,
    SHIPPED_TOKENIZER,
    hf_ids,
    hf_tokenizer,
)
from tokenizers import Tokenizer

from toolgym.agents.chat_template import TemplateRenderer
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.episodes import build_episodes, sequences, trajectory_to_episode
from toolgym.rollouts.metrics import batch_metrics
from toolgym.rollouts.scripted import OracleConfig, OraclePolicy, ScriptedEpisodePolicy, plan_actions
from toolgym.rollouts.types import SEQUENCE_START, StopReason

ENV = ("toolgym/Zorplex-v0", {"tool_format": "json", "tier": "compositional"})


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    return Tokenizer.from_file(str(SHIPPED_TOKENIZER))


def final_conversation(trajectory, reset_info):
    """The conversation the episode held: instructions, question, then per turn the sampled text
    and (but after the last) one tool message per tool result."""
    messages = [
        {"role": "system", "content": reset_info["instructions"]},
        {"role": "user", "content": trajectory.transitions[0].observation},
    ]
    for i, t in enumerate(trajectory.transitions):
        messages.append({"role": "assistant", "content": t.action.text})
        if i + 1 < len(trajectory.transitions):
            messages += [{"role": "tool", "content": r} for r in t.info["tool_results"]]
    return messages


@pytest.mark.parametrize("template", [QWEN25_LIKE, QWEN3_LIKE], ids=["qwen25_like", "qwen3_like"])
def test_json_tool_episode_stream_is_the_templates_rendering(shipped, template):
    renderer = TemplateRenderer(shipped, template)
    env_id, env_kwargs = ENV
    config = EnvRolloutConfig(env_id=env_id, env_kwargs=env_kwargs, group_size=1, max_turns=8)
    trajectories = RolloutRunner(OraclePolicy(renderer), renderer, config).run([0, 1, 2])
    hf = hf_tokenizer(template)
    for trajectory in trajectories:
        assert trajectory.stop_reason == StopReason.ANSWERED and trajectory.total_reward > 0
        assert len(trajectory.transitions) >= 3  # two tool turns and the answer
        assert trajectory.metrics["sequence_restarts"] == 0
        env = gymnasium.make(env_id, **env_kwargs)
        _, info = env.reset(seed=trajectory.task_seed)
        stream = [i for t in trajectory.transitions for i in (*t.observation_tokens, *t.action.tokens)]
        conversation = final_conversation(trajectory, info)
        # what the model saw before its last turn: the rendering of all but that turn
        seen = stream[: len(stream) - len(trajectory.transitions[-1].action.tokens)]
        assert seen == hf_ids(hf, conversation[:-1], info["tools"], add_generation_prompt=True)
        if template is QWEN25_LIKE:  # (Qwen3's writes an empty think block into a final assistant turn)
            full = hf_ids(hf, conversation, info["tools"])
            assert stream == full[: len(stream)] and renderer.decode(full[len(stream) :]) == "\n"
        text = renderer.decode(stream)
        assert '"name": "LOOKUP"' in text.split("<|im_end|>")[0]  # the template's tools block
        assert "<|im_start|>user\n<tool_response>\n" in text
    assert batch_metrics(trajectories)["rollout/sequence_restarts"] == 0.0
    episodes, _ = build_episodes(trajectories, [1.0] * len(trajectories))
    assert len(episodes) == len(trajectories)


class ThinkingOracle(OraclePolicy):
    """The oracle's actions, each after a think block (a policy that reasons before acting)."""

    def for_episode(self, env, seed):
        script = plan_actions(env.unwrapped, self.config, np.random.default_rng(seed))
        return ScriptedEpisodePolicy(
            self.renderer, [f"<think>\nstep {i}\n</think>\n\n{a}" for i, a in enumerate(script)]
        )


def test_dropped_reasoning_splits_the_episode_into_sequences(shipped):
    # No tools block: env replies go back as user turns, after which the template drops the
    # earlier turns' reasoning, so every turn after the first restarts from the full rendering.
    renderer = TemplateRenderer(shipped, QWEN3_NO_TOOLS)
    assert not renderer.renders_tools
    config = EnvRolloutConfig(
        env_id="toolgym/Zorplex-v0",
        env_kwargs={"tier": "compositional"},
        group_size=1,
        max_turns=8,
        observation_role="user",
    )
    (trajectory,) = RolloutRunner(ThinkingOracle(renderer, OracleConfig()), renderer, config).run([3])
    assert trajectory.stop_reason == StopReason.ANSWERED
    turns = trajectory.transitions
    restarts = len(turns) - 1
    assert restarts >= 2 and trajectory.metrics["sequence_restarts"] == restarts
    assert [bool(t.info.get(SEQUENCE_START)) for t in turns] == [False] + [True] * restarts
    assert all("end_reason" in t.info or t is not turns[-1] for t in turns)  # env info kept too
    hf = hf_tokenizer(QWEN3_NO_TOOLS)
    messages = [
        {"role": "system", "content": trajectory.system_prompt},
        {"role": "user", "content": turns[0].observation},
    ]
    for before, t in itertools.pairwise(turns):
        messages += [
            {"role": "assistant", "content": before.action.text},
            {"role": "user", "content": t.observation},
        ]
        assert t.observation_tokens == hf_ids(hf, messages, add_generation_prompt=True)
    assert len(sequences(trajectory)) == len(turns)
    with pytest.raises(ValueError, match="several training sequences"):
        trajectory_to_episode(trajectory, 1.0)
    episodes, stats = build_episodes([trajectory], [0.5])
    assert len(episodes) == stats.built == len(turns)
    for episode, t in zip(episodes, turns, strict=True):
        assert episode.tokens == [*t.observation_tokens, *t.action.tokens]
        assert sum(episode.loss_mask) == len(t.action.tokens) and set(episode.advantages) == {0.0, 0.5}
    assert batch_metrics([trajectory])["rollout/sequence_restarts"] == restarts


def test_config_and_cli_pick_the_template_and_refuse_a_bad_one_in_one_line(tmp_path, capsys):
    from toolgym.agents.chat import ChatRenderer
    from toolgym.configs.assembly.parts import build_renderer
    from toolgym.configs.cli.main import main
    from toolgym.configs.load import ConfigError, load_config

    good, bad = tmp_path / "good.jinja", tmp_path / "bad.jinja"
    good.write_text(QWEN25_LIKE)
    bad.write_text(
        QWEN25_LIKE.replace(
            "{%- for message in messages %}", "{{ raise_exception('nope') }}{%- for message in messages %}", 1
        )
    )
    config, _ = load_config("zorplex_tiny")
    assert isinstance(build_renderer(config)[0], ChatRenderer)  # the default: plain ChatML
    config, _ = load_config("zorplex_tiny", [f"policy.chat_template={good}"])
    assert isinstance(build_renderer(config)[0], TemplateRenderer)
    config, _ = load_config("zorplex_tiny", [f"policy.chat_template={bad}"])
    with pytest.raises(ConfigError) as info:
        build_renderer(config)
    assert str(info.value).startswith(f"config error: policy.chat_template: {bad}: the chat template raises")

    out = tmp_path / "rec.jsonl"
    args = ["--env", "toolgym/Zorplex-v0", "--env-kwargs", '{"tool_format": "json"}', "--tasks", "2"]
    assert main(["record", *args, "--out", str(out), "--no-progress", "--chat-template", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}: the chat template raises" in err
    assert main(["record", *args, "--out", str(out), "--no-progress", "--chat-template", str(good)]) == 0
    assert main(["eval", *args, "--chat-template", str(good)]) == 0
    assert "<tool_response>" in capsys.readouterr().out
