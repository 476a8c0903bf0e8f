"""Evaluation on the fixed held-out task seeds (`sampling.eval_seeds`: [0, n), never used for
training, whose seeds start at 2**31). Greedy by default, one sample per task.

Reports the batch metrics under `eval/` (rollouts/metrics.py: reward, turns, every metric the env
reports, e.g. `eval/accuracy`, the failure-mode and stop-reason breakdowns) and a few example
transcripts, one per distinct failure mode first so that the examples show different behaviours. Usable from
a training loop every N steps (`evaluate` is async; `evaluate_sync` starts its own loop).
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from ..agents.chat import ChatRenderer
from ..agents.policy import Policy
from .metrics import batch_metrics
from .replay import format_transcript
from .runner import RolloutConfig, RolloutRunner
from .sampling import eval_seeds
from .types import Trajectory


class EvalConfig(msgspec.Struct, frozen=True, kw_only=True):
    num_tasks: int = 64
    greedy: bool = True  # temperature 0; otherwise the rollout config's sampling settings
    samples_per_task: int = 1  # only when not greedy (greedy samples would be identical)
    num_examples: int = 3

    def __post_init__(self) -> None:
        if self.num_tasks < 1 or self.samples_per_task < 1 or self.num_examples < 0:
            raise ValueError(f"bad EvalConfig: {self}")


class EvalReport(msgspec.Struct):
    metrics: dict[str, float]
    examples: list[str]  # plain-text transcripts (sampled spans between ⟦ ⟧)
    trajectories: list[Trajectory]


def pick_examples(trajectories: list[Trajectory], n: int) -> list[Trajectory]:
    """Up to n trajectories: the first of each failure mode, then the rest in order."""
    first_of_mode: dict[object, Trajectory] = {}
    for t in trajectories:
        first_of_mode.setdefault(t.metrics.get("failure_mode") or t.stop_reason.value, t)
    picked = list(first_of_mode.values())[:n]
    picked += [t for t in trajectories if all(t is not p for p in picked)][: n - len(picked)]
    return picked


async def evaluate(
    policy: Policy, renderer: ChatRenderer, rollout: RolloutConfig, config: EvalConfig | None = None
) -> EvalReport:
    config = config or EvalConfig()
    if config.greedy:
        greedy = msgspec.structs.replace(rollout.sampling, temperature=0.0)
        rollout = msgspec.structs.replace(rollout, sampling=greedy, group_size=1)
    else:
        rollout = msgspec.structs.replace(rollout, group_size=config.samples_per_task)
    started = time.perf_counter()
    seeds = eval_seeds(config.num_tasks)
    trajectories = await RolloutRunner(policy, renderer, rollout).run_groups(seeds, group_ids=seeds)
    metrics = batch_metrics(trajectories, time.perf_counter() - started, prefix="eval/")
    examples = [format_transcript(t, renderer) for t in pick_examples(trajectories, config.num_examples)]
    return EvalReport(metrics=metrics, examples=examples, trajectories=trajectories)


def evaluate_sync(
    policy: Policy, renderer: ChatRenderer, rollout: RolloutConfig, config: EvalConfig | None = None
) -> EvalReport:
    return asyncio.run(evaluate(policy, renderer, rollout, config))
