"""Records of what happened in an episode (Transition, Trajectory) and what the trainer eats
(Episode), and the settings declared once for every reader (PolicySampling, RolloutSettings: the
runner, the trainer, the config schema and the CLI). msgspec Structs: JSON-serialisable, no
tensors; cheap to import.

They live in rollouts/ because rollouts/ is where envs (strings) and agents (tokens) meet;
envs/ and agents/ import nothing from here. `Completion` comes from agents/.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

from ..agents.types import Completion, Routes
from .context import ContextPolicySpec


class PolicySampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the policy samples, configured once for a run (temperature, top_p, top_k): read by the
    rollout runner and the endpoint, which put these into every request's `SamplingParams`
    (agents/types.py: one generate call's parameters, with its own max_tokens, n, stops and
    seed), and by the trainer (logprobs of logits / temperature, so the ratio compares like with
    like). A config's `[policy]` section holds these fields (configs/schema.py)."""

    temperature: float = 1.0  # 0: greedy (evaluation only; RL needs > 0)
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"{type(self).__name__}.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{type(self).__name__}.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"{type(self).__name__}.top_k must be >= 0, got {self.top_k}")

    @classmethod
    def of(cls, settings: PolicySampling) -> PolicySampling:
        """The sampling fields alone of `settings` (e.g. a config's policy section)."""
        return cls(**{name: getattr(settings, name) for name in cls.__struct_fields__})


class RolloutSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The rollout settings that hold for any env (group size, limits, observation role,
    concurrency), declared once: a config's `[rollout]` section is this Struct, and the CLI's
    record/eval flags map onto its fields. `EnvRolloutConfig` (rollouts/episode/config.py) binds them to
    one env, the policy's sampling and a seed. Token limits count tokens of the policy's
    tokenizer."""

    group_size: int = 8  # G: samples per task seed
    max_turns: int = 8
    max_tokens_per_turn: int = 128  # SamplingParams.max_tokens of each turn
    max_tokens_per_episode: int = 1024  # sampled tokens over the whole episode
    context_length: int | None = None  # None: the policy's (`max_seq_len`)
    episode_timeout_s: float | None = 300.0
    observation_role: Literal["tool", "user"] = "tool"  # the chat role of env replies after the first
    max_concurrent_episodes: int | None = None  # None: all at once
    # What of the conversation the model sees (rollouts/context.py): e.g. {policy = "window",
    # turns = 4}; None: the env's own declaration, else keep everything.
    context: ContextPolicySpec | None = None
    # A turn cut by max_tokens_per_turn or the episode's budget (finish_reason "length"): "end"
    # ends the episode there (MAX_TOKENS); "step" gives its text to the env like any other turn
    # (the renderer closes it), so an env still answers a policy that does not yet stop its turns.
    # A turn cut by the context room always ends the episode.
    cut_turn: Literal["end", "step"] = "end"
    # Off-policy guidance: of each training group's G samples, the last `guided_samples` are
    # played by the env's oracle instead of the policy (rollouts/episode/runner.py `run_groups`;
    # eval never is), so a group whose samples all fail still has a win to learn from. Their
    # tokens are trained with the trainer's own logprobs as the ratio's denominator (ratio 1).
    guided_samples: int = 0

    def __post_init__(self) -> None:
        name_of = type(self).__name__
        for name in ("group_size", "max_turns", "max_tokens_per_turn", "max_tokens_per_episode"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name_of}.{name} must be >= 1, got {getattr(self, name)}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"{name_of}.context_length must be >= 2, got {self.context_length}")
        if self.episode_timeout_s is not None and self.episode_timeout_s <= 0:
            raise ValueError(f"{name_of}.episode_timeout_s must be > 0, got {self.episode_timeout_s}")
        if not 0 <= self.guided_samples < self.group_size:
            raise ValueError(
                f"{name_of}.guided_samples must be in [0, group_size={self.group_size}) (the policy samples "
                f"the rest of each group), got {self.guided_samples}"
            )
        if self.max_concurrent_episodes is not None and self.max_concurrent_episodes < 1:
            raise ValueError(f"{name_of}.max_concurrent_episodes must be >= 1, got {self.max_concurrent_episodes}")


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


# The runner's key in a Transition's info: its observation_tokens are a full re-rendering of the
# conversation (a chat template that was not append-only there, or a context policy's rewrite),
# so a new training sequence starts at this transition (rollouts/episodes.py).
SEQUENCE_START = "sequence_start"
# The runner's key beside SEQUENCE_START where the restart is a context policy's rewrite
# (rollouts/context.py) rather than the chat template's.
CONTEXT_REWRITE = "context_rewrite"
# The episode loop's key in a Transition's info: the turn was cut by a token limit (finish_reason
# "length") and its text given to the env all the same (`RolloutSettings.cut_turn = "step"`).
CUT_TURN_STEPPED = "cut_turn_stepped"
# On-policy distillation's keys in a Transition's info with distill.top_k > 0 (the teacher's,
# rollouts/scoring/teacher.py): per sampled token of the action, the teacher's top-k token ids and
# their logprobs, best first; the Episode builder carries them onto the Episode.
TEACHER_TOPK_IDS = "teacher_topk_ids"
TEACHER_TOPK_LOGPROBS = "teacher_topk_logprobs"


class Transition(msgspec.Struct):
    """One turn: what the model saw, what it sampled, and what the env said back.

    observation: the env's text shown before this action (the reset observation on turn 0).
    observation_tokens: the tokens fed to the model before this action: the whole rendered
        prompt on turn 0, then only the delta (end of the last turn, the env message, the next
        assistant header); or, where info[SEQUENCE_START] is true, the whole re-rendered history.
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
    # The reset info a renderer that writes tools itself was given (envs/core/info.py: tools and
    # instructions), so replay renders the same first prompt; {} when it was given no tools.
    reset_info: dict[str, Any] = msgspec.field(default_factory=dict)
    # The context policy the runner applied (rollouts/context.py `policy_spec`, e.g. {"policy":
    # "window", "turns": 4, "slack": 0}), so replay rewrites the conversation where it did; {}
    # when it kept everything.
    context_policy: dict[str, Any] = msgspec.field(default_factory=dict)
    # The seat this episode played in a game of several seats (envs/core/seats.py; the match
    # runner, rollouts/episode/match.py): the seats of one match share task_seed and
    # sample_index. "" for a single-seat env.
    seat: str = ""
    # False: a seat of a match that the run played but did not train (learn = "one": the
    # opponent's, by a bot, the policy or a pool member), recorded beside the learning seat's.
    trained: bool = True
    # True: played by the env's oracle in a training group (RolloutSettings.guided_samples), not
    # sampled by the policy; its logprobs are 0.0, not the policy's.
    guided: bool = False


