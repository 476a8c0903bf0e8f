"""Per-episode and per-batch rollout metrics (plain dicts, for the console and JSONL).

The runner measures each episode itself (turns, tokens, time) and takes the env's own metrics
from its infos (the contract is envs/core/info.py): per name, the last value reported in the
episode's transitions, kept in `Trajectory.metrics["env"]`. A transition's info may lack them: a
turn cut by a token limit was never given to the env (info {}, unless the env settled the
episode through `abandon()`, whose info has them), and a step the env raised on has only
{"error": ...}; the earlier turns' values still hold. `failure_mode` (an optional label from the
env) is taken the same way. Nothing here knows any particular env.

Batch metrics (`batch_metrics`, under a prefix: `rollout/`, `eval/`): the runner's own
(`RUNNER_METRICS` and the `failure_mode/`, `stop_reason/`, `errors/` breakdowns); for every
name any episode's env reported, its mean over the batch's episodes (0 for an episode that
reported none); for every metric group an episode reported (info `metric_group`), each env
metric's mean over that group's episodes as `by_group/<group>/<name>`, and their count
(`by_group/<group>/episodes`); and for every reward component name (`Trajectory.reward_components`), its mean
over the batch's episodes as `reward/<name>` (0 for an episode that reported none, or whose
value is not a finite number, as a recording read back may hold). A component no episode of the
batch reported is absent from it; over a run, `RewardComponentSeries` (used by the run's metrics
log, trainers/metrics_log.py, once per kind of record) adds it back as 0.0 once the run has seen
it, so every step's record has every component.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..envs.core.info import FAILURE_MODE, METRIC_GROUP, METRICS
from .types import StopReason, Trajectory

# The names batch_metrics writes itself; an env's metric may not take one of them.
RUNNER_METRICS = frozenset(
    {
        "episodes",
        "reward_mean",
        "turns_mean",
        "tokens_generated",
        "tokens_per_episode",
        "errors",
        "time_s",
        "episodes_per_s",
        "tokens_per_s",
        "policy_version",  # the training loop's eval/policy_version
        "sequence_restarts",
        "context_rewrites",
    }
)
# New training sequences an episode started after its first: a chat template's restarts
# (agents/chat_template.py) plus its context policy's rewrites (rollouts/context.py). In
# Trajectory.metrics and, summed over the batch, in its summary, only where a restart can happen
# (never for plain ChatML that keeps everything).
SEQUENCE_RESTARTS = "sequence_restarts"
# A context policy's rewrites alone: only for episodes whose policy can rewrite.
CONTEXT_REWRITES = "context_rewrites"
# Breakdown prefixes: `failure_mode/<label>`, `stop_reason/<reason>`, `errors/<kind>`.
_BREAKDOWNS = ("failure_mode/", "stop_reason/", "errors/")
# Reward components' means: `reward/<component name>`.
REWARD_COMPONENT_PREFIX = "reward/"
# Env metrics' means over the episodes of one metric group (info `metric_group`, envs/core/info.py):
# `by_group/<group>/<name>`, and the group's episode count `by_group/<group>/episodes`.
GROUP_PREFIX = "by_group/"


def metric_name_problem(name: Any) -> str | None:
    """Why `name` cannot be an env metric's name (None when it can)."""
    if not isinstance(name, str) or not name or "/" in name:
        return f"env metric names are non-empty strings without '/', got {name!r}"
    if name in RUNNER_METRICS:
        return f"env metric name {name!r} is one the runner reports itself ({', '.join(sorted(RUNNER_METRICS))})"
    return None


def component_name_problem(name: Any) -> str | None:
    """Why `name` cannot be a reward component's name (None when it can): it becomes part of a
    metric key (`rollout/reward/<name>`), a TensorBoard tag and a plot label, so it is a
    non-empty printable string without '/'."""
    if not isinstance(name, str) or not name or "/" in name or not name.isprintable():
        return f"reward component names are non-empty printable strings without '/', got {name!r:.80}"
    return None


def reward_component_names(metrics: Mapping[str, Any], prefix: str) -> list[str]:
    """The reward component names among batch metrics under `prefix` (`rollout/reward/correct`
    -> `correct`), in their order."""
    start = prefix + REWARD_COMPONENT_PREFIX
    return [key.removeprefix(start) for key in metrics if key.startswith(start)]


def env_metric_names(metrics: Mapping[str, Any], prefix: str) -> list[str]:
    """The env-reported names among batch metrics under `prefix` (`rollout/accuracy` ->
    `accuracy`), in their order: what is left after the runner's own names and breakdowns."""
    names = []
    for key in metrics:
        if key.startswith(prefix):
            name = key.removeprefix(prefix)
            if "/" not in name and name not in RUNNER_METRICS:
                names.append(name)
    return names


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    return None


