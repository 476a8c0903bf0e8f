"""reasoning-gym's procedural datasets as a toolgym env: `toolgym/ReasoningGym-v0`.

    gymnasium.make("toolgym/ReasoningGym-v0", task="chain_sum", min_terms=2, max_terms=4)

`task` is any reasoning-gym dataset name (`reasoning_gym.factory.DATASETS`); every other keyword
that is not a ToolEnv knob goes to that dataset's config (`seed`, `size` and the dataset's own,
e.g. `min_terms`), checked against the config's fields. The dataset is the library's own seeded
generator: item `i` is a pure function of (config, i) (for `HASH_DEPENDENT` datasets only where
PYTHONHASHSEED is set), and each episode's seed picks the item
(`self.np_random`), so the same seed gives the same task. Datasets are built once per config
and shared by the envs the runner makes (one per episode).

Grading is the dataset's own `score_answer(answer, entry)`: a full score (1.0) is a correct
answer (the `correct` component, metric `accuracy`); a partial score `s` < 1 earns
`partial_credit * correct_reward * s` as the reward component `partial_credit` and counts as
wrong. A `score_answer` that raises scores 0.

Single-turn by default: one action, answered `[ANSWER] <answer>` (the rest of that line).
Datasets whose answers span lines (sudoku, n_queens, matrices: the first item's answer has a
newline) default to a `submit(answer)` tool with JSON calls, whose string argument may hold newlines;
pass `answer_tool` / `tool_format` to choose. Knobs: `think` (the instructions ask to reason
first, then answer), `calculator` (a typed `calculator(expression)` tool; max_turns then
defaults to 4 and calls within max_tool_calls are not penalised). Datasets without a single
reference answer (`answer` None: boxnet, rubiks_cube, ...) are graded all the same, but have
no oracle (`oracle_actions()` raises NotImplementedError).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import operator
import os
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any, Final

import reasoning_gym
from reasoning_gym.factory import DATASETS

from ..core.grading import Grade, Unreadable, answer_text
from ..core.task import Task
from ..core.tool_env import ToolEnv
from ..tools.typed import ToolError, tool

_TOOL_ENV_KNOBS: Final = frozenset(inspect.signature(ToolEnv.__init__).parameters) - {"self"}
_DATASET_CACHE: dict[str, Any] = {}
_DATASET_CACHE_SIZE: Final = 32
DEFAULT_SIZE: Final = 10_000  # items per dataset seed: enough that eval seeds rarely meet train items


# Datasets whose items depend on Python's string hashing (they iterate sets of strings): with hash
# randomization, process A's item i is not process B's, so a recording made in one process fails
# `replay --verify` in another. They are made only where the hashing is fixed (PYTHONHASHSEED).
HASH_DEPENDENT: Final = frozenset({"polynomial_multiplication", "word_ladder", "codeio"})


def dataset(task: str, config: Mapping[str, Any]) -> Any:
    """The reasoning-gym dataset `task` with `config` (built once per distinct config).
    Raises ValueError for an unknown name, a keyword its config does not have, or a
    `HASH_DEPENDENT` dataset in a process whose string hashing is random."""
    if task not in DATASETS:
        raise ValueError(
            f"unknown reasoning-gym dataset {task!r}; the datasets: {', '.join(sorted(DATASETS))}"
        )
    if task in HASH_DEPENDENT and os.environ.get("PYTHONHASHSEED", "random") == "random":
        raise ValueError(
            f"reasoning-gym's {task!r} builds different tasks in different processes (it iterates "
            "sets of strings, and Python's string hashing is random per process): set PYTHONHASHSEED "
            "(e.g. export PYTHONHASHSEED=0) before starting Python, so that item i is the same task "
            "in every process and a recording replays"
        )
    fields = {f.name for f in dataclasses.fields(DATASETS[task][1])}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(
            f"reasoning-gym dataset {task!r} has no config field {', '.join(unknown)}; its fields: "
            f"{', '.join(sorted(fields))} (ToolEnv knobs: {', '.join(sorted(_TOOL_ENV_KNOBS - {'tools'}))})"
        )
    key = f"{task}:{sorted(config.items())!r}"
    if key not in _DATASET_CACHE:
        if len(_DATASET_CACHE) >= _DATASET_CACHE_SIZE:
            _DATASET_CACHE.pop(next(iter(_DATASET_CACHE)))
        _DATASET_CACHE[key] = reasoning_gym.create_dataset(task, **config)
    return _DATASET_CACHE[key]


class ScoreAnswer:
    """A toolgym grader calling the dataset's own `score_answer(answer, entry)` (the entry is the
    task's state). Reads any non-empty response (a non-string answer-tool argument as JSON text);
    finds no untagged answers (free text is not an answer). See the module doc for the Grade."""

    hint = "<answer>"

    def __init__(self, score_answer: Callable[[Any, Any], Any], partial_credit: float):
        self.score_answer = score_answer
        self.partial_credit = partial_credit

    def read(self, response: Any) -> str:
        text = response if isinstance(response, str) else answer_text(response)
        if not text.strip():
            raise Unreadable("nothing after the tag")
        return text.strip()

    def find(self, text: str) -> Any | None:
        return None

    def __call__(self, response: Any, task: Task, state: Any) -> Grade:
        try:
            score = float(self.score_answer(self.read(response), state))
        except Exception:  # the library's scorer failing on odd text is a wrong answer, not a crash
            score = 0.0
        score = min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0
        if score >= 1.0:
            return Grade(1.0)
        return Grade(0.0, {"partial_credit": self.partial_credit * score} if score > 0 else {})


_BINARY: Final[dict[type, Callable[[Any, Any], Any]]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_UNARY: Final[dict[type, Callable[[Any], Any]]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_MAGNITUDE: Final = 1e100


def _evaluate(node: ast.AST) -> Fraction | float:
    """Exact arithmetic: a literal is the decimal it is written as (Fraction), so that
    1000.1 + 1940.1541 is 2940.2541, as the dataset's graded answer, not its float neighbour;
    only a non-integer power leaves the rationals (a float)."""
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ToolError("power too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        if isinstance(value, complex) or abs(value) > _MAX_MAGNITUDE:
            raise ToolError("result out of range")
        return value
    raise ToolError("only numbers, + - * / // % ** and parentheses")


@tool
def calculator(expression: str) -> int | float:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. (3 + 4) * 2.
    """
    if len(expression) > 200:
        raise ToolError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError("not an arithmetic expression") from None
    value = _evaluate(tree.body)
    if isinstance(value, Fraction):  # one rounding, at the end: the shortest decimal that is it
        return value.numerator if value.denominator == 1 else float(value)
    if not math.isfinite(value):
        raise ToolError("result out of range")
    return value


