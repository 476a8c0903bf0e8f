"""CodeTests: write a small Python function that passes hidden unit tests run in the sandbox.

Each episode draws one of a few problems (`PROBLEMS`: reverse the words, count the vowels, a
running sum, ...) and fresh test inputs for it. The policy may try code with the `python(code)`
tool, then submits its function's source with `submit(answer=...)` (JSON tool calls); the grader
runs it against the hidden tests in the code sandbox (envs/tools/sandbox.py), and the score is
the fraction of tests passed (partial credit; all passed is correct).

The expected outputs never enter the sandbox: the harness prints what the function returned for
each test's arguments and the host compares, so no output the code forges can pass a test it
does not solve. A submission that does not define the function, raises, times out or prints
nothing readable scores 0 on the tests it did not answer.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from ..core.grading import Grade
from ..core.task import Example, Task
from ..core.tool_env import ToolEnv
from ..tools.sandbox import Sandbox, SandboxConfig, python_tool, sandbox_config, shared_sandbox
from ..tools.typed import Call

_MARK = "__toolgym_test_results__"
_INSTRUCTIONS = (
    "Write the Python function asked for. Try it with the python tool if you like, then submit "
    "its full source (the def, with any imports it needs) with the submit tool."
)
_EXAMPLE = Example(
    "Write `double(x: int) -> int`: twice x.",
    [(Call("python", {"code": "def double(x):\n    return 2 * x\nprint(double(4))"}), "8")],
    "def double(x):\n    return 2 * x\n",
)


def reverse_words(s: str) -> str:
    return " ".join(reversed(s.split()))


def count_vowels(s: str) -> int:
    return sum(c in "aeiou" for c in s.lower())


def running_sum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def second_largest(xs: list[int]) -> int:
    return sorted(set(xs))[-2]


def digit_sum(n: int) -> int:
    return sum(int(d) for d in str(abs(n)))


def is_palindrome(s: str) -> bool:
    letters = [c.lower() for c in s if c.isalpha()]
    return letters == letters[::-1]


_WORDS = ("apple", "kite", "river", "stone", "cloud", "lamp", "Anna", "level", "noon", "tree", "sky", "owl")


def _words(rng: np.random.Generator) -> str:
    return " ".join(_WORDS[int(i)] for i in rng.integers(len(_WORDS), size=int(rng.integers(1, 6))))


def _ints(rng: np.random.Generator, low: int = 2) -> list[int]:
    return rng.integers(-50, 100, size=int(rng.integers(low, 8))).tolist()


def _distinct(rng: np.random.Generator) -> list[int]:
    xs = _ints(rng)
    return xs if len(set(xs)) >= 2 else [*xs, max(xs) + 1]


def _maybe_palindrome(rng: np.random.Generator) -> str:
    word = _WORDS[int(rng.integers(len(_WORDS)))]
    return f"{word}, {word[::-1]}!" if rng.random() < 0.5 else word


class Problem(NamedTuple):
    """A function to write: its reference (whose source is the oracle's answer), the task text,
    and a draw of one test's arguments."""

    reference: Callable[..., Any]
    description: str
    arguments: Callable[[np.random.Generator], tuple[Any, ...]]


PROBLEMS: tuple[Problem, ...] = (
    Problem(reverse_words, "the words of s in reverse order, joined by single spaces", lambda r: (_words(r),)),
    Problem(count_vowels, "how many of s's letters are vowels (a, e, i, o, u; any case)", lambda r: (_words(r),)),
    Problem(running_sum, "the running totals of xs", lambda r: (_ints(r, low=0),)),
    Problem(second_largest, "the second largest distinct value in xs", lambda r: (_distinct(r),)),
    Problem(digit_sum, "the sum of the decimal digits of n (ignoring its sign)", lambda r: (int(r.integers(-9999, 99999)),)),
    Problem(is_palindrome, "whether s's letters read the same backwards, ignoring case", lambda r: (_maybe_palindrome(r),)),
)


def _signature(fn: Callable[..., Any]) -> str:
    params = ", ".join(f"{name}: {p.annotation}" for name, p in inspect.signature(fn).parameters.items())
    return f"{fn.__name__}({params}) -> {inspect.signature(fn).return_annotation}"


def harness(source: str, name: str, arguments: list[list[Any]]) -> str:
    """The program run in the sandbox: the submission defined with its prints muted, then one
    JSON line of what `name` returned for each arguments list (`[true, value]` or `[false,
    error]`). The expected values are not in it."""
    return (
        "import contextlib as _c, io as _io, json as _j\n"
        "_ns = {'__name__': '__submission__'}\n"
        "with _c.redirect_stdout(_io.StringIO()):\n"
        f"    exec(compile({source!r}, '<submission>', 'exec'), _ns)\n"
        "_out = []\n"
        f"for _args in _j.loads({json.dumps(arguments)!r}):\n"
        "    try:\n"
        "        with _c.redirect_stdout(_io.StringIO()):\n"
        f"            _v = _ns[{name!r}](*_args)\n"
        "        _j.dumps(_v)\n"
        "        _out.append([True, _v])\n"
        "    except Exception as _e:\n"
        "        _out.append([False, type(_e).__name__])\n"
        f"print({_MARK!r} + _j.dumps(_out))\n"
    )


def passed_tests(stdout: str, expected: list[Any]) -> list[bool]:
    """Which tests the printed results pass (the last results line counts; none: none pass)."""
    lines = [line for line in stdout.splitlines() if line.startswith(_MARK)]
    try:
        results = json.loads(lines[-1][len(_MARK) :]) if lines else []
    except ValueError:
        results = []
    if not isinstance(results, list):
        results = []
    passed = []
    for i, want in enumerate(expected):
        got = results[i] if i < len(results) else None
        if isinstance(got, list) and len(got) == 2 and got[0] is True:
            passed.append(json.dumps(got[1]) == json.dumps(want))
        else:
            passed.append(False)
    return passed


class CodeTestsEnv(ToolEnv):
    """`gymnasium.make("toolgym/CodeTests-v0", tests=5, sandbox={"timeout_s": 5})`.

    tests: hidden tests per episode. sandbox: SandboxConfig fields (a mapping) or a
    SandboxConfig, for the tool and the grading alike. persistent: the python tool keeps what a
    call defines for the episode's next calls (`python_tool(persistent=True)`; the grading still
    runs in fresh processes). Other keyword arguments are the ToolEnv knobs (tool_format="json",
    max_turns=4, rewards, limits)."""

    def __init__(
        self,
        tests: int = 5,
        *,
        sandbox: Mapping[str, Any] | SandboxConfig | None = None,
        persistent: bool = False,
        tool_format: str = "json",
        max_turns: int = 4,
        **knobs: Any,
    ):
        if not isinstance(tests, int) or isinstance(tests, bool) or tests < 1:
            raise ValueError(f"tests must be an int >= 1, got {tests!r}")
        config = sandbox_config(sandbox)
        self.tests = tests
        self.sandbox: Sandbox = shared_sandbox(config)
        super().__init__(
            tools=[python_tool(config, persistent=persistent)],
            instructions=_INSTRUCTIONS,
            example=_EXAMPLE,
            tool_format=tool_format,
            max_turns=max_turns,
            answer_tool="submit",
            grader=self.grade,
            **knobs,
        )

    def new_task(self) -> Task:
        rng = self.np_random
        problem = PROBLEMS[int(rng.integers(len(PROBLEMS)))]
        arguments = [list(problem.arguments(rng)) for _ in range(self.tests)]
        expected = [problem.reference(*args) for args in arguments]
        question = f"Write `{_signature(problem.reference)}`: {problem.description}."
        state = {"name": problem.reference.__name__, "arguments": arguments, "expected": expected}
        return Task(question, inspect.getsource(problem.reference), state=state)

    def grade(self, response: Any, task: Task, state: dict[str, Any]) -> Grade:
        """The fraction of the hidden tests the submitted source passes, run in the sandbox."""
        if not isinstance(response, str):
            return Grade(0.0)
        result = self.sandbox.run(harness(response, state["name"], state["arguments"]))
        passed = passed_tests(result.stdout if result.kind is None else "", state["expected"])
        return Grade(sum(passed) / len(passed))