def _last_env_metrics(trajectory: Trajectory) -> dict[str, float]:
    """Per name, the last usable value among the transitions' info["metrics"]."""
    found: dict[str, float] = {}
    for transition in trajectory.transitions:
        reported = transition.info.get(METRICS)
        if isinstance(reported, Mapping):
            for name, value in reported.items():
                number = _number(value)
                if number is not None and metric_name_problem(name) is None:
                    found[name] = number
    return found


def _last_label(trajectory: Trajectory, key: str) -> str | None:
    for transition in reversed(trajectory.transitions):
        value = transition.info.get(key)
        if isinstance(value, str):
            return value
    return None


def episode_metrics(
    trajectory: Trajectory, wall_s: float, generate_s: float, env_s: float = 0.0
) -> dict[str, Any]:
    """What goes into Trajectory.metrics (JSON-serialisable): the runner's measurements,
    `failure_mode`, the env's metric group where it reports one, and the env's metrics under "env"."""
    group = _last_label(trajectory, METRIC_GROUP)
    return {
        **({METRIC_GROUP: group} if group is not None else {}),  # only an env that groups its episodes
        "turns": len(trajectory.transitions),
        "failure_mode": _last_label(trajectory, FAILURE_MODE),
        "sampled_tokens": sum(len(t.action.tokens) for t in trajectory.transitions),
        "context_tokens": sum(
            len(t.observation_tokens) + len(t.action.tokens) for t in trajectory.transitions
        ),
        "wall_s": wall_s,
        "generate_s": generate_s,  # awaiting the policy (includes waiting for other episodes' batches)
        "env_s": env_s,  # env reset/step + chat rendering (the runner's own work)
        "env": _last_env_metrics(trajectory),
    }


class BatchMetrics:
    """`batch_metrics` computed as the episodes stream by: `add` each trajectory, then `result`.
    Keeps sums and counts only (no trajectory), so a long eval's memory does not grow with its
    episodes; the result is the same dict `batch_metrics` returns for the same episodes in the
    same order."""

    def __init__(self) -> None:
        self.n = 0
        self.reward_sum = 0.0
        self.env_sums: dict[str, float] = {}  # names in the order first seen
        self.component_sums: dict[str, float] = {}  # likewise, per reward component
        self.turns_sum = 0.0
        self.tokens = 0
        self.failure_modes: Counter[str] = Counter()
        self.stop_reasons: Counter[StopReason] = Counter()
        self.errors: Counter[str] = Counter()
        self.restarts: int | None = None  # None: no episode came from a renderer that restarts
        self.rewrites: int | None = None  # None: no episode had a context policy that rewrites
        self.groups: dict[str, list[Any]] = {}  # metric group -> [episodes, {name: sum}]

    def add(self, trajectory: Trajectory) -> None:
        x = trajectory.metrics
        self.n += 1
        self.reward_sum += trajectory.total_reward
        env = x["env"] if isinstance(x.get("env"), Mapping) else {}
        for name in _names_in_order([env]):
            self.env_sums[name] = self.env_sums.get(name, 0.0) + (_number(env.get(name)) or 0.0)
        group = x.get(METRIC_GROUP)
        if isinstance(group, str) and group and "/" not in group and group.isprintable():
            count_sums = self.groups.setdefault(group, [0, {}])
            count_sums[0] += 1
            for name in _names_in_order([env]):
                count_sums[1][name] = count_sums[1].get(name, 0.0) + (_number(env.get(name)) or 0.0)
        for name, value in _components(trajectory).items():
            self.component_sums[name] = self.component_sums.get(name, 0.0) + value
        self.turns_sum += float(x.get("turns", 0))
        self.tokens += int(x.get("sampled_tokens", 0))
        self.failure_modes[str(x.get("failure_mode"))] += 1
        self.stop_reasons[trajectory.stop_reason] += 1
        if trajectory.error is not None:
            self.errors[_error_kind(trajectory)] += 1
        if SEQUENCE_RESTARTS in x:
            self.restarts = (self.restarts or 0) + int(_number(x[SEQUENCE_RESTARTS]) or 0)
        if CONTEXT_REWRITES in x:
            self.rewrites = (self.rewrites or 0) + int(_number(x[CONTEXT_REWRITES]) or 0)

    def result(self, elapsed_s: float | None = None, prefix: str = "rollout/") -> dict[str, float]:
        n = self.n
        m: dict[str, float] = {"episodes": float(n)}
        if n == 0:
            return {prefix + k: v for k, v in m.items()}
        m["reward_mean"] = self.reward_sum / n
        for name, total in self.component_sums.items():
            m[REWARD_COMPONENT_PREFIX + name] = total / n
        for name, total in self.env_sums.items():
            m[name] = total / n
        m["turns_mean"] = self.turns_sum / n
        m["tokens_generated"] = float(self.tokens)
        m["tokens_per_episode"] = self.tokens / n
        for mode, count in self.failure_modes.items():
            m[f"failure_mode/{mode}"] = count / n
        for reason in StopReason:
            m[f"stop_reason/{reason.value}"] = self.stop_reasons[reason] / n
        m["errors"] = float(self.errors.total())
        for kind, count in self.errors.items():
            m[f"errors/{kind}"] = float(count)
        for group, (count, sums) in self.groups.items():
            m[f"{GROUP_PREFIX}{group}/episodes"] = float(count)
            for name in self.env_sums:  # a name the group's episodes never reported is 0 there
                m[f"{GROUP_PREFIX}{group}/{name}"] = sums.get(name, 0.0) / count
        if self.restarts is not None:
            m[SEQUENCE_RESTARTS] = float(self.restarts)
        if self.rewrites is not None:
            m[CONTEXT_REWRITES] = float(self.rewrites)
        if elapsed_s is not None:
            m["time_s"] = elapsed_s
            m["episodes_per_s"] = n / elapsed_s if elapsed_s > 0 else 0.0
            m["tokens_per_s"] = self.tokens / elapsed_s if elapsed_s > 0 else 0.0
        return {prefix + k: v for k, v in m.items()}


