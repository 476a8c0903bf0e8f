"""Credit over turns: per-turn rewards, discounted returns-to-go, and turn-level advantages.

Pure functions of plain numbers (and of a Trajectory's rewards); the scorer (scorer.py,
`score_group`) calls them for `AdvantageConfig.credit = "turn_loo"` or "turn_state", and the
Episodes builder (rollouts/episodes.py) puts each turn's advantage on that turn's sampled tokens.

Per-turn rewards and returns. Turn t of an episode (t = 0 .. T-1) is its t-th transition: the
observation, the action the policy sampled, and the env's reward for that step. That reward
already holds everything the env (envs/core/ledger.py) gave at the step: tool awards (a process
reward such as Zorplex's `chain_reward`), penalties, and on the last turn the grade, the
final-state components and an abandoned episode's settlement (the runner adds it to the last
transition), so the rewards of an episode sum to its total reward. DAPO's overlong penalty, when
on, is a function of the whole episode's length and is added to the last turn's reward. The
return-to-go of turn t is G_t = r_t + gamma * r_{t+1} + ... + gamma^(T-1-t) * r_{T-1}.

The estimators (notation: a group of G episodes of one task, episode i with T_i turns, grad log
pi_t the score of turn t's action, i.e. the sum over its sampled tokens; J the expected total
reward; every statement is about the expectation over the group):

- "outcome" (the default; `group_advantages` in advantages.py): every turn gets the episode's
  group advantage A_i of its total reward R_i. With "dr_grpo", A_i = R_i - mean(R) =
  (G-1)/G * (R_i - mean of the OTHER episodes' R), so sum_t A_i grad log pi_t is an unbiased
  estimate of (G-1)/G * grad J: the true gradient scaled by a constant, same direction. With
  "grpo" A_i is also divided by the group's std, which depends on R_i itself: biased beyond a
  scale (it up-weights groups whose rewards barely differ; Liu et al. 2025, "Understanding
  R1-Zero-like training"). Variance: each turn's score is multiplied by the whole episode's
  reward, including the rewards earned BEFORE the turn, which its action cannot change.
- "turn_loo": A_{i,t} = G_{i,t} - b_{i,t}, where b_{i,t} is the mean return-to-go at turn index
  t of the group's OTHER episodes that reached turn t. Unbiased for grad J when gamma = 1 and
  estimator = "dr_grpo", with no scale factor:
    * E[sum_t grad log pi_t * G_t] = grad J (REINFORCE with causality: a reward earned before
      turn t does not depend on a_t given the history, so dropping it changes no expectation);
    * b_{i,t} is a function of the other episodes only, which are sampled independently of
      episode i given the task, so E[grad log pi_{i,t} * b_{i,t}] = E[b_{i,t}] *
      E[E[grad log pi_{i,t} | history to turn t]] = 0. Whether episode i reached turn t is
      decided before a_{i,t}, so ragged groups (episodes of different lengths) keep this.
  A turn index no other episode reached: b_{i,t} is the mean of the other episodes' LAST turn's
  return-to-go (the step where the grade lands: what an episode of this group ended with), and 0
  in a group with no other episode. Both depend on the other episodes only: still unbiased.
  Turns after an episode ended do not exist: they get no advantage and no tokens, and that
  episode is left out of the baselines at those turn indices.
  Variance: lower than outcome's for turns whose reward comes later (the earlier rewards are
  dropped), and the baseline follows how the return-to-go shrinks over turns. The baseline is a
  mean over turn INDEX, not over the state reached: an episode whose turn t is unlike the others'
  (a different point in the task) gets a noisier baseline, never a biased one. The leave-one-out
  mean over G-1 episodes adds Var(G_t)/(G-1) of its own; G >= 4 keeps that small.
  gamma < 1: sum_t grad log pi_t * G^gamma_t is the usual discounted surrogate. It is NOT an
  unbiased estimate of grad J (it favours near rewards and is not in general the gradient of any
  objective; Nota & Thomas 2020, "Is the policy gradient a gradient?"); it trades that bias for
  lower variance over long horizons. The baseline still adds no bias to it.
  estimator "grpo": A_{i,t} is divided by (std_t + eps), std_t the sample std (ddof=1) of the
  return-to-go at turn t over the group's episodes that reached it (no division where fewer than
  two did or all were equal). std_t includes episode i's own return, so this is biased in the
  same known way GRPO is; "dr_grpo" (no division) is the unbiased one.

- "turn_state": as "turn_loo", but b_{i,t} is the mean return-to-go of the group's OTHER
  episodes at the first turn where they stood in the same state as episode i at turn t (a key
  per turn, `turn_states`: the env's `credit_state` from the step before, else the exact history
  of observations and actions so far), falling back to "turn_loo"'s baseline where no other
  episode did. Unbiased for the same reason: the key is fixed by episode i's history before
  a_{i,t}, and the rest is the other episodes, so E[grad log pi_{i,t} * b_{i,t} | history] = 0;
  a key that looked past a_{i,t} (its step's own outcome) would not be (the test checks it).
  Variance: the baseline approaches the state's value V(s_t) rather than the turn index's mean,
  so a turn after an episode's chain broke (V near 0) is no longer pushed down by the group's
  successes; the more the key's states differ in value, the more it removes.

Policy versions (async training, weights loaded in flight): the group's episodes may come from
different policy versions, each token recording its own (Episode.token_versions). The baseline is
still a function of the other episodes only, so the argument above holds for the sampling
distribution; correcting for the sampler being older than the trainer is the loss's job (token
TIS, sequence IS masking: the trainer's loss), which multiplies each token's advantage, turn-level
or not, the same way. An over-stale group's advantages are scaled, every turn alike (scorer.py,
`OverStale`, applied by the batch assembler).

The unbiasedness claims are checked against an exactly enumerated policy gradient on a small
tabular multi-turn MDP, through `score_group` and the Episodes builder
(tests/rollouts/test_rollouts_credit_unbiased.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable, Sequence

from ...envs.core.info import CREDIT_STATE
from ..episodes import sampled_length
from ..types import Trajectory
from .advantages import AdvantageConfig, AdvantageEstimator, Credit, OverlongShaping, overlong_penalty

# Turn indices reported in the `credit/` metrics (`credit_metrics`): 0 .. CREDIT_METRIC_TURNS-1.
CREDIT_METRIC_TURNS = 6


def _check_finite(values: Sequence[float], what: str) -> None:
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise ValueError(f"{what} must be finite numbers, got {v!r} at index {i} of {len(values)}")


def turn_rewards(trajectory: Trajectory, overlong: OverlongShaping | None = None) -> list[float]:
    """Each turn's reward: its transition's reward, the overlong penalty (when on) added to the
    last turn's."""
    rewards = [float(t.reward) for t in trajectory.transitions]
    _check_finite(rewards, "turn rewards")
    if overlong is not None and rewards:
        rewards[-1] += overlong_penalty(sampled_length(trajectory), overlong)
    return rewards


