"""On-policy distillation (OPD): a teacher's per-token log-ratio as a per-token advantage.

The teacher (teacher.py) scores every token the student sampled and writes its log-probabilities
into the trajectory (`Transition.info[TEACHER_LOGPROBS]`: one float per sampled token of the
turn's action), so the recording carries them and replay and the viewer score the same episodes
the same way. The scorer (scorer.py, `score_group` with a `DistillConfig`) then gives each sampled
token t of turn k the advantage

    A_t = reward_weight * A_reward(k) + weight * (logp_teacher(t) - logp_sampler(t))

A_reward(k) the usual outcome or turn-level advantage (advantages.py, credit.py), the second term
the negative per-token reverse KL estimate log pi_student(x_t) - log pi_teacher(x_t) on the
sampled token, undiscounted (each token's own, no return-to-go over later tokens), as in
Agarwal et al. 2024 (GKD) and Thinking Machines' "On-Policy Distillation" (2025). The policy
gradient of sum_t A_t log pi(x_t) with this term minimises the reverse KL KL(pi_student ||
pi_teacher) on the student's own samples. `logp_sampler` is the sampler's (Episode's
sampler_logprobs, after temperature); the teacher computes its logprobs at the same temperature,
so a teacher equal to the student gives 0.

The advantage is per token (`Advantage`'s per-token form: per turn, one float per sampled token),
laid out on the episode's turns, so it follows every training sequence the Episodes builder cuts
(context-policy rewrites, templates that are not append-only) and TRUNCATE_TURNS, and every loss
in the registry reads it as it reads any advantage.

Top-k forward KL (GKD's forward term; `distill.top_k` > 0): the teacher also gives, at each
sampled token's position, its `top_k` most likely tokens and their logprobs
(`info[TEACHER_TOPK_IDS]`, `info[TEACHER_TOPK_LOGPROBS]`: per sampled token a list of k ids, and
of k logprobs, best first); the Episode carries them per token (rollouts/types.py) and the trainer
adds `forward_kl_weight` x sum_{j in top-k} p_T(j) (log p_T(j) - log p_S(j)) at each sampled
token, with the student's log-softmax from its own forward (trainers/losses/terms.py
`TopKForwardKL`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import msgspec

from ..episodes import Advantage, TurnAdvantage, per_turn_advantages
from ..types import TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS, Trajectory
from .credit import CREDIT_METRIC_TURNS

# Transition.info key: the teacher's log-probability of each of the action's sampled tokens.
TEACHER_LOGPROBS = "teacher_logprobs"
# TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS (rollouts/types.py, where the Episode builder reads
# them): per sampled token of the action, the teacher's top-k token ids and logprobs.
# The most top-k an endpoint gives (vLLM's default max_logprobs; toolgym serve's limit).
MAX_TOP_K = 20


class DistillConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A config's `[distill]` section.

    teacher: where the teacher's logprobs come from; "" = off. Either a Hugging Face directory
        (config.json, safetensors, tokenizer.json with the student's tokenizer) that toolgym's
        own model code loads (teacher.py, `Teacher`), or the base URL of an OpenAI-compatible
        endpoint, `http://host:port/v1` (any value starting with http:// or https://), that
        scores token-id prompts through the completions API with vLLM's `prompt_logprobs`
        (vLLM's OpenAI server, or `toolgym serve`; endpoint_teacher.py, `EndpointTeacher`). One
        string either way, so the recording's teacher entry, the config's checks and `--set
        distill.teacher=...` treat both alike; what only an endpoint needs has its own keys:
    teacher_model: the endpoint's model name (the request's `model`); "" = the one model its
        /v1/models lists. Only with an endpoint teacher.
    teacher_timeout_s: seconds an endpoint request may take before it counts as a scoring failure.
    weight: the weight of the teacher's log-ratio in each token's advantage.
    reward_weight: the weight of the env reward's advantage; 0 = pure on-policy distillation.
    max_consecutive_failures: groups in a row whose teacher scoring raised (each dropped as an
        infrastructure failure) before the run stops with the cause.
    top_k: 0 = off; k in 1..MAX_TOP_K (20): the teacher also gives its k most likely tokens and
        their logprobs at every sampled position (a checkpoint from its own forward, an endpoint
        through `prompt_logprobs: k`), and the loss adds the top-k forward KL below.
    forward_kl_weight: the weight of the top-k forward KL term, sum over the teacher's top-k
        tokens j of p_T(j) (log p_T(j) - log p_S(j)), added to each sampled token's loss
        (GKD's forward KL on the student's own samples, beside the reverse-KL advantage above);
        p_T is the teacher's full-vocabulary probability, NOT renormalised over the top k, so
        each summand is exactly one of the full forward KL's, the term is 0 when the student
        equals the teacher, and what it drops is only the teacher's tail mass (renormalising p_T
        alone would leave -log P_T(top-k) > 0 at student = teacher). Must be > 0 with top_k > 0.
    """

    teacher: str = ""
    weight: float = 1.0
    reward_weight: float = 0.0
    max_consecutive_failures: int = 3
    teacher_model: str = ""
    teacher_timeout_s: float = 120.0
    top_k: int = 0
    forward_kl_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("weight", "reward_weight", "forward_kl_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"distill.{name} must be a finite number >= 0, got {value}")
        if self.teacher and self.weight == 0 and self.reward_weight == 0:
            raise ValueError(
                "distill.weight and distill.reward_weight are both 0: every advantage would be 0"
            )
        if self.max_consecutive_failures < 1:
            raise ValueError(
                f"distill.max_consecutive_failures must be >= 1, got {self.max_consecutive_failures}"
            )
        if self.teacher_model and not self.endpoint:
            raise ValueError(
                "distill.teacher_model names an endpoint's model: distill.teacher must then be its "
                f"URL (http://host:port/v1), got {self.teacher!r}"
            )
        if not (math.isfinite(self.teacher_timeout_s) and self.teacher_timeout_s > 0):
            raise ValueError(
                f"distill.teacher_timeout_s must be a finite number > 0, got {self.teacher_timeout_s}"
            )
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"distill.top_k must be in 0..{MAX_TOP_K} (0 = off), got {self.top_k}")
        if self.top_k and self.forward_kl_weight == 0:
            raise ValueError("distill.top_k > 0 needs distill.forward_kl_weight > 0 (else top_k = 0)")

    @property
    def forward_kl(self) -> float:
        """The top-k forward KL's weight in the loss: 0 when off (no teacher, or top_k 0)."""
        return self.forward_kl_weight if self.enabled and self.top_k else 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.teacher)

    @property
    def endpoint(self) -> bool:
        """The teacher is an OpenAI-compatible endpoint's URL, not a directory."""
        return self.teacher.startswith(("http://", "https://"))


