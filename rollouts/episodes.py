"""Trajectory -> Episode: one token-exact, loss-masked training sequence per episode.

    tokens           = obs_0 + act_0 + obs_1 + act_1 + ... + obs_k + act_k
    loss_mask        =  0..0 + 1..1  +  0..0 + 1..1  + ... +  0..0 + 1..1
    sampler_logprobs =  0..0 + lp_0  +  0..0 + lp_1  + ...            (0.0 where masked)
    advantages       =  0..0 + A_0.. +  0..0 + A_1.. + ...            (0.0 where masked)

obs_0 is the whole rendered turn-0 prompt (system + first user message + assistant header);
obs_i (i > 0) is only the delta the renderer appended (end of turn if the model did not close it,
the env message, the next assistant header). The env's reply to the LAST action (the
trajectory's final_observation) is not part of the Episode: nothing follows it to train on.

A truncated last turn (the action hit a token limit, finish_reason "length"): its sampled tokens
are kept verbatim and trained on (mask 1), and nothing is added after them; no synthetic
end-of-turn token is invented, since the policy did not sample one. A turn cut mid-episode (the
runner's `cut_turn = "step"`) is closed by the next observation's delta, which the renderer
starts with the end of turn (mask 0), as after any turn that did not end with it.

Episodes longer than the trainer's sequence limit (rule `OverlongEpisodeRule`):
  - TRUNCATE_TURNS (default): keep the longest prefix of WHOLE turns (obs_i + act_i) that fits
    and drop the later turns. Each kept token keeps its exact context, so its policy-gradient term
    is unchanged; only later terms are lost. If not even turn 0 fits, the episode is dropped.
    Dropping long episodes outright would hide exactly the behaviour (tool spam, rambling) that
    the reward is meant to punish.
  - DROP: drop the whole episode.
Both are counted in `EpisodeStats` (truncated, dropped, tokens_dropped); nothing is ever cut
mid-turn.

Several sequences per episode: where a chat template was not append-only (agents/chat_template.py),
the runner restarted the history from the template's full re-rendering and marked that transition
(`info[SEQUENCE_START]`, rollouts/types.py). `trajectory_to_episodes` then builds one Episode per
sequence (each from its own first observation, with its turns' advantages; the rule above
applies to each); `build_episodes` uses it. The runner counts restarts (`sequence_restarts`).

An episode's advantage (`Advantage`) is one number, put on every sampled token (outcome credit),
or one number per turn (turn-level credit, rollouts/scoring/credit.py): turn t's on exactly turn t's
sampled tokens. Across several sequences each takes the advantages of the turns it holds, and
TRUNCATE_TURNS keeps those of the turns it keeps; observation tokens get 0 either way.
`turn_spans` says where each turn's sampled tokens landed (which Episode, which token span).
A third form is per token (on-policy distillation's teacher log-ratio, rollouts/scoring/distill.py):
per turn, a list with one number per sampled token of that turn, put on exactly those tokens.
Its teacher's top-k (distill.top_k > 0: `info[TEACHER_TOPK_IDS]`, `info[TEACHER_TOPK_LOGPROBS]`,
rollouts/types.py) go onto the Episode's sampled tokens alike, where every kept turn of the
sequence has them (`Episode.teacher_topk_ids`, `teacher_topk_logprobs`).

A mixture of experts' routing (`Completion.routes`, where the engine records it) covers the whole
sequence the engine ran for that turn, so a sequence's Episode takes its last kept turn's
(`Episode.routes`); none when that turn's does not cover exactly the kept tokens but the last.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec

from ..agents.types import Routes
from .types import (
    SEQUENCE_START,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
    Episode,
    StopReason,
    Trajectory,
    Transition,
)

# Episodes that ended because the infrastructure failed (an env or tool raised, a generation error
# or the wall clock): their outcome says nothing about the policy, so they are not trained on.
INFRA_STOP_REASONS = frozenset({StopReason.ENV_ERROR, StopReason.TIMEOUT})


# One turn's advantage: a number for each of its sampled tokens alike, or one per sampled token.
TurnAdvantage = float | list[float]
# One episode's advantage: a number for every turn alike, or a list with one per turn (each a
# number, or a list with one per sampled token of that turn).
Advantage = float | list[TurnAdvantage]


def per_turn_advantages(advantage: Advantage | Sequence[TurnAdvantage], turns: int) -> list[TurnAdvantage]:
    """The advantage of each of `turns` turns (a list must have exactly one per turn; a turn's
    entry is a number, or a list with one per sampled token)."""
    if isinstance(advantage, int | float):
        return [float(advantage)] * turns
    if len(advantage) != turns:
        raise ValueError(f"{len(advantage)} per-turn advantages for an episode of {turns} turns")
    return [[float(x) for x in a] if isinstance(a, list) else float(a) for a in advantage]


class OverlongEpisodeRule(enum.StrEnum):
    TRUNCATE_TURNS = "truncate_turns"
    DROP = "drop"


class EpisodeStats(msgspec.Struct):
    """Counts from building a batch of Episodes (they go into the step's metrics)."""

    built: int = 0
    truncated: int = 0  # over the sequence limit: later whole turns dropped
    dropped_overlong: int = 0  # over the sequence limit: episode dropped
    dropped_infra: int = 0  # env_error / timeout: not trained on
    tokens_dropped: int = 0  # tokens lost to the sequence limit

    def as_metrics(self, prefix: str = "episodes/") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in msgspec.structs.asdict(self).items()}


