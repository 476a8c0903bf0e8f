"""Evaluation on the fixed held-out task seeds (`sampling.eval_seeds`: [0, n), never used for
training, whose seeds start at 2**31). Greedy by default, one sample per task.

Reports the batch metrics under `eval/` (rollouts/metrics.py: reward, turns, every metric the env
reports, e.g. `eval/accuracy`, the failure-mode and stop-reason breakdowns) and a few example
transcripts, one per distinct failure mode first so that the examples show different behaviours. Usable from
a training loop every N steps (`evaluate` is async; `evaluate_sync` starts its own loop).

Memory is bounded: the summary is computed as the episodes stream by (`BatchMetrics`), at most
`rollout.max_concurrent_episodes` (default `EVAL_WINDOW`) episodes are in flight, and only the
few example candidates are kept, unless the caller asks for every trajectory
(`keep_trajectories`) or takes each one as it finishes (`on_episode`, e.g. a recorder).
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable

import msgspec

from ..agents.chat import Renderer
from ..agents.policy import Policy
from .batches import eval_seeds
from .episode.config import EnvRolloutConfig
from .episode.runner import RolloutRunner
from .metrics import BatchMetrics
from .recording.replay import format_transcript
from .types import Trajectory

# Episodes in flight at once when the rollout config sets no max_concurrent_episodes: enough to
# fill the engine's batches, few enough that a long eval's memory does not grow with its length.
EVAL_WINDOW = 512


class EvalConfig(msgspec.Struct, frozen=True, kw_only=True):
    num_tasks: int = 64
    greedy: bool = True  # temperature 0; otherwise the rollout config's sampling settings
    samples_per_task: int = 1  # only when not greedy (greedy samples would be identical)
    num_examples: int = 3

    def __post_init__(self) -> None:
        for name, least in (("num_tasks", 1), ("samples_per_task", 1), ("num_examples", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"EvalConfig.{name} must be >= {least}, got {getattr(self, name)}")


class EvalReport(msgspec.Struct):
    metrics: dict[str, float]
    examples: list[str]  # plain-text transcripts (sampled spans between ⟦ ⟧)
    trajectories: list[Trajectory]  # group-major; [] unless evaluate(keep_trajectories=True)


def pick_examples(trajectories: list[Trajectory], n: int) -> list[Trajectory]:
    """Up to n trajectories: the first of each failure mode, then the rest in order."""
    first_of_mode: dict[object, Trajectory] = {}
    for t in trajectories:
        first_of_mode.setdefault(t.metrics.get("failure_mode") or t.stop_reason.value, t)
    picked = list(first_of_mode.values())[:n]
    picked += [t for t in trajectories if all(t is not p for p in picked)][: n - len(picked)]
    return picked


class ExampleCandidates:
    """The trajectories `pick_examples(all, n)` can pick, kept as they stream by in any order
    (each with its index in the group-major order): per failure mode its first one (for the n
    modes seen first), and the 2n first overall. At most 3n are held."""

    def __init__(self, n: int):
        self.n = n
        self.first_of_mode: dict[object, tuple[int, Trajectory]] = {}
        self.first: list[tuple[int, Trajectory]] = []  # a max-heap on the index (negated)

    def add(self, index: int, trajectory: Trajectory) -> None:
        if self.n == 0:
            return
        mode = trajectory.metrics.get("failure_mode") or trajectory.stop_reason.value
        held = self.first_of_mode.get(mode)
        if held is None or index < held[0]:
            self.first_of_mode[mode] = (index, trajectory)
            if len(self.first_of_mode) > self.n:
                del self.first_of_mode[max(self.first_of_mode, key=lambda m: self.first_of_mode[m][0])]
        heapq.heappush(self.first, (-index, trajectory))  # indices are unique: no Trajectory compare
        if len(self.first) > 2 * self.n:
            heapq.heappop(self.first)

    def pick(self) -> list[Trajectory]:
        held = dict(self.first_of_mode.values()) | {-i: t for i, t in self.first}
        return pick_examples([held[i] for i in sorted(held)], self.n)


def eval_rollout(rollout: EnvRolloutConfig, config: EvalConfig) -> EnvRolloutConfig:
    """The run's rollout settings as the eval samples: greedy (one sample a task) or
    `samples_per_task` at the run's sampling, and never guided (the policy plays every episode)."""
    if config.greedy:
        greedy = msgspec.structs.replace(rollout.sampling, temperature=0.0)
        return msgspec.structs.replace(rollout, sampling=greedy, group_size=1, guided_samples=0)
    return msgspec.structs.replace(rollout, group_size=config.samples_per_task, guided_samples=0)


async def evaluate(
    policy: Policy,
    renderer: Renderer,
    rollout: EnvRolloutConfig,
    config: EvalConfig | None = None,
    keep_trajectories: bool = True,
    on_episode: Callable[[Trajectory], None] | None = None,
) -> EvalReport:
    """Run the eval episodes and summarise them as they finish. `keep_trajectories=False` keeps
    none (the report's list is empty): memory stays flat however many episodes run; `on_episode`
    sees each one as it finishes (to record it)."""
    config = config or EvalConfig()
    rollout = eval_rollout(rollout, config)
    started = time.perf_counter()
    runner = RolloutRunner(policy, renderer, rollout)
    summary, candidates = BatchMetrics(), ExampleCandidates(config.num_examples)
    kept: dict[int, Trajectory] = {}
    jobs = enumerate((seed, s) for seed in eval_seeds(config.num_tasks) for s in range(rollout.group_size))

    async def worker() -> None:
        for index, (seed, sample) in jobs:  # shared: each job is taken by one worker
            trajectory = await runner.run_episode(seed, seed, sample)
            summary.add(trajectory)
            candidates.add(index, trajectory)
            if keep_trajectories:
                kept[index] = trajectory
            if on_episode is not None:
                on_episode(trajectory)

    total = config.num_tasks * rollout.group_size
    window = min(total, rollout.max_concurrent_episodes or EVAL_WINDOW)
    await asyncio.gather(*(worker() for _ in range(window)))
    metrics = summary.result(time.perf_counter() - started, prefix="eval/")
    examples = [format_transcript(t, renderer) for t in candidates.pick()]
    return EvalReport(metrics=metrics, examples=examples, trajectories=[kept[i] for i in sorted(kept)])


def evaluate_sync(
    policy: Policy,
    renderer: Renderer,
    rollout: EnvRolloutConfig,
    config: EvalConfig | None = None,
    keep_trajectories: bool = True,
    on_episode: Callable[[Trajectory], None] | None = None,
) -> EvalReport:
    return asyncio.run(evaluate(policy, renderer, rollout, config, keep_trajectories, on_episode))
