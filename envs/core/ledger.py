"""The reward ledger: the one place a `ToolEnv` turns grades, per-step awards and penalties into
the reward and its named parts (as verifiers' Rubric keeps a reward with its components).

Every addition lands in a named component AND in the reward of the step it happens at, so the
sum of an episode's step rewards equals the sum of its components (info `reward_components`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final, Protocol

from .grading import Grade

BUILTIN_COMPONENTS: Final = ("correct", "format", "tool_penalty", "error_penalty")


class RewardKnobs(Protocol):
    """The reward settings the ledger reads (a `ToolEnv`'s knobs), at the moment each is used."""

    correct_reward: float
    format_reward: float
    incorrect_reward: float
    tool_call_penalty: float
    error_penalty: float


class RewardLedger:
    """One episode's named reward components and the reward of its current step.

    The builtin components (correct, format, tool_penalty, error_penalty) start at 0; names from
    elsewhere (tool awards, a grade's components, `final_reward()`) are added as they come and
    may not reuse a builtin name. `start_step()` begins a step at 0; `take_step()` returns its reward.
    """

    def __init__(self, knobs: RewardKnobs) -> None:
        self._knobs = knobs
        self._parts: dict[str, float] = dict.fromkeys(BUILTIN_COMPONENTS, 0.0)
        self._step = 0.0

    @property
    def parts(self) -> dict[str, float]:
        """A copy of the components so far (info `reward_components`)."""
        return dict(self._parts)

    def start_step(self) -> None:
        """Start a step at 0 (dropping what a step that raised left behind)."""
        self._step = 0.0

    def take_step(self) -> float:
        """The reward of the step so far; the next step starts at 0."""
        reward, self._step = self._step, 0.0
        return reward

    # ---- per step --------------------------------------------------------------------------

    def error(self) -> None:
        """One error: `-error_penalty`."""
        self._penalize("error_penalty", self._knobs.error_penalty)

    def extra_tool_call(self) -> None:
        """One tool call beyond the task's needed_tool_calls: `-tool_call_penalty`."""
        self._penalize("tool_penalty", self._knobs.tool_call_penalty)

    def award(self, rewards: Mapping[str, Any], who: str) -> None:
        """A tool's named awards (`ToolResult.rewards`); `who` names the tool in errors."""
        for name, value in rewards.items():
            if name in BUILTIN_COMPONENTS:
                raise ValueError(f"{who}: reward name {name!r} is one of the env's own components")
            self._parts[name] = self._parts.get(name, 0.0) + float(value)
            self._step += float(value)

    # ---- when the episode ends ---------------------------------------------------------------

    def answered(self, grade: Grade, tagged: bool) -> None:
        """A graded answer: `correct_reward * score` (`incorrect_reward` for a wrong one stated
        outside the answer format), `format_reward` if in the format, and the grade's components."""
        knobs = self._knobs
        if grade.score > 0:
            self._add("correct", knobs.correct_reward * grade.score)
        elif not tagged:
            self._add("correct", knobs.incorrect_reward)
        if tagged:
            self._add("format", knobs.format_reward)
        self._step += self._named(grade.components, "the grade")

    def settle(self, answered: bool, final: Mapping[str, float], who: str) -> None:
        """The end of the episode: `incorrect_reward` when it ended unanswered, then the
        final-state components `final` (from `who`), both in the ending step's reward."""
        reward = 0.0
        if not answered:
            self._parts["correct"] += self._knobs.incorrect_reward
            reward += self._knobs.incorrect_reward
        reward += self._named(final, who)
        self._step += reward

    # ---- helpers -----------------------------------------------------------------------------

    def _add(self, name: str, value: float) -> None:
        self._parts[name] += value
        self._step += value

    def _penalize(self, name: str, magnitude: float) -> None:
        self._parts[name] -= magnitude
        self._step -= magnitude

    def _named(self, components: Mapping[str, float], who: str) -> float:
        """Add validated named components; returns their sum."""
        total = 0.0
        for name, value in components.items():
            if not isinstance(name, str) or not name.isidentifier() or name in BUILTIN_COMPONENTS:
                raise ValueError(
                    f"{who}: component name {name!r} is not an identifier or is one of the env's own"
                )
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{who}: component {name!r} = {value!r} is not a finite number")
            self._parts[name] = self._parts.get(name, 0.0) + float(value)
            total += float(value)
        return total
