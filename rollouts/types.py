"""Records of what happened in an episode (Transition, Trajectory) and what the trainer eats
(Episode). msgspec Structs: JSON-serialisable, no tensors.

They live in rollouts/ because rollouts/ is where envs (strings) and agents (tokens) meet;
envs/ and agents/ import nothing from here. `Completion` comes from agents/.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from ..agents.types import Completion


class StopReason(enum.StrEnum):
    """Why an episode ended."""

    ANSWERED = "answered"  # the env terminated the episode (an answer was graded)
    NO_TOOL_CALL = "no_tool_call"  # the env truncated it: the policy stopped calling tools
    MAX_TURNS = "max_turns"  # the runner's turn limit, or the env's own turn limit
    MAX_TOKENS = "max_tokens"  # a turn or episode token budget ran out
    CONTEXT_OVERFLOW = "context_overflow"  # the next prompt would not fit the model's context
    PARSE_ERROR = "parse_error"  # the env gave up after too many malformed actions
    ENV_ERROR = "env_error"  # the env or a tool raised; the episode keeps what it had
    TIMEOUT = "timeout"  # the wall-clock limit, or a generation error


class Transition(msgspec.Struct):
    """One turn: what the model saw, what it sampled, and what the env said back.

    observation: the env's text shown before this action (the reset observation on turn 0).
    observation_tokens: the tokens fed to the model before this action: the whole rendered
        prompt on turn 0, then only the delta (end of the last turn, the env message, the next
        assistant header).
    """

    observation: str
    observation_tokens: list[int]
    action: Completion
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = msgspec.field(default_factory=dict)


class Trajectory(msgspec.Struct):
    """One episode, as recorded and replayed."""

    env_id: str
    env_kwargs: dict[str, Any]
    task_seed: int
    group_id: int
    transitions: list[Transition]
    stop_reason: StopReason
    system_prompt: str = ""
    final_observation: str = ""  # the env's reply to the last action (not shown to the model)
    total_reward: float = 0.0
    reward_components: dict[str, float] = msgspec.field(default_factory=dict)
    policy_version: int = 0
    sample_index: int = 0  # which of the group's G samples this is
    error: str | None = None  # the exception text for env_error / timeout
    metrics: dict[str, Any] = msgspec.field(default_factory=dict)


class Episode(msgspec.Struct):
    """One training sequence in token space. The trainer shifts it for next-token prediction.

    loss_mask is 1 exactly on tokens the policy sampled; sampler_logprobs is 0.0 where masked;
    advantages is the trajectory's advantage on sampled tokens and 0.0 elsewhere.
    """

    tokens: list[int]
    loss_mask: list[int]
    sampler_logprobs: list[float]
    advantages: list[float]
    policy_version: int = 0
    group_id: int = 0
    reward: float = 0.0
    task_seed: int = 0

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not (len(self.loss_mask) == len(self.sampler_logprobs) == len(self.advantages) == n):
            raise ValueError(
                "Episode fields disagree in length: "
                f"tokens={n} loss_mask={len(self.loss_mask)} "
                f"sampler_logprobs={len(self.sampler_logprobs)} advantages={len(self.advantages)}"
            )
