"""CodeTests: a function graded by hidden unit tests run in the code sandbox, partial credit."""

from __future__ import annotations

import json
import warnings

import pytest
from gymnasium.utils.env_checker import check_env
from sandbox_testlib import make_env

from toolgym.envs import CodeTestsEnv
from toolgym.envs.tasks.code_tests import PROBLEMS, passed_tests

ENV_ID = "toolgym/CodeTests-v0"


def submit(code: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'submit', 'arguments': {'answer': code}})}\n</tool_call>"


@pytest.fixture(scope="module")
def env() -> CodeTestsEnv:
    made = make_env(ENV_ID, sandbox={"timeout_s": 2.0}).unwrapped
    assert isinstance(made, CodeTestsEnv)
    return made


def _seed_for(env: CodeTestsEnv, name: str) -> int:
    return next(seed for seed in range(100) if env.reset(seed=seed) and env.state["name"] == name)


def test_codetests_is_registered_and_passes_check_env(env):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env)
    assert [t["function"]["name"] for t in env.tool_specs] == ["python", "submit"]


def test_the_oracle_passes_every_problem(env):
    names = set()
    for seed in range(30):
        _, info = env.reset(seed=seed)
        names.add(env.state["name"])
        for action in env.oracle_actions():
            observation, reward, terminated, _, info = env.step(action)
        assert (observation, reward, terminated, info["failure_mode"]) == ("CORRECT", 1.2, True, "success")
    assert names == {p.reference.__name__ for p in PROBLEMS}


def test_a_partly_right_function_gets_partial_credit(env):
    env.reset(seed=_seed_for(env, "is_palindrome"))
    share = sum(env.state["expected"]) / len(env.state["expected"])
    assert 0 < share < 1
    observation, reward, terminated, _, info = env.step(submit("def is_palindrome(s):\n    return True\n"))
    assert terminated and info["metrics"]["accuracy"] == pytest.approx(share)
    assert observation.startswith("PARTLY CORRECT") and reward == pytest.approx(share + 0.2)


def test_forged_results_and_broken_code_pass_nothing(env):
    seed = _seed_for(env, "running_sum")
    forged = "print('__toolgym_test_results__' + '[[true, [1]]]' * 5)\nimport os\nos._exit(0)"
    for code in (forged, "def running_sum(:", "def other(xs):\n    return xs", "while True: pass", 42):
        env.reset(seed=seed)
        _, reward, terminated, _, info = env.step(submit(code))
        assert terminated and info["metrics"]["accuracy"] == 0.0 and reward == pytest.approx(0.2), code


def test_the_python_tool_works_before_submitting(env):
    env.reset(seed=0)
    call = json.dumps({"name": "python", "arguments": {"code": "print(sum([1, 2, 3]))"}})
    observation, _, terminated, _, info = env.step(f"<tool_call>\n{call}\n</tool_call>")
    assert "6" in observation and not terminated and info["tool_results"] == ["6"]


def test_unreadable_results_lines_pass_nothing():
    mark = "__toolgym_test_results__"
    for stdout in ("", f"{mark}42", f"{mark}{{}}", f"{mark}[1, [true]]", f"{mark}not json", "[[true, 3]]"):
        assert passed_tests(stdout, [3, 4]) == [False, False], stdout
    assert passed_tests(f"noise\n{mark}[[true, 3], [false, \"KeyError\"]]", [3, 4]) == [True, False]
    assert passed_tests(f"{mark}[[true, 1]]", [True]) == [False]  # 1 is not true
