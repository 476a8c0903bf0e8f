"""Token capture: each conversation an agent program holds with the endpoint, kept token-exactly
as training data.

A conversation (one agent run) is named by its id (a header, an `extra_body` field or the API
key: rollouts/endpoint/server.py). Its first request's messages are rendered into the first prompt
(`Renderer.start_episode`, with the request's tools). Each later request is matched against what
the conversation holds: when its messages are the previous request's messages, then an assistant
message equal (by content and tool calls) to one of the replies sampled for it, then new
non-assistant messages (tool results, user turns), the prompt is the history so far + the exact
sampled tokens of that reply (never decoded and encoded again) + only the rendered delta of the
new messages (`EpisodeRendering.extend`). Anything else (a dropped, edited or reordered earlier
message, other tools, a regenerated turn) is a history rewrite: the capture starts a new training
sequence from the canonical rendering of the new messages (`Transition.info[SEQUENCE_START]`),
and counts it (`history_rewrites`); a chat template that is not append-only restarts the same way
(`sequence_restarts` counts both). Raw-text and token prompts (/v1/completions) extend the
history when they start with it, and start a new sequence otherwise.

Every sampled reply that was returned is trained on exactly once: the reply the agent continued
with, or (for the last turn, a rewrite, or n > 1 with none chosen) the first choice. Tokens and
sampler logprobs are kept verbatim with the policy version that sampled them. A reply cut at a
stop string keeps the sampled tokens up to the one that completed it.

`finish` turns a conversation into a `Trajectory` (rewards from the agent program), so captures
are recorded (rollouts/recording/format.py), replayed and built into Episodes like the runner's. A
conversation broken by its client (it disconnected mid-generation) or by a generation error, or
still open when the server shuts down, is finished with an infrastructure stop reason and an
error text (`incomplete` in its metrics), so nothing is trained from it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import msgspec

from ...agents.chat import EpisodeRendering, Renderer
from ...agents.types import Completion, Message
from ...envs.tools.call_formats import get_format
from ..metrics import SEQUENCE_RESTARTS, episode_metrics
from ..recording.format import RecordingWriter
from ..types import SEQUENCE_START, StopReason, Trajectory, Transition
from .openai_api import assistant_text

_JSON_CALLS = get_format("json")
HISTORY_REWRITES = "history_rewrites"
INCOMPLETE = "incomplete"
ENDPOINT_ENV_ID = "toolgym/endpoint"  # Trajectory.env_id of captures with no agent program named


class CaptureInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Who a conversation is for (the agent runner registers it before the agent runs)."""

    label: str = ENDPOINT_ENV_ID  # Trajectory.env_id: the agent program, "module:function"
    task_seed: int = 0
    group_id: int = 0
    sample_index: int = 0
    sampling_seed: int | None = None  # each turn's seed is derived from it (reproducible runs)


class Choice(msgspec.Struct):
    """One sampled reply of a pending turn: its normalised message (or raw text) and Completion."""

    reply: Any
    completion: Completion


class _Pending(msgspec.Struct):
    observation: str
    observation_tokens: list[int]
    sequence_start: bool
    choices: list[Choice]


class _Spec:
    """A tool spec as envs/tools/call_formats.py's describe reads it."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.spec = dict(spec)


def tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools block a renderer without its own gets in the system message: the JSON format's
    description (envs/tools/call_formats.py), as the env's system prompts write it."""
    lines = _JSON_CALLS.describe(
        cast(Any, [_Spec(t) for t in tools]), "Reply in plain text when no tool is needed."
    )
    return "\n".join(lines)