def teacher_log_ratios(trajectory: Trajectory) -> list[list[float]]:
    """Per turn, per sampled token: logp_teacher - logp_sampler. ValueError where a turn has no
    teacher logprobs or not one per sampled token (an episode the teacher did not score is never
    trained with a zero log-ratio)."""
    out: list[list[float]] = []
    for k, transition in enumerate(trajectory.transitions):
        teacher = transition.info.get(TEACHER_LOGPROBS)
        sampler = transition.action.logprobs
        if not isinstance(teacher, list) or len(teacher) != len(sampler):
            got = "none" if not isinstance(teacher, list) else f"{len(teacher)} values"
            raise ValueError(
                f"turn {k} of episode (group {trajectory.group_id}, sample {trajectory.sample_index}) has "
                f"{len(sampler)} sampled tokens but teacher logprobs: {got}"
            )
        out.append([float(t) - float(s) for t, s in zip(teacher, sampler, strict=True)])
    return out


def distill_advantage(
    trajectory: Trajectory, reward_advantage: Advantage, config: DistillConfig
) -> Advantage:
    """The per-token advantage of one episode (module doc): per turn, one float per sampled token."""
    turns = len(trajectory.transitions)
    reward = per_turn_advantages(reward_advantage, turns)
    out: list[TurnAdvantage] = []
    for a, ratios in zip(reward, teacher_log_ratios(trajectory), strict=True):
        if isinstance(a, list):  # already per token (not produced by the scorers, but accepted)
            out.append([config.reward_weight * x + config.weight * r for x, r in zip(a, ratios, strict=True)])
        else:
            out.append([config.reward_weight * a + config.weight * r for r in ratios])
    return out


def reverse_kl_metrics(trajectories: Sequence[Trajectory], prefix: str = "distill/") -> dict[str, float]:
    """Over these trajectories' sampled tokens that the teacher scored: `reverse_kl_mean`, the mean
    of logp_sampler - logp_teacher (the per-token reverse KL estimate), and `reverse_kl_turn{t}`,
    its mean over turn index t's tokens, for t < CREDIT_METRIC_TURNS (0 where no token)."""
    total: list[float] = []
    by_turn: list[list[float]] = [[] for _ in range(CREDIT_METRIC_TURNS)]
    for trajectory in trajectories:
        for t, transition in enumerate(trajectory.transitions):
            teacher = transition.info.get(TEACHER_LOGPROBS)
            if not isinstance(teacher, list) or len(teacher) != len(transition.action.logprobs):
                continue
            kl = [float(s) - float(x) for s, x in zip(transition.action.logprobs, teacher, strict=True)]
            total += kl
            if t < CREDIT_METRIC_TURNS:
                by_turn[t] += kl
    metrics = {f"{prefix}reverse_kl_mean": math.fsum(total) / len(total) if total else 0.0}
    for t, values in enumerate(by_turn):
        metrics[f"{prefix}reverse_kl_turn{t}"] = math.fsum(values) / len(values) if values else 0.0
    metrics[f"{prefix}scored_tokens"] = float(len(total))
    return metrics


class TeacherScorer(Protocol):
    """What the batch assembly needs of a teacher (teacher.py's `Teacher` is one): its config, and
    `annotate(group)`, which writes TEACHER_LOGPROBS into every transition of the group's
    trajectories and returns None, or the cause (one line) when scoring this group failed (the
    group is then dropped as an infrastructure failure); after `max_consecutive_failures` failures
    in a row it raises instead (teacher.py's TeacherError)."""

    @property
    def config(self) -> DistillConfig: ...

    def annotate(self, group: Sequence[Trajectory]) -> str | None: ...


__all__ = [
    "MAX_TOP_K",
    "TEACHER_LOGPROBS",
    "TEACHER_TOPK_IDS",
    "TEACHER_TOPK_LOGPROBS",
    "DistillConfig",
    "TeacherScorer",
    "distill_advantage",
    "reverse_kl_metrics",
    "teacher_log_ratios",
]
