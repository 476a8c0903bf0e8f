"""Per-episode and per-batch rollout metrics (plain dicts of floats, for the console and JSONL).

Definitions (from the env's final info; see envs/):
- correct: the graded answer was right, tagged or not (reward component "correct" > 0).
- tagged: the final answer carried the `[ANSWER]` tag (reward component "format" > 0).
- tool_calls / env_errors / failure_mode: from the LAST transition whose info reports each. The
  last transition's info may lack them: a turn cut by a token limit was never given to the env
  (info {}, unless the env settled the episode through `abandon()`, whose info has them), and a
  step the env raised on has only {"error": ...}; the earlier turns' counts still hold.
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from .types import StopReason, Trajectory


def is_correct(components: Mapping[str, float]) -> bool:
    return float(components.get("correct", 0.0)) > 0.0


def is_tagged(components: Mapping[str, float]) -> bool:
    return float(components.get("format", 0.0)) > 0.0


def _last_reported(trajectory: Trajectory, key: str, kind: type | tuple[type, ...]) -> Any:
    """The value of info[key] in the last transition that reports one of `kind` (else None)."""
    for transition in reversed(trajectory.transitions):
        value = transition.info.get(key)
        if isinstance(value, kind) and not isinstance(value, bool):
            return value
    return None


def episode_metrics(
    trajectory: Trajectory, wall_s: float, generate_s: float, env_s: float = 0.0
) -> dict[str, Any]:
    """What goes into Trajectory.metrics (JSON-serialisable)."""
    return {
        "turns": len(trajectory.transitions),
        "tool_calls": int(_last_reported(trajectory, "tool_calls", numbers.Integral) or 0),
        # malformed/unknown calls the env saw (not env_error episodes: see `errors` in batch_metrics)
        "env_errors": int(_last_reported(trajectory, "errors", numbers.Integral) or 0),
        "failure_mode": _last_reported(trajectory, "failure_mode", str),
        "correct": is_correct(trajectory.reward_components),
        "tagged": is_tagged(trajectory.reward_components),
        "sampled_tokens": sum(len(t.action.tokens) for t in trajectory.transitions),
        "context_tokens": sum(
            len(t.observation_tokens) + len(t.action.tokens) for t in trajectory.transitions
        ),
        "wall_s": wall_s,
        "generate_s": generate_s,  # awaiting the policy (includes waiting for other episodes' batches)
        "env_s": env_s,  # env reset/step + chat rendering (the runner's own work)
    }


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def batch_metrics(
    trajectories: Sequence[Trajectory], elapsed_s: float | None = None, prefix: str = "rollout/"
) -> dict[str, float]:
    """Aggregate metrics for a batch: means, fractions per failure mode / stop reason, counts."""
    n = len(trajectories)
    m: dict[str, float] = {"episodes": float(n)}
    if n == 0:
        return {prefix + k: v for k, v in m.items()}
    metrics = [t.metrics for t in trajectories]
    m["reward_mean"] = _mean([t.total_reward for t in trajectories])
    m["accuracy"] = _mean([float(x.get("correct", False)) for x in metrics])
    m["tag_rate"] = _mean([float(x.get("tagged", False)) for x in metrics])
    m["turns_mean"] = _mean([float(x.get("turns", 0)) for x in metrics])
    m["tool_calls_mean"] = _mean([float(x.get("tool_calls", 0)) for x in metrics])
    m["env_errors_mean"] = _mean([float(x.get("env_errors", 0)) for x in metrics])
    tokens = sum(int(x.get("sampled_tokens", 0)) for x in metrics)
    m["tokens_generated"] = float(tokens)
    m["tokens_per_episode"] = tokens / n
    for mode, count in Counter(str(x.get("failure_mode")) for x in metrics).items():
        m[f"failure_mode/{mode}"] = count / n
    for reason in StopReason:
        m[f"stop_reason/{reason.value}"] = sum(t.stop_reason == reason for t in trajectories) / n
    errors = [t for t in trajectories if t.error is not None]
    m["errors"] = float(len(errors))
    for kind, count in Counter(_error_kind(t) for t in errors).items():
        m[f"errors/{kind}"] = float(count)
    if elapsed_s is not None:
        m["time_s"] = elapsed_s
        m["episodes_per_s"] = n / elapsed_s if elapsed_s > 0 else 0.0
        m["tokens_per_s"] = tokens / elapsed_s if elapsed_s > 0 else 0.0
    return {prefix + k: v for k, v in m.items()}


def _error_kind(trajectory: Trajectory) -> str:
    """`env_error:ValueError`, `timeout:TimeoutError`, ...: the stop reason and exception type."""
    text = trajectory.error or ""
    kind = text.split(":", 1)[0].strip() if ":" in text else "unknown"
    return f"{trajectory.stop_reason.value}:{kind}"