def to_render(
    renderer: Renderer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> tuple[list[Any], list[dict[str, Any]] | None]:
    """Normalised messages (and tools) as the renderer takes them. A template that renders tools
    gets OpenAI-style dicts and the tools; plain ChatML gets Messages: the tools' description
    joined to the system message, assistant calls as `<tool_call>` blocks, and each run of tool
    results as one `tool` message of `<tool_response>` blocks (as the JSON tool format writes)."""
    if renderer.renders_tools:
        out: list[Any] = []
        for m in messages:
            item: dict[str, Any] = {"role": m["role"], "content": m["content"]}
            if m.get("tool_calls"):
                item["tool_calls"] = [
                    {"type": "function", "function": {"name": n, "arguments": a}} for n, a in m["tool_calls"]
                ]
            out.append(item)
        return out, [dict(t) for t in tools] if tools else None
    rendered: list[Any] = []
    extra = tools_text(tools) if tools else ""
    if extra and (not messages or messages[0]["role"] != "system"):
        rendered.append(Message("system", extra))
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "system" and i == 0 and extra:
            rendered.append(Message("system", f"{m['content']}\n\n{extra}" if m["content"] else extra))
        elif role == "assistant":
            rendered.append(Message("assistant", assistant_text(m)))
        elif role == "tool":
            block = _JSON_CALLS.result("", cast(Any, None), m["content"])
            last = rendered[-1] if rendered else None
            if (
                isinstance(last, Message)
                and last.role == "tool"
                and i > 0
                and messages[i - 1]["role"] == "tool"
            ):
                rendered[-1] = Message("tool", _JSON_CALLS.join([last.content, block]))
            else:
                rendered.append(Message("tool", block))
        else:
            rendered.append(Message(role, m["content"]))
    return rendered, None


def raw_tokens(renderer: Renderer, text: str) -> list[int]:
    """A raw /v1/completions prompt's ids: special-token strings in it are those tokens (the
    caller writes the format itself, as with any completions endpoint)."""
    return renderer.tokenizer.encode(text, add_special_tokens=False).ids


def _same_reply(sent: Mapping[str, Any], sampled: Mapping[str, Any]) -> bool:
    return sent.get("content", "").strip() == sampled.get("content", "").strip() and list(
        sent.get("tool_calls", ())
    ) == list(sampled.get("tool_calls", ()))


class Conversation:
    """One captured conversation (see the module doc). Used by one request at a time (`lock`)."""

    def __init__(self, conversation_id: str, info: CaptureInfo) -> None:
        self.id, self.info = conversation_id, info
        self.lock = asyncio.Lock()
        self.started = time.perf_counter()
        self.rendering: EpisodeRendering | None = None
        self.history: list[int] = []
        self.messages: list[dict[str, Any]] = []  # what the current history renders (chat)
        self.tools: list[dict[str, Any]] | None = None
        self.text = ""  # raw-text prompts (/v1/completions): the text so far
        self.pending: _Pending | None = None
        self.transitions: list[Transition] = []
        self.system_prompt = ""
        self.rewrites = 0
        self.template_restarts = 0  # restarts of finished renderings (the current one counts live)
        self.sampled_tokens = 0
        self.turns = 0  # requests sampled (seeds and tool-call ids)
        self.generate_s = 0.0
        self.broken: str | None = None  # why the capture cannot be trained on
        self.limit: StopReason | None = None  # a limit the endpoint refused a request for

    # ---- prompts ----------------------------------------------------------------------------

    def _settle_pending(self, chosen: int = 0) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            return
        transition = Transition(
            pending.observation, pending.observation_tokens, pending.choices[chosen].completion
        )
        if pending.sequence_start:
            transition.info = {SEQUENCE_START: True}
        self.transitions.append(transition)

    def _restart(
        self, renderer: Renderer, messages: list[dict[str, Any]], tools: Any
    ) -> tuple[list[int], bool]:
        if self.rendering is not None:
            self.template_restarts += self.rendering.restarts
        had_turns = bool(self.transitions or self.pending)
        self._settle_pending()
        if had_turns:
            self.rewrites += 1
        rendered, rendered_tools = to_render(renderer, messages, tools)
        self.rendering = renderer.start_episode(rendered, rendered_tools)
        self.history = list(self.rendering.prompt)
        self.messages, self.tools, self.text = messages, tools, ""
        if not self.system_prompt and messages and messages[0]["role"] == "system":
            self.system_prompt = messages[0]["content"]
        return list(self.rendering.prompt), had_turns

    def chat_prompt(
        self, renderer: Renderer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], list[int], bool]:
        """(the prompt, its observation tokens, whether they start a new training sequence) for
        normalised chat `messages`; the pending turn is settled (see the module doc)."""
        pending, held = self.pending, len(self.messages)
        chosen = None
        continues = pending is not None and self.rendering is not None and tools == self.tools
        if continues and len(messages) > held + 1 and messages[:held] == self.messages:
            sent, replies = messages[held], messages[held + 1 :]
            if (
                pending is not None
                and sent["role"] == "assistant"
                and all(m["role"] != "assistant" for m in replies)
            ):
                matches = (
                    i
                    for i, c in enumerate(pending.choices)
                    if isinstance(c.reply, dict) and _same_reply(sent, c.reply)
                )
                chosen = next(matches, None)
        if chosen is None or pending is None or self.rendering is None:
            return self._restart(renderer, messages, tools)[0], self.history[:], bool(self.transitions)
        completion = pending.choices[chosen].completion
        rendered, _ = to_render(renderer, messages[held + 1 :], None)  # tools: given at the start
        turn = self.rendering.extend(completion.tokens, rendered)
        self._settle_pending(chosen)
        self.messages = messages
        if turn.restarted:
            self.history = list(turn.tokens)
        else:
            self.history += completion.tokens
            self.history += turn.tokens
        return self.history[:], list(turn.tokens), turn.restarted

    def text_prompt(self, renderer: Renderer, prompt: str | list[int]) -> tuple[list[int], list[int], bool]:
        """The same for a /v1/completions prompt: raw text, or token ids."""
        pending = self.pending
        if pending is not None and self.rendering is None:
            for i, choice in enumerate(pending.choices):
                done_tokens = self.history + choice.completion.tokens
                done_text = self.text + choice.reply
                if (
                    isinstance(prompt, list)
                    and prompt[: len(done_tokens)] == done_tokens
                    and len(prompt) > len(done_tokens)
                ):
                    delta = prompt[len(done_tokens) :]
                elif (
                    isinstance(prompt, str) and prompt.startswith(done_text) and len(prompt) > len(done_text)
                ):
                    delta = raw_tokens(renderer, prompt[len(done_text) :])
                else:
                    continue
                self._settle_pending(i)
                self.history = done_tokens + delta
                self.text = prompt if isinstance(prompt, str) else ""
                return self.history[:], delta, False
        had_turns = bool(self.transitions or self.pending)
        self._settle_pending()
        self.rewrites += had_turns
        if self.rendering is not None:
            self.template_restarts += self.rendering.restarts
        self.rendering, self.messages, self.tools = None, [], None
        self.history = list(prompt) if isinstance(prompt, list) else raw_tokens(renderer, prompt)
        self.text = prompt if isinstance(prompt, str) else ""
        return self.history[:], self.history[:], had_turns

    def sampled(
        self, observation: str, observation_tokens: list[int], sequence_start: bool, choices: list[Choice]
    ) -> None:
        """Keep a request's sampled replies as the pending turn."""
        self.pending = _Pending(observation, observation_tokens, sequence_start, choices)
        self.sampled_tokens += sum(len(c.completion.tokens) for c in choices)
        self.turns += 1

    def drop_pending(self) -> None:
        """Replies that never reached the client (it disconnected): not trained on."""
        self.pending = None

    # ---- the end ----------------------------------------------------------------------------

    def finish(
        self,
        reward: float,
        components: Mapping[str, float] | None = None,
        metrics: Mapping[str, float] | None = None,
        stop_reason: StopReason = StopReason.ANSWERED,
        error: str | None = None,
        policy_version: int = 0,
    ) -> Trajectory:
        """The conversation as a Trajectory; the agent's reward goes on the last transition."""
        self._settle_pending()
        if self.rendering is not None:
            self.template_restarts += self.rendering.restarts
            self.rendering = None
        if self.broken is not None and error is None:
            stop_reason, error = StopReason.TIMEOUT, self.broken
        elif self.limit is not None and stop_reason == StopReason.ENV_ERROR:
            stop_reason = self.limit  # the agent failed because the endpoint refused a limit
        if self.transitions:
            self.transitions[-1].reward = float(reward)
        info = self.info
        trajectory = Trajectory(
            env_id=info.label,
            env_kwargs={"conversation_id": self.id},
            task_seed=info.task_seed,
            group_id=info.group_id,
            transitions=self.transitions,
            stop_reason=stop_reason,
            system_prompt=self.system_prompt,
            total_reward=float(reward),
            reward_components={k: float(v) for k, v in (components or {}).items()},
            policy_version=min((t.action.policy_version for t in self.transitions), default=policy_version),
            sample_index=info.sample_index,
            error=error,
        )
        trajectory.metrics = episode_metrics(trajectory, time.perf_counter() - self.started, self.generate_s)
        trajectory.metrics["env"] = {**dict(metrics or {}), HISTORY_REWRITES: float(self.rewrites)}
        trajectory.metrics[HISTORY_REWRITES] = self.rewrites
        trajectory.metrics[SEQUENCE_RESTARTS] = self.rewrites + self.template_restarts
        if error is not None and error.startswith("IncompleteCapture"):
            trajectory.metrics[INCOMPLETE] = True
        return trajectory


