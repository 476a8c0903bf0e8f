"""A programmatic check for a `[judge]` rubric (`function = "toolgym.examples.judge_checks:answer_tagged"`):
beside a judge model's verdict, the one thing it must not be fooled on, checked by code."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..rollouts.types import Trajectory

_TAGGED = re.compile(r"\[ANSWER\]\s*-?\d+\s*$")


def answer_tagged(trajectory: Trajectory) -> float:
    """1.0 when the episode's last action is `[ANSWER] <number>` (Zorplex's answer format), else 0.0."""
    last = trajectory.transitions[-1].action.text if trajectory.transitions else ""
    return 1.0 if _TAGGED.search(last.strip()) else 0.0