def sampled_length(trajectory: Trajectory) -> int:
    """Number of tokens the policy sampled in the episode (DAPO's response length)."""
    return sum(len(t.action.tokens) for t in trajectory.transitions)


def turn_segments(trajectory: Trajectory) -> list[tuple[list[int], list[int], list[float]]]:
    """Per turn: (observation tokens, sampled tokens, sampler logprobs)."""
    return _segments(trajectory.transitions)


def _segments(transitions: Sequence[Transition]) -> list[tuple[list[int], list[int], list[float]]]:
    return [(t.observation_tokens, t.action.tokens, t.action.logprobs) for t in transitions]


def sequences(trajectory: Trajectory) -> list[list[Transition]]:
    """The trajectory's transitions cut where a new training sequence starts (one list for an
    episode whose rendering never restarted)."""
    parts: list[list[Transition]] = []
    for i, transition in enumerate(trajectory.transitions):
        if i == 0 or transition.info.get(SEQUENCE_START) is True:
            parts.append([])
        parts[-1].append(transition)
    return parts


def trajectory_to_episodes(
    trajectory: Trajectory,
    advantage: Advantage | Sequence[TurnAdvantage],
    max_seq_len: int | None = None,
    rule: OverlongEpisodeRule = OverlongEpisodeRule.TRUNCATE_TURNS,
    stats: EpisodeStats | None = None,
) -> list[Episode]:
    """One Episode per training sequence of the trajectory (see the module doc); `advantage` is
    one number for every turn or one per transition."""
    stats = stats if stats is not None else EpisodeStats()
    per_turn = per_turn_advantages(advantage, len(trajectory.transitions))
    built: list[Episode | None] = []
    start = 0
    for part in sequences(trajectory):
        advantages = per_turn[start : start + len(part)]
        versions = _versions(part)
        built.append(
            _episode(
                trajectory,
                _segments(part),
                advantages,
                max_seq_len,
                rule,
                stats,
                versions,
                _teacher_top(part),
                [t.action.routes for t in part],
            )
        )
        start += len(part)
    return [episode for episode in built if episode is not None]


def trajectory_to_episode(
    trajectory: Trajectory,
    advantage: Advantage | Sequence[TurnAdvantage],
    max_seq_len: int | None = None,
    rule: OverlongEpisodeRule = OverlongEpisodeRule.TRUNCATE_TURNS,
    stats: EpisodeStats | None = None,
) -> Episode | None:
    """Build the Episode, or None when the sequence-limit rule drops it (counted in `stats`).
    For a trajectory of one training sequence (`trajectory_to_episodes` takes any)."""
    if len(sequences(trajectory)) > 1:
        raise ValueError("the trajectory holds several training sequences: use trajectory_to_episodes")
    stats = stats if stats is not None else EpisodeStats()
    return _episode(
        trajectory, turn_segments(trajectory), per_turn_advantages(advantage, len(trajectory.transitions)),
        max_seq_len, rule, stats, _versions(trajectory.transitions), _teacher_top(trajectory.transitions),
        [t.action.routes for t in trajectory.transitions],
    )  # fmt: skip


def _versions(transitions: Sequence[Transition]) -> list[list[int]]:
    """Per turn, per sampled token, the policy version that sampled it (several versions in one
    turn where weights were loaded in flight: Completion.token_versions)."""
    return [t.action.token_versions or [t.action.policy_version] * len(t.action.tokens) for t in transitions]


def _teacher_top(transitions: Sequence[Transition]) -> list[tuple[list, list]] | None:
    """Per turn, the teacher's top-k (ids, logprobs) of its sampled tokens; None unless every turn
    has them, one entry per sampled token."""
    out = []
    for t in transitions:
        ids, lps = t.info.get(TEACHER_TOPK_IDS), t.info.get(TEACHER_TOPK_LOGPROBS)
        n = len(t.action.tokens)
        if not (isinstance(ids, list) and isinstance(lps, list) and len(ids) == len(lps) == n):
            return None
        out.append((ids, lps))
    return out


