"""Recordings to and from OpenAI chat-messages JSONL, the format most other tools read.

Export (`export_chat_jsonl`): one line per episode,
    {"messages": [...], "tools": [...], "metadata": {...}}
- messages: the system prompt, the first observation as the user message, then per turn the
  assistant's text and the env's reply the model saw next (the env's reply to the last action,
  which the model never saw, is left out; it is in metadata as `final_observation`).
- tool calls, where the env takes JSON calls: an action whose `<tool_call>` blocks all parse,
  and whose step info lists one result per call (`tool_results`, envs/core/info.py), becomes an
  assistant message with `tool_calls` (content: the text outside the blocks, or null) followed by
  one `tool` message per result, linked by `tool_call_id`. Any other reply (bracket calls, an
  error, no call) is one message of `observation_role` ("user" by default: the OpenAI format
  allows `tool` messages only after `tool_calls`), or of the role the step's recorded info names
  (`observation_role`, envs/core/info.py: the user speaking mid-episode), as the runner rendered
  it (`reply_role`).
- tools: the env's tool specs from its reset info (`tools`), got by making the recorded env and
  resetting it with the task seed; with them the system message is the env's `instructions` (its
  prompt without its own tools block), as a chat template that writes the tools block expects. An
  env the recording cannot make (its module not imported, `envs/registry.py`'s check_env_id) or that declares
  no tools gets no `tools` key and keeps the recorded system prompt.
- metadata (unless `metadata=False`): env id and kwargs, task seed, group, sample, policy
  version, stop reason, reward and its components, failure mode, env metrics; for an episode
  whose context was re-rendered (a context policy, rollouts/context.py, or a chat template that
  restarts) `segment_starts`, the turns that start a new training sequence, and `context_policy`.
  The messages are the whole conversation either way, not what each segment showed.

Import (`import_chat_jsonl`): each line's conversation becomes a Trajectory that SFT reads like
a recorded one (`sft.source = "recording"`): the messages up to the first assistant message are
the prompt, each assistant message is a turn (its text, with `tool_calls` written as
`<tool_call>` JSON blocks, encoded by the renderer and closed with its end-of-turn token), the
messages between two assistant messages are the env's reply. A record's `metadata` (as export
writes it) is kept: task seed, group, sample, policy version, stop reason, reward and components,
failure mode, env metrics and the source env (`_with_metadata`). The tokens come from encoding text,
not from sampling: they are marked not token-exact (`metrics["token_exact"]` False, and the
header's `extra`), logprobs are 0.0, and the env id is `IMPORT_ENV_ID`, which `replay --verify`
cannot make (so it never reports such a file as verified). A line that is not a conversation
is skipped with its line number and reason.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, cast

import gymnasium
import msgspec

from ...agents.chat import Renderer
from ...agents.types import Completion, Message, Role
from ...envs.core.info import FAILURE_MODE, INSTRUCTIONS, TOOL_RESULTS, TOOLS
from ...envs.registry import EnvModuleNotAllowed, check_env_id
from ...envs.tools.call_formats import CALLS, get_format
from ..endpoint.openai_api import message_text
from ..env_io import reset_env
from ..episode.rendering import reply_role
from ..types import SEQUENCE_START, StopReason, Trajectory, Transition
from .format import RecordingHeader, RecordingReader

IMPORT_ENV_ID = "chat-import"  # never registered: an import is not an env's episode
_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


# ---- export -------------------------------------------------------------------------------------


class EnvTools:
    """The tools and instructions an env declares at reset, per (env id, kwargs) made once.
    `problems` lists the envs it could not make (each once)."""

    def __init__(self) -> None:
        self._envs: dict[str, gymnasium.Env | None] = {}
        self.problems: list[str] = []

    def of(self, t: Trajectory) -> tuple[list[dict[str, Any]] | None, str | None]:
        key = json.dumps([t.env_id, t.env_kwargs], sort_keys=True, default=str)
        if key not in self._envs:
            try:
                check_env_id(t.env_id)
                self._envs[key] = gymnasium.make(t.env_id, **t.env_kwargs)
            except EnvModuleNotAllowed as exc:
                self._envs[key] = None
                self.problems.append(f"{t.env_id}: no tools exported: {exc}")
            except Exception as exc:
                self._envs[key] = None
                self.problems.append(f"{t.env_id}: no tools exported: cannot make it ({type(exc).__name__}: {exc})")
        env = self._envs[key]
        if env is None:
            return None, None
        try:
            _, info, _ = reset_env(env, t.task_seed)
        except Exception:
            return None, None
        tools = info.get(TOOLS)
        instructions = info.get(INSTRUCTIONS)
        if not isinstance(tools, list) or not tools:
            return None, None
        return tools, instructions if isinstance(instructions, str) else None

    def close(self) -> None:
        for env in self._envs.values():
            if env is not None:
                env.close()


def _json_calls(text: str) -> list[dict[str, Any]] | None:
    """The action's `<tool_call>` blocks as OpenAI function calls (name, arguments as a JSON
    string), or None unless it has some and every one parses."""
    if "<tool_call>" not in text:
        return None
    parsed = get_format("json").parse(text, None)
    if parsed.kind != CALLS or not parsed.calls or any(c.error for c in parsed.calls):
        return None
    return [
        {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)} for c in parsed.calls
    ]


def chat_record(
    t: Trajectory,
    tools: list[dict[str, Any]] | None = None,
    instructions: str | None = None,
    observation_role: str = "user",
    metadata: bool = True,
) -> dict[str, Any]:
    """One episode as an OpenAI chat-messages record (see the module doc)."""
    messages: list[dict[str, Any]] = []
    system = instructions if tools and instructions is not None else t.system_prompt
    if system:
        messages.append({"role": "system", "content": system})
    n = len(t.transitions)
    if n:
        messages.append({"role": "user", "content": t.transitions[0].observation})
    for k, tr in enumerate(t.transitions):
        text = tr.action.text
        calls = _json_calls(text)
        results = tr.info.get(TOOL_RESULTS)
        seen = k + 1 < n  # the model saw the env's reply to this action
        aligned = calls is not None and (
            not seen or (isinstance(results, list) and len(results) == len(calls))
        )
        if calls is not None and aligned:
            content = _BLOCK.sub("", text).strip() or None
            ids = [f"call_{k}_{j}" for j in range(len(calls))]
            messages.append(
                {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [
                        {"id": i, "type": "function", "function": call} for i, call in zip(ids, calls, strict=True)
                    ],
                }
            )
            if seen and isinstance(results, list):
                messages += [
                    {"role": "tool", "tool_call_id": i, "content": str(result)}
                    for i, result in zip(ids, results, strict=True)
                ]
            continue
        messages.append({"role": "assistant", "content": text})
        if seen:
            role = reply_role(tr.info, cast(Role, observation_role))
            messages.append({"role": role, "content": t.transitions[k + 1].observation})
    record: dict[str, Any] = {"messages": messages}
    if tools:
        record["tools"] = tools
    if metadata:
        env_metrics = t.metrics.get("env")
        record["metadata"] = {
            "env_id": t.env_id,
            "env_kwargs": t.env_kwargs,
            "task_seed": t.task_seed,
            "group_id": t.group_id,
            "sample_index": t.sample_index,
            "policy_version": t.policy_version,
            "stop_reason": t.stop_reason.value,
            "total_reward": _finite(t.total_reward),
            "reward_components": {k: _finite(v) for k, v in t.reward_components.items()},
            "failure_mode": t.metrics.get(FAILURE_MODE),
            "env_metrics": env_metrics if isinstance(env_metrics, dict) else {},
            "final_observation": t.final_observation,
        }
        starts = [k for k, tr in enumerate(t.transitions) if k and tr.info.get(SEQUENCE_START) is True]
        if starts or t.context_policy:  # where the model's context was re-rendered (segments)
            record["metadata"]["segment_starts"] = starts
            record["metadata"]["context_policy"] = t.context_policy
    return record


class ExportReport(msgspec.Struct):
    episodes: int = 0
    with_tools: int = 0
    tool_call_turns: int = 0
    problems: list[str] = msgspec.field(default_factory=list)  # damaged lines, envs not made


def export_chat_jsonl(
    recording: str | os.PathLike,
    out: IO[str],
    tools: bool = True,
    observation_role: str = "user",
    metadata: bool = True,
) -> ExportReport:
    """Write every intact episode of `recording` to `out` as one JSON line each (see the module
    doc); damaged lines are skipped and listed in the report. `tools=False`: no env is made."""
    if observation_role not in ("user", "tool"):
        raise ValueError(f"observation_role must be user or tool, got {observation_role!r}")
    reader = RecordingReader(recording, skip_damaged=True)
    report = ExportReport()
    env_tools = EnvTools()
    encoder = msgspec.json.Encoder()
    try:
        for t in reader:
            specs, instructions = env_tools.of(t) if tools else (None, None)
            record = chat_record(t, specs, instructions, observation_role, metadata)
            out.write(encoder.encode(record).decode() + "\n")
            report.episodes += 1
            report.with_tools += bool(specs)
            report.tool_call_turns += sum(1 for m in record["messages"] if m.get("tool_calls"))
    finally:
        env_tools.close()
    report.problems += [str(d) for d in reader.damaged] + env_tools.problems
    if reader.torn_lines:
        report.problems.append(f"{recording}: a torn last line was skipped")
    return report


# ---- import -------------------------------------------------------------------------------------


def _call_blocks(message: Mapping[str, Any]) -> str:
    """An assistant message's `tool_calls` as `<tool_call>` JSON blocks (how Qwen and Hermes
    models write them), one per line."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    blocks = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call without function.name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"tool call {function['name']!r}: arguments are not JSON ({exc})") from None
        body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(blocks)


