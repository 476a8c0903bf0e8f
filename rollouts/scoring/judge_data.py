"""Training data for a judge model: an env's episodes, labelled by the env's own grader, asked as
the judge is asked.

    labelled_episodes(env_id, ...)   episodes of a noisy oracle (OracleConfig: omitted answer tags,
                                     malformed calls, wrong lookups, guesses, ...), each with the
                                     grader's label: the env's `success` metric (1 or 0)
    judge_examples(episodes, criterion)
                                     one chat-messages row each: episode mode's question for the
                                     criterion (judge.py `episode_question`, word for word what
                                     the judge sends) and the answer {"score": label}
    judge_group_examples(episodes, criterion, group_size)
                                     one row per group of that many episodes: group mode's
                                     question (judge.py `group_question`), the episodes in a
                                     random order, and the answer {"scores": [labels as shown]}

`toolgym judge-data` writes them as chat-messages JSONL; `toolgym import` makes that a recording
to SFT a model on (configs/judge_zorplex_tiny.toml), and `toolgym serve` of the result is a judge
for `[judge]`. The same labelled episodes of other seeds measure a judge against the grader
(`verdicts`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from ...agents.chat import Renderer
from ..episode.config import EnvRolloutConfig
from ..episode.runner import RolloutRunner
from ..scripted import OracleConfig, OraclePolicy
from ..types import Trajectory
from .judge import episode_question, grader_label, group_question


class Labelled(msgspec.Struct):
    """An episode and the grader's verdict on it (1: the env counted it a success)."""

    trajectory: Trajectory
    label: int


def labelled_episodes(
    env_id: str,
    env_kwargs: Mapping[str, Any],
    seeds: Sequence[int],
    renderer: Renderer,
    oracle: OracleConfig,
    max_turns: int = 8,
) -> list[Labelled]:
    """One noisy-oracle episode per seed, with the grader's label (episodes whose env reported
    no `success` left out)."""
    config = EnvRolloutConfig(env_id=env_id, env_kwargs=dict(env_kwargs), group_size=1, max_turns=max_turns)
    runner = RolloutRunner(OraclePolicy(renderer, oracle), renderer, config)
    return labelled(runner.run(list(seeds)))


def labelled(trajectories: Iterable[Trajectory]) -> list[Labelled]:
    """The trajectories with the grader's label, those that ended in an error or whose env
    reported no `success` left out."""
    return [
        Labelled(t, label) for t in trajectories if t.error is None and (label := grader_label(t)) is not None
    ]


def judge_examples(
    episodes: Sequence[Labelled], criterion: str, max_chars: int = 20000, final_reply: bool = False
) -> list[dict[str, Any]]:
    """Chat-messages rows: the judge's question about each episode (by default without the env's
    last reply, which may be its verdict: a judge run with `final_reply = false`) and the
    grader's answer."""
    return [
        {
            "messages": [
                *episode_question(criterion, e.trajectory, max_chars, final_reply),
                {"role": "assistant", "content": msgspec.json.encode({"score": e.label}).decode()},
            ]
        }
        for e in episodes
    ]


def judge_group_examples(
    episodes: Sequence[Labelled],
    criterion: str,
    group_size: int,
    max_chars: int = 20000,
    final_reply: bool = False,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Chat-messages rows for a ranking judge (judge mode "group"): the episodes shuffled (by
    `seed`) into groups of `group_size` (a last, smaller group kept), each asked as group mode
    asks, with the grader's labels in the order shown as the answer. Every position of the
    shown order holds passes and failures alike, so a judge trained on them learns no position."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    order = list(range(len(episodes)))
    random.Random(seed).shuffle(order)
    rows = []
    for start in range(0, len(order), group_size):
        shown = [episodes[i] for i in order[start : start + group_size]]
        answer = msgspec.json.encode({"scores": [e.label for e in shown]}).decode()
        question = group_question(criterion, [e.trajectory for e in shown], max_chars, final_reply)
        rows.append({"messages": [*question, {"role": "assistant", "content": answer}]})
    return rows


__all__ = ["Labelled", "judge_examples", "judge_group_examples", "labelled", "labelled_episodes"]