def _kept_turns(lengths: Sequence[int], max_seq_len: int | None, rule: OverlongEpisodeRule) -> int:
    """How many leading turns (of these token lengths, observation + action) one sequence keeps
    under the sequence-limit rule (0: the sequence is dropped)."""
    if max_seq_len is None or sum(lengths) <= max_seq_len:
        return len(lengths)
    if rule == OverlongEpisodeRule.DROP:
        return 0
    running, keep = 0, 0
    for n in lengths:
        if running + n > max_seq_len:
            break
        running, keep = running + n, keep + 1
    return keep


def turn_spans(
    trajectory: Trajectory,
    max_seq_len: int | None = None,
    rule: OverlongEpisodeRule = OverlongEpisodeRule.TRUNCATE_TURNS,
) -> list[tuple[int, int, int] | None]:
    """Where each turn's sampled tokens are in the Episodes `trajectory_to_episodes` builds with
    the same limit and rule: per transition (episode index, start, end), tokens[start:end] of
    that Episode being exactly the turn's action tokens; None for a turn the rule dropped."""
    spans: list[tuple[int, int, int] | None] = []
    built = 0
    for part in sequences(trajectory):
        lengths = [len(t.observation_tokens) + len(t.action.tokens) for t in part]
        keep = _kept_turns(lengths, max_seq_len, rule)
        position = 0
        for i, transition in enumerate(part):
            if i >= keep:
                spans.append(None)
                continue
            start = position + len(transition.observation_tokens)
            spans.append((built, start, start + len(transition.action.tokens)))
            position += lengths[i]
        built += keep > 0
    return spans


def _episode(
    trajectory: Trajectory,
    segments: list[tuple[list[int], list[int], list[float]]],
    turn_advantages: list[TurnAdvantage],
    max_seq_len: int | None,
    rule: OverlongEpisodeRule,
    stats: EpisodeStats,
    versions: list[list[int]],
    teacher_top: list[tuple[list, list]] | None = None,
    routes: Sequence[Routes | None] = (),
) -> Episode | None:
    lengths = [len(o) + len(a) for o, a, _ in segments]
    total = sum(lengths)
    keep = _kept_turns(lengths, max_seq_len, rule)
    if keep < len(segments):
        if keep == 0:
            stats.dropped_overlong += 1
            stats.tokens_dropped += total
            return None
        stats.truncated += 1
        stats.tokens_dropped += total - sum(lengths[:keep])
    if keep == 0:  # no turn at all (e.g. the env failed at reset): nothing to train on
        return None

    tokens: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    advantages: list[float] = []
    token_versions: list[int] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    for turn, ((obs, act, lps), action_versions, advantage) in enumerate(
        zip(segments[:keep], versions[:keep], turn_advantages[:keep], strict=True)
    ):
        if teacher_top is not None:
            ids, values = teacher_top[turn]
            top_ids += [[] for _ in obs] + [[int(j) for j in row] for row in ids]
            top_logprobs += [[] for _ in obs] + [[float(x) for x in row] for row in values]
        # An observation carries the version of the action after it.
        token_versions += [action_versions[0] if action_versions else trajectory.policy_version] * len(obs) + action_versions
        tokens += obs
        loss_mask += [0] * len(obs)
        logprobs += [0.0] * len(obs)
        advantages += [0.0] * len(obs)
        tokens += act
        loss_mask += [1] * len(act)
        logprobs += [float(x) for x in lps]
        if isinstance(advantage, list):  # per token
            if len(advantage) != len(act):
                raise ValueError(f"{len(advantage)} per-token advantages for a turn of {len(act)} sampled tokens")
            advantages += advantage
        else:
            advantages += [advantage] * len(act)
    stats.built += 1
    # The last kept turn's routing covers every kept token but the last (module doc).
    last_routes = routes[keep - 1] if len(routes) >= keep else None
    if last_routes is not None and last_routes.positions != len(tokens) - 1:
        last_routes = None
    return Episode(
        tokens=tokens,
        loss_mask=loss_mask,
        sampler_logprobs=logprobs,
        advantages=advantages,
        policy_version=trajectory.policy_version,
        group_id=trajectory.group_id,
        reward=trajectory.total_reward,
        task_seed=trajectory.task_seed,
        token_versions=token_versions,
        teacher_topk_ids=top_ids,
        teacher_topk_logprobs=top_logprobs,
        routes=last_routes,
        guided=trajectory.guided,
    )


def build_episodes(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[Advantage],
    max_seq_len: int | None = None,
    rule: OverlongEpisodeRule = OverlongEpisodeRule.TRUNCATE_TURNS,
    skip_infra_failures: bool = True,
) -> tuple[list[Episode], EpisodeStats]:
    """Episodes for a batch of trajectories with their (already computed) advantages."""
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    stats = EpisodeStats()
    episodes: list[Episode] = []
    for trajectory, advantage in zip(trajectories, advantages, strict=True):
        if skip_infra_failures and trajectory.stop_reason in INFRA_STOP_REASONS:
            stats.dropped_infra += 1
            continue
        episodes += trajectory_to_episodes(trajectory, advantage, max_seq_len, rule, stats)
    return episodes, stats