class RewardComponentSeries:
    """The reward components one metrics source (a run's training steps, or its evals) has
    reported so far, so that each of its records has every one of them: a component no episode
    of a batch earned is absent from that batch's `batch_metrics` (the mean is over the names the
    episodes reported), and `fill` puts it back at 0.0, the mean it has when every episode counts
    it as 0. A series of records then has no gaps (plots and TensorBoard draw each key as a line).
    A record without means under a prefix (no `<prefix>reward_mean`: a batch without episodes)
    gets none of that prefix's components. Keys are `<prefix>reward/<name>` (`reward/` after a
    one-word prefix); nothing else in a record changes."""

    def __init__(self) -> None:
        self._keys: dict[str, None] = {}  # in the order first seen

    def fill(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """`metrics` with 0.0 for every component key seen in this series before and missing
        here; the keys it holds are remembered for the next records."""
        self._keys.update(dict.fromkeys(k for k in metrics if _component_prefix(k) is not None))
        out = dict(metrics)
        for key in self._keys:
            prefix = _component_prefix(key)
            if key not in out and f"{prefix}reward_mean" in out:
                out[key] = 0.0
        return out


def _component_prefix(key: str) -> str | None:
    """`rollout/` for `rollout/reward/correct`; None for a key that is not a reward component's."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] and parts[1] + "/" == REWARD_COMPONENT_PREFIX and parts[2]:
        return parts[0] + "/"
    return None


def _components(trajectory: Trajectory) -> dict[str, float]:
    """A trajectory's reward components with usable names (`component_name_problem`), each a
    number (0 for a value that is not a finite number, as a recording read back may hold)."""
    components = trajectory.reward_components
    items = components.items() if isinstance(components, Mapping) else ()
    return {name: _number(value) or 0.0 for name, value in items if component_name_problem(name) is None}


def component_variation(groups: Iterable[Sequence[Trajectory]]) -> dict[str, float]:
    """Which reward components carry a batch's group signal: per component name, the share of the
    groups in which its value differs between members (`batch/varies/<name>`), and in which it is
    the only one that differs (`batch/varies_only/<name>`; a component an episode lacks counts as
    0). A group where a small cost (a penalty per invalid command) is all that differs still has
    whole-sized advantages under GRPO's division by the group's std."""
    counts: dict[str, list[int]] = {}  # name -> [groups where it varies, where only it varies]
    n = 0
    for group in groups:
        n += 1
        rows = [_components(t) for t in group]
        names = dict.fromkeys(name for row in rows for name in row)
        varying = [name for name in names if len({row.get(name, 0.0) for row in rows}) > 1]
        for name in names:
            counts.setdefault(name, [0, 0])
        for name in varying:
            counts[name][0] += 1
            counts[name][1] += len(varying) == 1
    out: dict[str, float] = {}
    for name, (varies, only) in counts.items():
        out[f"batch/varies/{name}"] = varies / n
        out[f"batch/varies_only/{name}"] = only / n
    return out


def batch_metrics(
    trajectories: Iterable[Trajectory], elapsed_s: float | None = None, prefix: str = "rollout/"
) -> dict[str, float]:
    """Aggregate metrics for a batch (see the module doc): means (reward, its components, the
    env's metrics, turns), fractions per failure mode / stop reason, counts."""
    summary = BatchMetrics()
    for trajectory in trajectories:
        summary.add(trajectory)
    return summary.result(elapsed_s, prefix)


def _names_in_order(dicts: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every usable env metric name, in the order first seen."""
    names: dict[str, None] = {}
    for d in dicts:
        for name in d:
            if metric_name_problem(name) is None:
                names.setdefault(name, None)
    return list(names)


def _error_kind(trajectory: Trajectory) -> str:
    """`env_error:ValueError`, `timeout:TimeoutError`, ...: the stop reason and exception type."""
    text = trajectory.error or ""
    kind = text.split(":", 1)[0].strip() if ":" in text else "unknown"
    return f"{trajectory.stop_reason.value}:{kind}"
