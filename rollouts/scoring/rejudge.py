"""A recording's judged episodes asked again, of another judge, and how far the two agree.

`rejudge(trajectories, judge)` takes a recording's trajectories (a training recording of a run
with `[judge]`: each judged episode's last transition holds `info["judge"][criterion]`, its score
in [0, 1]), asks `judge` (rollouts/scoring/judge.py, the recording's rubric and mode, any
endpoint) about every group the recording holds, contiguous by group id as recorded, and compares
per criterion the new score with the recorded one over the episodes both judged:

- `mean_abs_diff`: mean |new - recorded|;
- `same_verdict`: the share on the same side of 0.5 (both pass or both fail);
- `correlation`: Pearson's r (None when either side is constant).

Nothing is written into the trajectories. A group the new judge fails on (no answer, no score)
is counted in `failed_groups` with its cause, and its episodes are left out of the comparison.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from ..recording.format import JUDGE
from ..types import Trajectory
from .judge import JUDGE_INFO, Judge, JudgeConfig, JudgeStats

VERDICT = 0.5  # a score at or above passes


class CriterionAgreement(msgspec.Struct, kw_only=True):
    """One criterion's scores, recorded against the new judge's (module doc)."""

    criterion: str
    episodes: int
    mean_recorded: float
    mean_new: float
    mean_abs_diff: float
    same_verdict: float
    correlation: float | None


class RejudgeReport(msgspec.Struct, kw_only=True):
    """What `rejudge` found: per criterion agreement, the groups asked and failed (with the
    first causes), and the new judge's requests (`JudgeStats`: calls, cache hits, latency)."""

    criteria: list[CriterionAgreement]
    groups: int
    failed_groups: int
    causes: list[str]
    stats: JudgeStats


def recorded_judge(extra: dict[str, Any]) -> JudgeConfig | None:
    """The judge a recording's header names (`RecordingHeader.extra["judge"]`), None without one;
    ValueError when the entry does not read as a `[judge]` section."""
    entry = extra.get(JUDGE)
    if entry is None:
        return None
    try:
        return msgspec.convert(entry, JudgeConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"the recording's judge entry does not read: {exc}") from None


def _groups(trajectories: Iterable[Trajectory]) -> list[list[Trajectory]]:
    groups: list[list[Trajectory]] = []
    for t in trajectories:
        if groups and groups[-1][0].group_id == t.group_id:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups


def _pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / math.sqrt(sxx * syy)


def rejudge(trajectories: Iterable[Trajectory], judge: Judge, max_causes: int = 5) -> RejudgeReport:
    """Ask `judge` again about every recorded group and compare (module doc)."""
    pairs: dict[str, list[tuple[float, float]]] = {c.name: [] for c in judge.config.criteria}
    stats, groups, failed, causes = JudgeStats(), 0, 0, []
    for group in _groups(trajectories):
        groups += 1
        try:
            results = judge.judge(group, stats)
        except Exception as exc:  # the new judge's failure: this group is left out, counted
            failed += 1
            if len(causes) < max_causes:
                causes.append(
                    f"group {group[0].group_id}: {' '.join(f'{type(exc).__name__}: {exc}'.split())}"
                )
            continue
        for i, by_criterion in results.items():
            recorded = group[i].transitions[-1].info.get(JUDGE_INFO)
            if not isinstance(recorded, dict):
                continue  # not judged when recorded (an infrastructure failure then)
            for name, entry in by_criterion.items():
                old = recorded.get(name)
                if isinstance(old, dict) and isinstance(old.get("score"), int | float) and name in pairs:
                    pairs[name].append((float(old["score"]), float(entry["score"])))
    agreements = []
    for name, scored in pairs.items():
        n = len(scored)
        olds, news = [o for o, _ in scored], [x for _, x in scored]
        agreements.append(
            CriterionAgreement(
                criterion=name,
                episodes=n,
                mean_recorded=sum(olds) / n if n else math.nan,
                mean_new=sum(news) / n if n else math.nan,
                mean_abs_diff=sum(abs(o - x) for o, x in scored) / n if n else math.nan,
                same_verdict=sum((o >= VERDICT) == (x >= VERDICT) for o, x in scored) / n if n else math.nan,
                correlation=_pearson(olds, news),
            )
        )
    return RejudgeReport(criteria=agreements, groups=groups, failed_groups=failed, causes=causes, stats=stats)


__all__ = ["CriterionAgreement", "RejudgeReport", "recorded_judge", "rejudge"]