calculator_tool = calculator  # the env's `calculator` knob shadows the name inside __init__


class ReasoningGymEnv(ToolEnv):
    """`gymnasium.make("toolgym/ReasoningGym-v0", task=..., **dataset_config, **toolenv_knobs)`;
    see the module doc. `seed` and `size` are the dataset config's (defaults 0 and 10,000):
    a fixed item pool per (task, seed); the episode seed picks one of its `size` items.
    `max_action_chars` is larger than ToolEnv's: some datasets' answers are long (codeio's run past
    26,000 characters)."""

    def __init__(
        self,
        task: str = "basic_arithmetic",
        *,
        seed: int = 0,
        size: int = DEFAULT_SIZE,
        think: bool = False,
        calculator: bool = False,
        partial_credit: float = 1.0,
        max_turns: int | None = None,
        max_observation_chars: int = 32768,
        max_action_chars: int = 65536,
        **knobs: Any,
    ):
        config = {k: v for k, v in knobs.items() if k not in _TOOL_ENV_KNOBS}
        knobs = {k: v for k, v in knobs.items() if k in _TOOL_ENV_KNOBS}
        if "tools" in knobs:
            raise ValueError("ReasoningGymEnv's tools come from its knobs (calculator=True)")
        for name, value in (("seed", seed), ("size", size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "size" else 0):
                raise ValueError(f"{name} must be an int >= {1 if name == 'size' else 0}, got {value!r}")
        if not isinstance(partial_credit, int | float) or partial_credit < 0:
            raise ValueError(f"partial_credit must be a float >= 0, got {partial_credit!r}")
        self.task_name = task
        self.size = size
        self.think = bool(think)
        self.calculator = bool(calculator)
        self.dataset = dataset(task, {**config, "seed": seed, "size": size})
        first = self.dataset[0]["answer"]
        if (
            "answer_tool" not in knobs
            and "tool_format" not in knobs
            and isinstance(first, str)
            and "\n" in first
        ):
            knobs.update(answer_tool="submit", tool_format="json")  # the [ANSWER] tag takes one line
        correct_reward = knobs.get("correct_reward", 1.0)
        knobs.setdefault(
            "grader", ScoreAnswer(self.dataset.score_answer, float(partial_credit) * float(correct_reward))
        )
        lines = [f"Solve the {task.replace('_', ' ')} task."]
        if self.calculator:
            lines.append("A calculator tool evaluates arithmetic for you.")
        if self.think:
            lines.append("Think it through step by step first; then give your final answer.")
        super().__init__(
            tools=[calculator_tool] if self.calculator else [],
            instructions=" ".join(lines),
            max_turns=max_turns if max_turns is not None else (4 if self.calculator else 1),
            max_observation_chars=max_observation_chars,
            max_action_chars=max_action_chars,
            **knobs,
        )

    def new_task(self) -> Task:
        index = int(self.np_random.integers(self.size))
        entry = self.dataset[index]
        answer = entry["answer"]
        needed = self.max_tool_calls if self.calculator else 0
        return Task(
            entry["question"],
            answer if isinstance(answer, str) or answer is None else answer_text(answer),
            needed_tool_calls=needed,
            state=entry,
        )

    def oracle_actions(self) -> list[str]:
        if self.answer is None:
            raise NotImplementedError(
                f"reasoning-gym dataset {self.task_name!r} has no single reference answer (its "
                "score_answer checks a solution), so there is no oracle; record it with a model policy"
            )
        return super().oracle_actions()