def _tools_block(tools: Sequence[Any]) -> str:
    """The tools' specs for a renderer that writes no tools block itself (plain ChatML)."""
    specs = [t.get("function", t) if isinstance(t, dict) else t for t in tools]
    return "\n".join(
        [
            "Tools (JSON Schema of each function):",
            "<tools>",
            *(json.dumps(s, ensure_ascii=False) for s in specs),
            "</tools>",
            "Call a tool by writing its name and arguments as JSON in a <tool_call> block:",
            '<tool_call>\n{"name": <tool name>, "arguments": <JSON object>}\n</tool_call>',
        ]
    )


def chat_trajectory(record: Any, renderer: Renderer, index: int) -> Trajectory:
    """One OpenAI chat-messages record as a Trajectory (see the module doc); ValueError (the
    reason) for a record that is not a conversation with an assistant message."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise ValueError('not an object with a "messages" list')
    messages: list[tuple[str, str]] = []
    for m in record["messages"]:
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ValueError(f"a message with role {m.get('role') if isinstance(m, dict) else m!r}")
        role = _ROLES[m["role"]]
        text = message_text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            text = "\n".join(x for x in (text, _call_blocks(m)) if x)
        messages.append((role, text))
    first = next((i for i, (role, _) in enumerate(messages) if role == "assistant"), None)
    if first is None:
        raise ValueError("no assistant message: nothing to train on")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a list")
    system = ""
    prefix = messages[:first]
    if prefix and prefix[0][0] == "system":
        system, prefix = prefix[0][1], prefix[1:]
    if tools and not renderer.renders_tools:
        system = "\n\n".join(x for x in (system, _tools_block(tools)) if x)
    opening = [Message("system", system)] if system else []
    opening += [Message(role, text) for role, text in prefix]  # type: ignore[arg-type]
    rendering = renderer.start_episode(opening, tools if renderer.renders_tools else None)
    observation_tokens, observation, restarted = rendering.prompt, "\n".join(t for _, t in prefix), False
    transitions: list[Transition] = []
    k = first
    while k < len(messages):
        text = messages[k][1]
        tokens = renderer.action_tokens(text)
        action = Completion(tokens=tokens, logprobs=[0.0] * len(tokens), finish_reason="stop", text=text)
        replies = []
        k += 1
        while k < len(messages) and messages[k][0] != "assistant":
            replies.append(Message(*messages[k]))  # type: ignore[arg-type]
            k += 1
        info: dict[str, Any] = {SEQUENCE_START: True} if restarted else {}
        transitions.append(Transition(observation, observation_tokens, action, info=info))
        if k < len(messages):
            if not replies:
                raise ValueError("two assistant messages in a row (no reply between them)")
            turn = rendering.extend(tokens, replies)
            observation_tokens, restarted = turn.tokens, turn.restarted
        observation = "\n".join(m.content for m in replies)
    trajectory = Trajectory(
        env_id=IMPORT_ENV_ID,
        env_kwargs={},
        task_seed=index,
        group_id=index,
        transitions=transitions,
        stop_reason=StopReason.ANSWERED,
        system_prompt=system,
        final_observation=observation,
        metrics={"token_exact": False, "turns": len(transitions)},
    )
    return _with_metadata(trajectory, record.get("metadata"))


def _with_metadata(t: Trajectory, metadata: Any) -> Trajectory:
    """`t` with what an exported record's `metadata` says of its episode (chat_record): task seed,
    group, sample, policy version, stop reason, the reward (on the last turn, so the steps still sum
    to it) and its components, failure mode and env metrics (so `sft.only_successful` reads the
    env's `success`), the env's last reply, and the source env (`metrics["source_env"]`). A field
    missing or of the wrong type keeps the import's own value."""
    if not isinstance(metadata, dict):
        return t

    def field(name: str, kind: type | tuple[type, ...]) -> Any:
        value = metadata.get(name)
        return value if isinstance(value, kind) and not isinstance(value, bool) else None

    for name, attr in (("task_seed", "task_seed"), ("group_id", "group_id"), ("sample_index", "sample_index"),
                       ("policy_version", "policy_version")):
        if (value := field(name, int)) is not None:
            setattr(t, attr, value)
    if (stop := field("stop_reason", str)) in StopReason.__members__.values():
        t.stop_reason = StopReason(stop)
    if (final := field("final_observation", str)) is not None:
        t.final_observation = final
    reward = _finite(field("total_reward", (int, float)))
    if reward is not None and t.transitions:
        t.transitions[-1].reward, t.total_reward = reward, reward
    components = field("reward_components", dict)
    if components is not None:
        t.reward_components = {str(k): v for k, v in components.items() if _finite(v) is not None}
    if (failure := field("failure_mode", str)) is not None:
        t.metrics[FAILURE_MODE] = failure
    env_metrics = field("env_metrics", dict)
    if env_metrics is not None:
        t.metrics["env"] = {str(k): v for k, v in env_metrics.items() if _finite(v) is not None}
    if (env_id := field("env_id", str)) is not None:
        t.metrics["source_env"] = {"env_id": env_id, "env_kwargs": metadata.get("env_kwargs") or {}}
    return t


def import_header(path: str | os.PathLike, fingerprint: str) -> RecordingHeader:
    """The header of a recording made by importing `path` (not token-exact)."""
    return RecordingHeader(
        tokenizer_fingerprint=fingerprint,
        env_id=IMPORT_ENV_ID,
        policy_id=f"chat-import:{Path(path).name}",
        extra={"token_exact": False, "source": str(path), "source_format": "openai-chat-messages"},
    )


def import_chat_jsonl(
    path: str | os.PathLike, renderer: Renderer, problems: list[str] | None = None
) -> Iterator[Trajectory]:
    """Yield a Trajectory per conversation of the JSONL file `path` (see the module doc); each
    line that is not one is appended to `problems` as "path: line N: reason" and skipped."""
    problems = problems if problems is not None else []
    with Path(path).open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                yield chat_trajectory(record, renderer, lineno - 1)
            except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
                problems.append(f"{path}: line {lineno}: {exc}")
