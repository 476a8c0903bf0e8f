"""The runner with a model's own chat template: a multi-turn JSON tool-call episode's token stream is
the template's rendering of the final conversation (token for token as transformers renders it),
and where the template is not append-only the episode splits into training sequences, counted. An
env that speaks as the user mid-episode (`ToolEnv.user_turn`) names that step's role in its info
(`observation_role: "user"`): the template renders it as a user message while tool results stay tool
messages, the recording replays token for token from that recorded role, the chat export gives the
same roles, and a role no chat renders ends only that episode, as a one-line env error."""

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

from toolgym.agents.chat_template import ChatTemplate, TemplateRenderer
from toolgym.agents.tokenizer import tokenizer_fingerprint
from toolgym.envs import Grade, Task, ToolEnv
from toolgym.envs.core.info import OBSERVATION_ROLE
from toolgym.envs.core.tool_env import UserTurn
from toolgym.envs.tools.call_formats import OTHER
from toolgym.envs.tools.typed import Call, tool
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.episodes import build_episodes, sequences, trajectory_to_episode
from toolgym.rollouts.metrics import batch_metrics
from toolgym.rollouts.recording.chat_jsonl import chat_record
from toolgym.rollouts.recording.format import (
    CHAT_TEMPLATE,
    RecordingHeader,
    RecordingWriter,
    chat_template_entry,
    read_recording,
)
from toolgym.rollouts.recording.replay import recorded_renderer, verify_tokens
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


# An env that speaks as the user mid-episode (ToolEnv.user_turn) under a template that renders tools.

TWO_ASKS = "tgtest/TwoAsks-v0"
FOLLOW_UP = "Thanks. And what does bo have?"


class TwoAsksEnv(ToolEnv):
    """The user asks for ana's balance, then (when the policy replies without a call) for bo's;
    the second reply without a call ends the conversation, graded. `bad_role_seeds`: task seeds
    whose follow-up names a role no chat renders."""

    def __init__(self, bad_role_seeds: tuple[int, ...] = (), **knobs):
        self.bad_role_seeds = tuple(bad_role_seeds)
        super().__init__(instructions="You read bank balances.", tool_format="json", max_turns=8, **knobs)

    @tool
    def balance(self, account: str) -> int:
        """The balance of an account."""
        return self.state[account]

    def reset(self, *, seed=None, options=None):
        self.seed, self.asked = seed, 0
        return super().reset(seed=seed, options=options)

    def new_task(self) -> Task:
        balances = {name: int(self.np_random.integers(10, 500)) for name in ("ana", "bo")}
        return Task("What does ana have?", balances["bo"], state=balances)

    def user_turn(self, kind: str, action: str) -> UserTurn | None:
        if kind != OTHER:
            return None
        self.asked += 1
        if self.asked == 1:
            info = {OBSERVATION_ROLE: "narrator"} if self.seed in self.bad_role_seeds else {}
            return UserTurn(FOLLOW_UP, None, {"first_ask": 0.25}, info)
        return UserTurn("Goodbye.", Grade(1.0 if str(self.state["bo"]) in action else 0.0))

    def script(self) -> list[str]:
        """ana's balance, an empty action (an error: an ordinary reply), the answer, bo's, the answer."""

        def call(account: str) -> str:
            return self.format.render_calls(self.tools, [Call("balance", {"account": account})])

        return [call("ana"), "", f"ana has {self.state['ana']}.", call("bo"), f"bo has {self.state['bo']}."]


if TWO_ASKS not in gymnasium.registry:
    gymnasium.register(TWO_ASKS, entry_point=TwoAsksEnv)


class TwoAsksScript(OraclePolicy):
    def for_episode(self, env, seed):
        return ScriptedEpisodePolicy(self.renderer, env.unwrapped.script())


@pytest.fixture(scope="module")
def qwen25_template() -> ChatTemplate:
    return ChatTemplate(QWEN25_LIKE, "qwen25-like.jinja")


@pytest.fixture(scope="module")
def qwen25(qwen25_template) -> TemplateRenderer:
    renderer = TemplateRenderer(Tokenizer.from_file(str(SHIPPED_TOKENIZER)), qwen25_template)
    assert renderer.renders_tools
    return renderer


def run_two_asks(renderer, seeds, **env_kwargs):
    config = EnvRolloutConfig(env_id=TWO_ASKS, env_kwargs=env_kwargs, group_size=1, max_turns=8)
    assert config.observation_role == "tool"  # the default: env replies are tool messages
    return RolloutRunner(TwoAsksScript(renderer), renderer, config).run(seeds)


