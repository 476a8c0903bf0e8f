"""One episode's conversation as the model sees it: tokens, and the messages a context policy
(rollouts/context.py) rewrites.

`EpisodeContext` keeps the conversation as messages beside the tokens and, after each env step
the episode goes on from, asks the policy (`rollout.context`, else the env's `context_policy`
hook, else KeepAll) whether to rewrite it. A rewrite renders the new conversation in full
(`renderer.start_episode`) and restarts the sequence exactly as a chat template that is not
append-only does (agents/chat_template.py). KeepAll never builds the message list: its history
stays append-only. The runner and replay's token check (`verify_tokens`) both go through here,
so they cannot disagree on where a segment starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...agents.chat import EpisodeRendering, RenderedTurn, Renderer
from ...agents.types import Message
from ...envs.core.info import NOTE
from ..context import ContextPolicy, Conversation, KeepAll, Turn, keeps_all
from .loop import describe


class ContextPolicyError(RuntimeError):
    """A context policy raised or returned something that is not a Conversation (the episode
    ends as an env error, as when a tool raises)."""


def turn_of(text: str, replies: Sequence[Message], info: Mapping[str, Any]) -> Turn:
    """The turn the model saw: its sampled `text`, the env's replies, the step's info and the note
    the action wrote (the info's `note`, envs/core/info.py)."""
    note = info.get(NOTE)
    return Turn([Message("assistant", text), *replies], info, note if isinstance(note, str) else None)


class EpisodeContext:
    """One episode's conversation as tokens and, unless the policy keeps everything, as messages.

    `prompt` first; then per sampled turn `extend`, which appends the turn to the conversation,
    asks the policy, and returns the tokens to feed next: the renderer's delta, or (a rewrite, or
    a chat template that restarts) the whole new history."""

    def __init__(
        self,
        renderer: Renderer,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        policy: ContextPolicy | None = None,
    ) -> None:
        self.renderer, self.tools = renderer, tools
        self.policy = policy if policy is not None else KeepAll()
        self.rendering: EpisodeRendering = renderer.start_episode(messages, tools)
        self.prompt = self.rendering.prompt
        self._turns: list[Turn] = []
        self.conversation = Conversation(list(messages), self._turns)
        self.rewrites = 0  # the policy's rewrites
        self._earlier_restarts = 0  # template restarts of renderings a rewrite replaced

    @property
    def template_restarts(self) -> int:
        return self._earlier_restarts + self.rendering.restarts

    def extend(
        self, sampled_tokens: Sequence[int], text: str, replies: Sequence[Message], info: Mapping[str, Any]
    ) -> tuple[RenderedTurn, bool]:
        """(what to feed next, whether the policy rewrote the conversation)."""
        if keeps_all(self.policy):
            return self.rendering.extend(sampled_tokens, replies), False
        self._turns.append(turn_of(text, replies, info))
        self.conversation = Conversation(self.conversation.head, self._turns)
        try:
            rewritten = self.policy.rewrite(self.conversation)
        except Exception as exc:
            raise ContextPolicyError(f"the context policy failed: {describe(exc)}") from exc
        if rewritten is not None and not isinstance(rewritten, Conversation):
            raise ContextPolicyError(f"the context policy returned {rewritten!r:.80}, not a Conversation")
        if rewritten is None:
            return self.rendering.extend(sampled_tokens, replies), False
        self._earlier_restarts += self.rendering.restarts
        self.conversation, self._turns = rewritten, list(rewritten.turns)
        self.rendering = self.renderer.start_episode(rewritten.messages, self.tools)
        self.rewrites += 1
        return RenderedTurn(list(self.rendering.prompt), restarted=True), True
