"""PyCalc: exact arithmetic through one python call in the code sandbox."""

from __future__ import annotations

import warnings

import pytest
from gymnasium.utils.env_checker import check_env
from recording_testlib import play
from sandbox_testlib import make_env

from toolgym.envs import PyCalcEnv

ENV_ID = "toolgym/PyCalc-v0"


@pytest.fixture(scope="module")
def env() -> PyCalcEnv:
    made = make_env(ENV_ID).unwrapped
    assert isinstance(made, PyCalcEnv)
    return made


def test_pycalc_is_registered_and_passes_check_env(env):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env)
    assert [t["function"]["name"] for t in env.tool_specs] == ["python"]
    assert "PYTHON[print(12 * 34)]" in env.system_prompt


@pytest.mark.parametrize("seed", range(8))
def test_the_oracle_calls_python_then_answers_exactly(env, seed):
    question, info = env.reset(seed=seed)
    assert question.startswith("What is ") and isinstance(info["answer"], int) and info["needed_tool_calls"] == 1
    call, answer = env.oracle_actions()
    assert call.startswith("PYTHON[print(") and answer == f"[ANSWER] {info['answer']}"
    observation, reward, terminated, _, step_info = env.step(call)
    assert (observation, reward, terminated) == (f"{call} = {info['answer']}", 0.0, False)
    assert step_info["tool_results"] == [str(info["answer"])]
    observation, reward, terminated, _, step_info = env.step(answer)
    assert (observation, reward, terminated, step_info["failure_mode"]) == ("CORRECT", 1.2, True, "success")


def test_both_kinds_are_drawn_and_the_same_seed_repeats(env):
    questions = []
    for seed in range(20):
        questions.append(env.reset(seed=seed)[0])
    assert any(" * " in q for q in questions) and any(q.count(" + ") == 5 for q in questions)
    assert env.reset(seed=3)[0] == questions[3]
    product = make_env(ENV_ID, kind="product").unwrapped
    question, info = product.reset(seed=0)
    a, b = (int(x) for x in question.removeprefix("What is ").removesuffix("?").split(" * "))
    assert 100 <= a <= 999 and 100 <= b <= 999 and info["answer"] == a * b
    six_digits = make_env(ENV_ID, kind="product", min_operand=317).unwrapped
    answers = [six_digits.reset(seed=seed)[1]["answer"] for seed in range(200)]
    assert all(100_000 <= answer <= 998_001 for answer in answers)


def test_sandbox_errors_are_error_observations_counted_as_metrics():
    env = make_env(ENV_ID, sandbox={"timeout_s": 1.0, "max_output_chars": 100}).unwrapped
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step("PYTHON[while True: pass]")
    assert "timed out after 1 s" in observation and not (terminated or truncated)
    assert info["step_errors"] == ["sandbox_timeout"] and reward == pytest.approx(-0.1)
    observation, _, _, _, info = env.step("PYTHON[print('z' * 500)]")
    assert "[output truncated" in observation
    assert info["metrics"]["sandbox_timeout"] == 1.0 and info["metrics"]["sandbox_output_truncated"] == 1.0
    _, _, _, _, info = env.step("PYTHON[1 / 0]")
    assert info["metrics"]["sandbox_error"] == 1.0 and info["error_counts"]["sandbox_error"] == 1


def test_a_bad_sandbox_setting_is_refused():
    with pytest.raises(ValueError, match="sandbox"):
        PyCalcEnv(sandbox={"timeout": 3})
    with pytest.raises(ValueError, match="kind"):
        PyCalcEnv(kind="division")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_operand"):
        PyCalcEnv(min_operand=1000)
    with pytest.raises(ValueError, match="sandbox"):
        PyCalcEnv(tool=False, sandbox={"timeout": 3})


def test_the_scripted_oracle_solves_it_through_the_rollout_runner(env):
    trajectories = play(ENV_ID, seeds=[0, 1], group_size=2, env_kwargs={"kind": "sum"})
    assert len(trajectories) == 4
    for t in trajectories:
        assert len(t.transitions) == 2 and t.metrics["env"]["tool_calls"] == 1.0
        assert t.reward_components["correct"] == 1.0


def test_a_persistent_python_keeps_the_episodes_variables_and_no_more():
    env = make_env(ENV_ID, persistent=True)
    try:
        env.reset(seed=0)
        assert env.step("PYTHON[x = 482 * 917]")[4]["tool_results"] == ["[no output]"]
        assert env.step("PYTHON[print(x)]")[4]["tool_results"] == ["441994"]
        env.reset(seed=1)
        assert env.step("PYTHON[print('x' in globals())]")[4]["tool_results"] == ["False"]
    finally:
        env.close()


def test_without_the_tool_the_same_tasks_are_answered_at_once_and_a_call_is_unknown():
    with_tool = make_env(ENV_ID, kind="product").unwrapped
    env = make_env(ENV_ID, kind="product", tool=False).unwrapped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env)
    assert env.tool_specs == [] and "PYTHON" not in env.system_prompt and "in your head" in env.system_prompt
    question, info = env.reset(seed=5)
    assert question == with_tool.reset(seed=5)[0] and info["needed_tool_calls"] == 0
    assert env.oracle_actions() == [f"[ANSWER] {info['answer']}"]
    observation, _, terminated, _, _ = env.step("PYTHON[print(1)]")
    assert "UNKNOWN_TOOL" in observation and not terminated
    observation, reward, terminated, _, _ = env.step(f"[ANSWER] {info['answer']}")
    assert (observation, terminated) == ("CORRECT", True) and reward > 0


def test_code_with_brackets_runs_and_a_fence_passes_any_code():
    """`PYTHON[print([1, 2])]` used to be a malformed call and `d["a"]` a call of an unknown tool `d`."""
    env = make_env(ENV_ID, max_turns=10).unwrapped
    env.reset(seed=0)
    assert env.step("PYTHON[print([1, 2])]")[0] == "PYTHON[print([1, 2])] = [1, 2]"
    assert env.step('PYTHON[d = {"a": 1}; print(d["a"])]')[4]["tool_results"] == ["1"]
    fenced = "PYTHON[```\nfor c in '[[':\n    print(c + ']')\nprint('a' + 'b')\n```]"
    observation, _, _, _, info = env.step(fenced)
    assert info["tool_results"] == ["[]\n[]\nab"] and info["step_errors"] == []
    assert observation.startswith("PYTHON[```for c in '[[':\\n    print(c + ']')\\np...```] = ")
    observation, _, _, _, info = env.step("PYTHON[print([1, 2)]")
    assert info["step_errors"] == ["malformed_call"] and "(unbalanced '[' at column 7:" in observation