class CaptureStore:
    """The open conversations of one server, by id; finished ones go to `writer` (if any) and to
    whoever finished them. Used from the server's event loop only."""

    def __init__(self, writer: RecordingWriter | None = None) -> None:
        self.writer = writer
        self.open: dict[str, Conversation] = {}
        self.finished = 0
        self.incomplete = 0

    def register(self, conversation_id: str, info: CaptureInfo) -> Conversation:
        if conversation_id in self.open:
            raise ValueError(f"conversation {conversation_id!r} is already open")
        conversation = self.open[conversation_id] = Conversation(conversation_id, info)
        return conversation

    def get(self, conversation_id: str) -> Conversation:
        """The open conversation of that id (a new one for an id not seen: `toolgym serve`)."""
        conversation = self.open.get(conversation_id)
        if conversation is None:
            conversation = self.register(conversation_id, CaptureInfo())
        return conversation

    def finish(self, conversation_id: str, reward: float, **kwargs: Any) -> Trajectory:
        """Close the conversation (a new, empty one for an unknown id) and record its Trajectory."""
        conversation = self.open.pop(conversation_id, None) or Conversation(conversation_id, CaptureInfo())
        trajectory = conversation.finish(reward, **kwargs)
        self.finished += 1
        if self.writer is not None:
            self.writer.write(trajectory)
        return trajectory

    def close_all(self, why: str = "the server shut down with the conversation open") -> list[Trajectory]:
        """Finish every open conversation as incomplete (recorded, never trained on)."""
        trajectories = [
            self.finish(cid, 0.0, stop_reason=StopReason.TIMEOUT, error=f"IncompleteCapture: {why}")
            for cid in list(self.open)
        ]
        self.incomplete += len(trajectories)
        return trajectories