def returns_to_go(rewards: Sequence[float], gamma: float = 1.0) -> list[float]:
    """G_t = r_t + gamma * G_{t+1}, G_T = 0: each turn's discounted return-to-go."""
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    _check_finite(rewards, "rewards")
    out = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def turn_returns(
    trajectory: Trajectory, gamma: float = 1.0, overlong: OverlongShaping | None = None
) -> list[float]:
    """The trajectory's per-turn returns-to-go (`turn_rewards`, then `returns_to_go`)."""
    return returns_to_go(turn_rewards(trajectory, overlong), gamma)


def _mean(values: Sequence[float]) -> float:
    # Equal values give that value exactly: a group whose returns agree gets advantage 0, not noise.
    if max(values) == min(values):
        return values[0]
    return math.fsum(values) / len(values)


def _sample_std(values: Sequence[float]) -> float | None:
    """ddof=1, or None where there is nothing to divide by (fewer than two, or all equal)."""
    if len(values) < 2 or max(values) == min(values):
        return None
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def turn_loo_advantages(
    returns: Sequence[Sequence[float]],
    estimator: AdvantageEstimator = AdvantageEstimator.DR_GRPO,
    eps: float = 1e-6,
    states: Sequence[Sequence[Hashable]] | None = None,
) -> list[list[float]]:
    """Per episode, per turn: return-to-go minus the leave-one-out baseline at that turn index
    (the module doc: baseline, fallback, and "grpo"'s division by the turn's std); with
    `states` (one key per turn, `turn_states`), "turn_state"'s baseline first.

    returns: the group's episodes' returns-to-go (`turn_returns`), one list per episode, of any
    lengths (an empty list: an episode without a turn)."""
    for r in returns:
        _check_finite(r, "returns")
    if states is not None and [len(s) for s in states] != [len(r) for r in returns]:
        raise ValueError("turn_loo_advantages: states must give one key per turn of each episode")
    longest = max((len(r) for r in returns), default=0)
    at_turn = [[r[t] for r in returns if len(r) > t] for t in range(longest)]
    scale = [_sample_std(values) if estimator == AdvantageEstimator.GRPO else None for values in at_turn]
    # per episode: each state's first turn's return-to-go
    first_in_state = [_first_returns(r, s) for r, s in zip(returns, states, strict=True)] if states else None
    out: list[list[float]] = []
    for i, own in enumerate(returns):
        others = [r for j, r in enumerate(returns) if j != i]
        last = [r[-1] for r in others if r]
        advantages = []
        for t, g in enumerate(own):
            same = []
            if states is not None and first_in_state is not None:
                key = states[i][t]
                same = [f[key] for j, f in enumerate(first_in_state) if j != i and key in f]
            reached = [r[t] for r in others if len(r) > t]
            baseline = _mean(same) if same else _mean(reached) if reached else _mean(last) if last else 0.0
            a = g - baseline
            std = scale[t]
            advantages.append(a / (std + eps) if std is not None else a)
        out.append(advantages)
    return out


