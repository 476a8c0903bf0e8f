"""Context policies: what of an episode's conversation the model sees at its next turn.

A long agent episode does not fit one growing context. A context policy looks at the
conversation after every env step and either leaves it alone (the history grows append-only, as
it always did) or rewrites it: returns the messages the model sees from now on. The runner
(rollouts/episode/: its `EpisodeContext`) then renders the rewritten conversation in full through the episode's
renderer (token-exact: the same canonical rendering as any first prompt) and the next turn
starts a new training sequence (`Transition.info[SEQUENCE_START]`, plus `CONTEXT_REWRITE`). A
rewrite is exactly the sequence restart a chat template that is not append-only already causes,
so Episodes split there (rollouts/episodes.py): each segment has its own tokens, loss mask and
logprobs, and every segment of an episode takes the episode's advantage (or its turns' own,
turn-level credit). The sampled tokens stay verbatim within a segment; a later segment renders
earlier assistant turns canonically from their text, as an SFT demo would.

The conversation (`Conversation`) is the `head` (the system message and the task: what the
first prompt rendered) and the `turns` the model currently sees, each the assistant's message
(its sampled text) with the env's replies (`env_replies`: one `tool` message per tool result for
a renderer that writes tools, else the observation), the step's info, and the note the action
wrote, if any (`Turn.note`: the step info's `note`, envs/core/info.py, which the runner reads
into it, so this module reads no info key and stays cheap to import). Policies:

- `KeepAll` (the default): never rewrites. The runner keeps its append-only path.
- `SlidingWindow(turns=K)`: head + the last K turns, once there are more than K + slack.
- `ElideToolResults(keep_last=K, marker=...)`: the env's replies older than the last K are
  replaced by `marker`, once more than K + slack are shown in full.
- `Notes()`: when the action wrote a note (`Turn.note`; a ToolEnv with `notes=True` has a NOTE
  tool in its own call format), the conversation becomes head + the note turns so far (the last
  `keep_last`, if set): the model's notes are all it keeps.

`slack` trades context for cost: each rewrite starts a segment that renders the kept
conversation again, so rewriting at every turn re-encodes the window once per turn; with
slack S the window is cut back every S + 1 turns.

Writing one's own: any object with `rewrite(conversation) -> Conversation | None` (the
`ContextPolicy` protocol). It must be a pure function of the conversation (replay `--verify`
applies it again to check the recorded tokens), and should return None when nothing changes.
Declared as a msgspec Struct tagged like the built-ins (`tag_field="policy"`) and registered
with `register_context_policy`, it is recorded and replayed by name; e.g.

    class LastTurnOnly(msgspec.Struct, frozen=True, tag="last_turn", tag_field="policy"):
        def rewrite(self, c: Conversation) -> Conversation | None:
            return Conversation(c.head, c.turns[-1:]) if len(c.turns) > 1 else None

Who chooses: `[rollout] context = {policy = "window", turns = 4}` in a run config
(RolloutSettings.context); else the env's declaration (its unwrapped env's `context_policy`, a
spec dict such as {"policy": "notes"}); else KeepAll. `Trajectory.context_policy` records the
spec the runner applied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import msgspec

from ..agents.types import Message

DEFAULT_MARKER = "[elided]"


class Turn(NamedTuple):
    """One turn as the model sees it: the assistant's message, then the env's replies; the step's
    info (what the env said about the action); and the note the action wrote (the info's `note`,
    envs/core/info.py), or None."""

    messages: Sequence[Message]
    info: Mapping[str, Any] = {}
    note: str | None = None


class Conversation(NamedTuple):
    """What the model sees: the head (system message and task) and the turns after it."""

    head: Sequence[Message]
    turns: Sequence[Turn]

    @property
    def messages(self) -> list[Message]:
        return [*self.head, *(m for turn in self.turns for m in turn.messages)]


@runtime_checkable
class ContextPolicy(Protocol):
    """Decides, after each env step, whether to rewrite the conversation (see the module doc)."""

    def rewrite(self, conversation: Conversation) -> Conversation | None:
        """The conversation the model sees from now on, or None to keep appending."""
        ...


_STRUCT = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True, "tag_field": "policy"}


class KeepAll(msgspec.Struct, tag="keep_all", **_STRUCT):
    """Everything stays: the history is append-only (today's behaviour, the default)."""

    def rewrite(self, conversation: Conversation) -> Conversation | None:
        return None


class SlidingWindow(msgspec.Struct, tag="window", **_STRUCT):
    """Head + the last `turns` turns, rewritten once more than `turns + slack` are shown."""

    turns: int = 4
    slack: int = 0

    def __post_init__(self) -> None:
        _check("SlidingWindow", turns=(self.turns, 1), slack=(self.slack, 0))

    def rewrite(self, conversation: Conversation) -> Conversation | None:
        if len(conversation.turns) <= self.turns + self.slack:
            return None
        return Conversation(conversation.head, conversation.turns[-self.turns :])


class ElideToolResults(msgspec.Struct, tag="elide", **_STRUCT):
    """The env's replies (tool results, observations) older than the last `keep_last` are
    replaced by `marker`; the assistant's turns stay. Rewritten once more than
    `keep_last + slack` replies are shown in full."""

    keep_last: int = 2
    marker: str = DEFAULT_MARKER
    slack: int = 0

    def __post_init__(self) -> None:
        _check("ElideToolResults", keep_last=(self.keep_last, 0), slack=(self.slack, 0))

    def rewrite(self, conversation: Conversation) -> Conversation | None:
        shown = [
            (t, k)
            for t, turn in enumerate(conversation.turns)
            for k, m in enumerate(turn.messages)
            if m.role != "assistant" and m.content != self.marker
        ]
        if len(shown) <= self.keep_last + self.slack:
            return None
        elide = set(shown[: len(shown) - self.keep_last])
        turns = [
            turn._replace(
                messages=[
                    Message(m.role, self.marker) if (t, k) in elide else m
                    for k, m in enumerate(turn.messages)
                ]
            )
            for t, turn in enumerate(conversation.turns)
        ]
        return Conversation(conversation.head, turns)


class Notes(msgspec.Struct, tag="notes", **_STRUCT):
    """When the latest action wrote a note (`Turn.note`), the conversation becomes head + the
    note turns so far (each the note action and the env's acknowledgement; only the last
    `keep_last` when set). Other turns append as usual."""

    keep_last: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None:
            _check("Notes", keep_last=(self.keep_last, 1))

    def rewrite(self, conversation: Conversation) -> Conversation | None:
        if not conversation.turns or not is_note(conversation.turns[-1]):
            return None
        notes = [turn for turn in conversation.turns if is_note(turn)]
        if self.keep_last is not None:
            notes = notes[-self.keep_last :]
        return Conversation(conversation.head, notes)


def is_note(turn: Turn) -> bool:
    """Whether the turn's action wrote a note (a non-empty `Turn.note`)."""
    return isinstance(turn.note, str) and bool(turn.note)


def _check(name: str, **values: tuple[int, int]) -> None:
    for field, (value, minimum) in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name}.{field} must be an int >= {minimum}, got {value!r}")