class Episode(msgspec.Struct):
    """One training sequence in token space. The trainer shifts it for next-token prediction.

    loss_mask is 1 exactly on tokens the policy sampled; sampler_logprobs is 0.0 where masked;
    advantages is the trajectory's advantage on sampled tokens and 0.0 elsewhere.
    token_versions: per token, the policy version that sampled it (an observation token carries
    the version of the action after it); [] means every token is `policy_version`, the oldest.
    A policy that takes new weights between requests gives an episode's turns their own
    versions, and one that takes them in flight (the torch engine's "in_flight" weight updates)
    a turn's tokens theirs; the trainer's staleness of a token is its step minus the version.
    teacher_topk_ids, teacher_topk_logprobs: on-policy distillation's top-k (distill.top_k > 0):
    per token, the teacher's k most likely token ids there and their logprobs, best first, on
    sampled tokens ([] on the others); [] when the teacher gave none. The trainer's top-k forward
    KL reads them (trainers/losses/terms.py `TopKForwardKL`).
    routes: a mixture of experts' routing as the sampler ran it, of the first `routes.positions`
    tokens (every token but the last, as an engine that records routes gives them:
    agents/engine/routes.py); None when not recorded. The trainer replays it
    (TrainerConfig.replay_routes).
    guided: its "sampled" tokens are the env oracle's (Trajectory.guided): the trainer uses its own
    detached logprobs in place of sampler_logprobs (0.0), so their ratio is 1.
    """

    tokens: list[int]
    loss_mask: list[int]
    sampler_logprobs: list[float]
    advantages: list[float]
    policy_version: int = 0
    group_id: int = 0
    reward: float = 0.0
    task_seed: int = 0
    token_versions: list[int] = msgspec.field(default_factory=list)
    teacher_topk_ids: list[list[int]] = msgspec.field(default_factory=list)
    teacher_topk_logprobs: list[list[float]] = msgspec.field(default_factory=list)
    routes: Routes | None = None
    guided: bool = False

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if self.routes is not None and self.routes.positions >= n:
            raise ValueError(
                f"Episode has {n} tokens but routes for {self.routes.positions} positions (at most {n - 1})"
            )
        if (self.teacher_topk_ids or self.teacher_topk_logprobs) and not (
            len(self.teacher_topk_ids) == len(self.teacher_topk_logprobs) == n
        ):
            raise ValueError(
                f"Episode has {n} tokens but teacher top-k for {len(self.teacher_topk_ids)} "
                f"(ids) and {len(self.teacher_topk_logprobs)} (logprobs)"
            )
        if self.token_versions and len(self.token_versions) != n:
            raise ValueError(f"Episode has {n} tokens but {len(self.token_versions)} token_versions")
        if not (len(self.loss_mask) == len(self.sampler_logprobs) == len(self.advantages) == n):
            raise ValueError(
                "Episode fields disagree in length: "
                f"tokens={n} loss_mask={len(self.loss_mask)} "
                f"sampler_logprobs={len(self.sampler_logprobs)} advantages={len(self.advantages)}"
            )