def _first_returns(returns: Sequence[float], states: Sequence[Hashable]) -> dict[Hashable, float]:
    first: dict[Hashable, float] = {}
    for g, key in zip(returns, states, strict=True):
        first.setdefault(key, g)
    return first


def turn_states(trajectory: Trajectory) -> list[Hashable]:
    """A key per turn for "turn_state": where the episode stood before turn t's action. Turn 0:
    the task (one key for the whole group). Turn t > 0: the env's `credit_state` in the info of
    step t-1 where it gives one, else the exact history (each turn's observation and action text
    up to turn t's observation)."""
    keys: list[Hashable] = []
    history: tuple[str, ...] = ()
    for t, transition in enumerate(trajectory.transitions):
        history = (*history, transition.observation)
        if t == 0:
            keys.append(("task",))
        else:
            declared = trajectory.transitions[t - 1].info.get(CREDIT_STATE)
            if declared is None:
                keys.append(("history", *history))
            else:  # a dict state is one key whatever the order of its fields
                keys.append(("env", json.dumps(declared, sort_keys=True)))
        history = (*history, transition.action.text)
    return keys


def group_turn_advantages(group: Sequence[Trajectory], config: AdvantageConfig) -> list[list[float]]:
    """Turn-level advantages of one group's trajectories (all of them members: leave out the
    ones not trained on before calling), by `config`'s credit, gamma, overlong shaping and
    estimator."""
    returns = [turn_returns(t, config.gamma, config.overlong) for t in group]
    states = [turn_states(t) for t in group] if config.credit == Credit.TURN_STATE else None
    return turn_loo_advantages(returns, config.estimator, config.eps, states)


def past_reward_share(rewards: Sequence[Sequence[float]], t: int) -> float | None:
    """Over the episodes that reached turn t, with P the sum of an episode's rewards before t and
    F the sum from t on: Var(P) / (Var(P) + Var(F)), the rewards before t's share of the variance
    of the two parts, in [0, 1] by construction. What turn-level credit can change at t:
    returns-to-go drop only the rewards before t (docs/credit.md, "The bound"). When P and F are
    uncorrelated it is Var(P) / Var(episode reward); when they are correlated that ratio is no
    share (Var(episode reward) = Var(P) + Var(F) + 2 Cov(P, F): negative covariance can make it
    exceed 1) and this one is still in [0, 1].

    None (undefined) where fewer than two episodes reached t or no reward varies (Var(P) =
    Var(F) = 0).

    rewards: per episode, its per-turn rewards (`turn_rewards`)."""
    reached = [r for r in rewards if len(r) > t]
    if len(reached) < 2:
        return None
    past = _variance([math.fsum(r[:t]) for r in reached])
    later = _variance([math.fsum(r[t:]) for r in reached])
    return past / (past + later) if past + later > 0 else None


def _variance(values: Sequence[float]) -> float:
    mean = math.fsum(values) / len(values)
    return math.fsum((v - mean) ** 2 for v in values) / len(values)


def credit_metrics(
    rewards: Sequence[Sequence[float]], gamma: float = 1.0, prefix: str = "credit/"
) -> dict[str, float]:
    """Per turn index t < CREDIT_METRIC_TURNS: `return_turn{t}_mean`, the mean return-to-go
    (discounted by gamma) of the episodes that reached turn t (0 when none did), `reached_turn{t}`,
    the fraction of episodes that did, both every step whatever the episodes' lengths; and
    `past_share_turn{t}`, `past_reward_share` at t, only where it is defined (absent where fewer
    than two episodes reached t or no reward varies).

    rewards: per episode, its per-turn rewards (`turn_rewards`)."""
    returns = [returns_to_go(r, gamma) for r in rewards]
    n = len(returns)
    m: dict[str, float] = {}
    for t in range(CREDIT_METRIC_TURNS):
        values = [r[t] for r in returns if len(r) > t]
        m[f"{prefix}return_turn{t}_mean"] = math.fsum(values) / len(values) if values else 0.0
        m[f"{prefix}reached_turn{t}"] = len(values) / n if n else 0.0
        share = past_reward_share(rewards, t)
        if share is not None:
            m[f"{prefix}past_share_turn{t}"] = share
    return m
