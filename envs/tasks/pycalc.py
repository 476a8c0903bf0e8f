"""PyCalc: "What is 482 * 917?" answered exactly, by running one line of Python in the sandbox.

The arithmetic is beyond a tiny model's head (the product of two 3-digit numbers, or the sum of
six), so the way to the answer is the `python(code)` tool (envs/tools/sandbox.py), then
`[ANSWER] <the printed number>`. The smallest task that needs the code sandbox:

    PYTHON[print(482 * 917)]  ->  441994  ->  [ANSWER] 441994

The answer is an integer, graded exactly. The sandbox is the process's shared pool for the
env's `sandbox` settings (a SandboxConfig's fields); an env that cannot start it (no bubblewrap)
refuses to be made, unless `sandbox={"isolation": "rlimits"}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ..core.grading import numeric
from ..core.task import Example, Task
from ..core.tool_env import ToolEnv
from ..tools.sandbox import SandboxConfig, python_tool, sandbox_config
from ..tools.typed import Call

_INSTRUCTIONS = "Work out the arithmetic exactly: run Python with the python tool and print the result."
_EXAMPLE = Example("What is 12 * 34?", [(Call("python", {"code": "print(12 * 34)"}), "408")], 408)
_INSTRUCTIONS_WITHOUT_TOOL = "Work out the arithmetic exactly, in your head."
_EXAMPLE_WITHOUT_TOOL = Example("What is 12 * 34?", [], 408)
KINDS = ("product", "sum")


class PyCalcEnv(ToolEnv):
    """`gymnasium.make("toolgym/PyCalc-v0", kind="mixed", sandbox={"timeout_s": 5})`.

    kind: "product" (a * b, two 3-digit numbers), "sum" (six 3-digit numbers) or "mixed" (either,
    drawn per episode). min_operand: the smallest number drawn (100..999); 317 makes every
    product six digits long, so the answer has one length. sandbox: SandboxConfig fields (a
    mapping) or a SandboxConfig, checked even with tool=False. persistent: the python tool keeps what a call defines for the episode's next calls
    (`python_tool(persistent=True)`). tool=False: the same tasks with no tool (no sandbox is
    started; the oracle answers at once), the baseline that says how much of a score is the
    tool's. Other keyword arguments are the ToolEnv knobs (max_turns=3, rewards, limits)."""

    def __init__(
        self,
        kind: Literal["mixed", "product", "sum"] = "mixed",
        *,
        sandbox: Mapping[str, Any] | SandboxConfig | None = None,
        persistent: bool = False,
        tool: bool = True,
        min_operand: int = 100,
        max_turns: int = 3,
        **knobs: Any,
    ):
        if kind not in ("mixed", *KINDS):
            raise ValueError(f"kind must be 'mixed', 'product' or 'sum', got {kind!r}")
        if not (isinstance(min_operand, int) and 100 <= min_operand <= 999):
            raise ValueError(f"min_operand must be an integer from 100 to 999, got {min_operand!r}")
        config = sandbox_config(sandbox)
        self.kind = kind
        self.tool = tool
        self.min_operand = min_operand
        knobs.setdefault("grader", numeric())
        super().__init__(
            tools=[python_tool(config, persistent=persistent)] if tool else [],
            instructions=_INSTRUCTIONS if tool else _INSTRUCTIONS_WITHOUT_TOOL,
            example=_EXAMPLE if tool else _EXAMPLE_WITHOUT_TOOL,
            max_turns=max_turns,
            **knobs,
        )

    def new_task(self) -> Task:
        rng = self.np_random
        kind = self.kind if self.kind != "mixed" else KINDS[int(rng.integers(len(KINDS)))]
        count = 2 if kind == "product" else 6
        numbers = rng.integers(self.min_operand, 1000, size=count).tolist()
        expression = (" * " if kind == "product" else " + ").join(map(str, numbers))
        answer = numbers[0] * numbers[1] if kind == "product" else sum(numbers)
        solution = [Call("python", {"code": f"print({expression})"})] if self.tool else []
        return Task(f"What is {expression}?", answer, solution)
