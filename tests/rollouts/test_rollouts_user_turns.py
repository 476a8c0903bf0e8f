"""An env that speaks as the user mid-episode (`ToolEnv.user_turn`): its step info names the role
(`observation_role: "user"`, envs/core/info.py), so a chat template renders that message as a
user message while tool results are tool messages, whatever `rollout.observation_role` is; the
recording replays token for token from that recorded role, the chat export gives the same roles,
and a role the runner cannot render ends only that episode, as an env error."""

import itertools

import gymnasium
import pytest
from chat_templates_testlib import QWEN25_LIKE, SHIPPED_TOKENIZER, hf_ids, hf_tokenizer
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
from toolgym.rollouts.recording.chat_jsonl import chat_record
from toolgym.rollouts.recording.format import (
    CHAT_TEMPLATE,
    RecordingHeader,
    RecordingWriter,
    chat_template_entry,
    read_recording,
)
from toolgym.rollouts.recording.replay import recorded_renderer, verify_tokens
from toolgym.rollouts.scripted import OraclePolicy, ScriptedEpisodePolicy
from toolgym.rollouts.types import StopReason

ENV_ID = "tgtest/TwoAsks-v0"
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


if ENV_ID not in gymnasium.registry:
    gymnasium.register(ENV_ID, entry_point=TwoAsksEnv)


class Scripted(OraclePolicy):
    def for_episode(self, env, seed):
        return ScriptedEpisodePolicy(self.renderer, env.unwrapped.script())


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(QWEN25_LIKE, "qwen25-like.jinja")


@pytest.fixture(scope="module")
def renderer(template) -> TemplateRenderer:
    renderer = TemplateRenderer(Tokenizer.from_file(str(SHIPPED_TOKENIZER)), template)
    assert renderer.renders_tools
    return renderer


def run(renderer, seeds, **env_kwargs):
    config = EnvRolloutConfig(env_id=ENV_ID, env_kwargs=env_kwargs, group_size=1, max_turns=8)
    assert config.observation_role == "tool"  # the default: env replies are tool messages
    return RolloutRunner(Scripted(renderer), renderer, config).run(seeds)


def conversation(trajectory):
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
    env = gymnasium.make(ENV_ID)
    env.reset(seed=3)
    infos = [env.step(a)[4] for a in env.unwrapped.script()]
    assert [info.get(OBSERVATION_ROLE) for info in infos] == [None, None, "user", None, None]
    assert infos[-1]["metrics"]["success"] == 1.0


def test_the_follow_up_is_a_user_message_and_tool_results_tool_messages(renderer):
    hf = hf_tokenizer(QWEN25_LIKE)
    trajectories = run(renderer, [0, 1])
    for t in trajectories:
        assert t.stop_reason == StopReason.ANSWERED and t.reward_components["first_ask"] == 0.25
        assert [tr.info.get(OBSERVATION_ROLE) for tr in t.transitions] == [None, None, "user", None, None]
        assert t.metrics["sequence_restarts"] == 0
        stream = [i for tr in t.transitions for i in (*tr.observation_tokens, *tr.action.tokens)]
        seen = stream[: len(stream) - len(t.transitions[-1].action.tokens)]
        messages = conversation(t)
        assert [m["role"] for m in messages] == [
            "system", "user", "assistant", "tool", "assistant", "tool", "assistant", "user", "assistant", "tool",
        ]  # fmt: skip
        assert seen == hf_ids(hf, messages, t.reset_info["tools"], add_generation_prompt=True)
        text = renderer.decode(stream)
        assert f"<|im_start|>user\n{FOLLOW_UP}<|im_end|>" in text
        assert text.count("<tool_response>") == 3  # two tool results and the error reply


def test_the_recording_replays_exactly_from_the_recorded_role(renderer, template, tmp_path):
    trajectories = run(renderer, [0, 1])
    path = tmp_path / "two_asks.jsonl"
    header = RecordingHeader(
        tokenizer_fingerprint=tokenizer_fingerprint(renderer.tokenizer),
        env_id=ENV_ID,
        extra={CHAT_TEMPLATE: chat_template_entry(template)},
    )
    with RecordingWriter(path, header) as writer:
        writer.write_all(trajectories)
    header, recorded = read_recording(path)
    replayer = recorded_renderer(header, renderer.tokenizer)
    assert [verify_tokens(t, replayer) for t in recorded] == [[], []]
    # neither run role alone explains the episode (an error reply as tool, the follow-up as user)
    del recorded[0].transitions[2].info[OBSERVATION_ROLE]
    problems = verify_tokens(recorded[0], replayer)
    assert problems and "not the rendered env reply" in problems[0]


def test_the_chat_export_gives_the_same_roles(renderer):
    (t,) = run(renderer, [2])
    for role in ("tool", "user"):
        record = chat_record(t, t.reset_info["tools"], t.reset_info["instructions"], observation_role=role)
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", role, "assistant", "user", "assistant", "tool", "assistant"]  # fmt: skip
        assert record["messages"][7]["content"] == FOLLOW_UP


def test_a_bad_role_is_a_one_line_env_error_of_that_episode_only(renderer):
    good, bad = run(renderer, [0, 1], bad_role_seeds=(1,))
    assert good.stop_reason == StopReason.ANSWERED
    assert bad.stop_reason == StopReason.ENV_ERROR and len(bad.transitions) == 3
    assert bad.error is not None and "\n" not in bad.error
    assert "observation_role" in bad.error and "narrator" in bad.error
    assert "narrator" in bad.transitions[-1].info["error"]