# The built-in policies as one typed config (`[rollout] context = {policy = "window", turns = 4}`).
ContextPolicySpec = KeepAll | SlidingWindow | ElideToolResults | Notes

_REGISTRY: dict[str, Callable[..., ContextPolicy]] = {
    "keep_all": KeepAll,
    "window": SlidingWindow,
    "elide": ElideToolResults,
    "notes": Notes,
}


def register_context_policy(name: str, factory: Callable[..., ContextPolicy]) -> None:
    """Make `{"policy": name, **params}` build `factory(**params)` (for recordings and env
    declarations of one's own policy)."""
    _REGISTRY[name] = factory


def context_policy(spec: ContextPolicy | Mapping[str, Any] | None) -> ContextPolicy:
    """A policy from a spec dict (`{"policy": "window", "turns": 4}`), a policy itself, or None
    (KeepAll). Raises ValueError for an unknown name or bad parameters."""
    if spec is None:
        return KeepAll()
    if not isinstance(spec, Mapping):
        if not isinstance(spec, ContextPolicy):
            raise TypeError(f"a context policy has rewrite(conversation), got {spec!r:.80}")
        return spec
    params = dict(spec)
    name = params.pop("policy", None)
    factory = _REGISTRY.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ValueError(f"unknown context policy {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    try:
        return factory(**params)
    except TypeError as exc:
        raise ValueError(f"context policy {name!r}: {exc}") from None


def policy_spec(policy: ContextPolicy) -> dict[str, Any]:
    """What a recording keeps of `policy`: its tagged fields for a tagged msgspec Struct (every
    built-in), else {"policy": its class name} (replay cannot rebuild it unless registered)."""
    if isinstance(policy, msgspec.Struct) and isinstance(type(policy).__struct_config__.tag, str):
        return msgspec.to_builtins(policy)
    return {"policy": type(policy).__qualname__}


def keeps_all(policy: ContextPolicy) -> bool:
    return isinstance(policy, KeepAll)
