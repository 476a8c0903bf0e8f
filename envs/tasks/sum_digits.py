"""Digit summing: "What is the total digit sum of [12, 345, 67]?" answered with `[ANSWER] 28`.

No tools; single-turn by default (`max_turns=1`: the one action is graded and the episode
terminates). With `max_turns > 1` a malformed or missing answer gets an error observation and
another try.

Rewards (defaults): a correct tagged answer earns 1.0 (correct 0.8 + format 0.2); a tagged wrong
answer 0.2 (format credit); an untagged correct answer 0.8 (correct credit only); anything else
`incorrect_reward` (0.0; set -1.0 to punish). Errors cost nothing by default (`error_penalty=0`).
"""

from __future__ import annotations

from typing import Any

from ..core.grading import numeric
from ..core.task import Task
from ..core.tool_env import ToolEnv

_INSTRUCTIONS = "Add up every digit of every number in the list."
_EXAMPLE = "User: What is the total digit sum of [12, 34]?\nAssistant: 1+2+3+4 = 10 [ANSWER] 10"


def digit_sum(numbers: list[int]) -> int:
    return sum(int(digit) for number in numbers for digit in str(abs(number)))


class SumDigitsEnv(ToolEnv):
    """`gymnasium.make("toolgym/SumDigits-v0", min_count=2, max_count=4, min_value=10, max_value=99)`.

    Each episode draws a count uniformly in [min_count, max_count] and that many numbers
    uniformly in [min_value, max_value]. Other keyword arguments are ToolEnv knobs.
    """

    def __init__(
        self,
        min_count: int = 2,
        max_count: int = 4,
        min_value: int = 10,
        max_value: int = 99,
        *,
        max_turns: int = 1,
        correct_reward: float = 0.8,
        format_reward: float = 0.2,
        incorrect_reward: float = 0.0,
        error_penalty: float = 0.0,
        **knobs: Any,
    ):
        for name, value, low in (("min_count", min_count, 1), ("min_value", min_value, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(max_count, int) or max_count < min_count:
            raise ValueError(f"max_count must be an int >= min_count={min_count}, got {max_count!r}")
        if not isinstance(max_value, int) or max_value < min_value:
            raise ValueError(f"max_value must be an int >= min_value={min_value}, got {max_value!r}")
        self.min_count, self.max_count = min_count, max_count
        self.min_value, self.max_value = min_value, max_value
        super().__init__(
            tools=(),
            instructions=_INSTRUCTIONS,
            example=_EXAMPLE,
            max_turns=max_turns,
            correct_reward=correct_reward,
            format_reward=format_reward,
            incorrect_reward=incorrect_reward,
            error_penalty=error_penalty,
            **{"grader": numeric(), **knobs},
        )

    def new_task(self) -> Task:
        rng = self.np_random
        count = int(rng.integers(self.min_count, self.max_count + 1))
        numbers = rng.integers(self.min_value, self.max_value + 1, size=count).tolist()
        answer = digit_sum(numbers)
        question = f"What is the total digit sum of [{', '.join(map(str, numbers))}]?"
        return Task(question, answer)