def two_asks_conversation(trajectory):
    """The conversation the model held, each env reply in the role the test expects: a tool
    message per tool result, the error reply as a `tool` message (the run's role), the user's
    follow-up as a `user` message."""
    turns = trajectory.transitions
    messages = [
        {"role": "system", "content": trajectory.reset_info["instructions"]},
        {"role": "user", "content": turns[0].observation},
    ]
    for before, after in itertools.pairwise(turns):
        messages.append({"role": "assistant", "content": before.action.text})
        if before.info.get("tool_results"):
            messages += [{"role": "tool", "content": r} for r in before.info["tool_results"]]
        else:
            role = "user" if after.observation == FOLLOW_UP else "tool"
            messages.append({"role": role, "content": after.observation})
    return messages


def test_the_env_says_user_for_a_follow_up_and_nothing_for_the_graded_end():
    env = gymnasium.make(TWO_ASKS)
    env.reset(seed=3)
    infos = [env.step(a)[4] for a in env.unwrapped.script()]
    assert [info.get(OBSERVATION_ROLE) for info in infos] == [None, None, "user", None, None]
    assert infos[-1]["metrics"]["success"] == 1.0


def test_the_follow_up_is_a_user_message_and_tool_results_tool_messages(qwen25):
    hf = hf_tokenizer(QWEN25_LIKE)
    trajectories = run_two_asks(qwen25, [0, 1])
    for t in trajectories:
        assert t.stop_reason == StopReason.ANSWERED and t.reward_components["first_ask"] == 0.25
        assert [tr.info.get(OBSERVATION_ROLE) for tr in t.transitions] == [None, None, "user", None, None]
        assert t.metrics["sequence_restarts"] == 0
        stream = [i for tr in t.transitions for i in (*tr.observation_tokens, *tr.action.tokens)]
        seen = stream[: len(stream) - len(t.transitions[-1].action.tokens)]
        messages = two_asks_conversation(t)
        assert [m["role"] for m in messages] == [
            "system", "user", "assistant", "tool", "assistant", "tool", "assistant", "user", "assistant", "tool",
        ]  # fmt: skip
        assert seen == hf_ids(hf, messages, t.reset_info["tools"], add_generation_prompt=True)
        text = qwen25.decode(stream)
        assert f"<|im_start|>user\n{FOLLOW_UP}<|im_end|>" in text
        assert text.count("<tool_response>") == 3  # two tool results and the error reply


def test_the_recording_replays_exactly_from_the_recorded_role(qwen25, qwen25_template, tmp_path):
    trajectories = run_two_asks(qwen25, [0, 1])
    path = tmp_path / "two_asks.jsonl"
    header = RecordingHeader(
        tokenizer_fingerprint=tokenizer_fingerprint(qwen25.tokenizer),
        env_id=TWO_ASKS,
        extra={CHAT_TEMPLATE: chat_template_entry(qwen25_template)},
    )
    with RecordingWriter(path, header) as writer:
        writer.write_all(trajectories)
    header, recorded = read_recording(path)
    replayer = recorded_renderer(header, qwen25.tokenizer)
    assert [verify_tokens(t, replayer) for t in recorded] == [[], []]
    # neither run role alone explains the episode (an error reply as tool, the follow-up as user)
    del recorded[0].transitions[2].info[OBSERVATION_ROLE]
    problems = verify_tokens(recorded[0], replayer)
    assert problems and "not the rendered env reply" in problems[0]


def test_the_chat_export_gives_the_same_roles(qwen25):
    (t,) = run_two_asks(qwen25, [2])
    for role in ("tool", "user"):
        record = chat_record(t, t.reset_info["tools"], t.reset_info["instructions"], observation_role=role)
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", role, "assistant", "user", "assistant", "tool", "assistant"]  # fmt: skip
        assert record["messages"][7]["content"] == FOLLOW_UP


def test_a_bad_role_is_a_one_line_env_error_of_that_episode_only(qwen25):
    good, bad = run_two_asks(qwen25, [0, 1], bad_role_seeds=(1,))
    assert good.stop_reason == StopReason.ANSWERED
    assert bad.stop_reason == StopReason.ENV_ERROR and len(bad.transitions) == 3
    assert bad.error is not None and "\n" not in bad.error
    assert "observation_role" in bad.error and "narrator" in bad.error
    assert "narrator" in bad.transitions[-1].info["error"]
