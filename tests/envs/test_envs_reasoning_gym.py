"""toolgym/ReasoningGym-v0: reasoning-gym's datasets through check_env, random actions, the
library's reference answers, determinism per seed, partial credit, the calculator, and a
recording replayed with --verify through the CLI."""

import math
import subprocess
import sys
import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

pytest.importorskip("reasoning_gym")

from toolgym.envs import list_envs
from toolgym.envs.adapters.reasoning_gym import ScoreAnswer

ENV_ID = "toolgym/ReasoningGym-v0"
# Quick generators with one reference answer each; rotate_matrix and mini_sudoku answer in
# several lines (the submit tool), the rest with the [ANSWER] tag.
DATASETS = [
    "basic_arithmetic", "chain_sum", "base_conversion", "caesar_cipher", "letter_counting",
    "spell_backward", "gcd", "lcm", "prime_factorization", "count_bits", "word_sorting",
    "number_sorting", "leg_counting", "fraction_simplification", "simple_equations", "coin_flip",
    "isomorphic_strings", "ransom_note", "number_filtering", "power_function", "complex_arithmetic",
    "calendar_arithmetic", "rotate_matrix", "mini_sudoku",
]  # fmt: skip


def make(task, **kwargs):
    return gymnasium.make(ENV_ID, task=task, **kwargs)


def test_registered_and_listed_with_its_knobs():
    knobs = list_envs()[ENV_ID]
    assert knobs["task"] == "basic_arithmetic" and knobs["seed"] == 0 and knobs["size"] == 10_000
    assert knobs["think"] is False and knobs["calculator"] is False and knobs["partial_credit"] == 1.0


@pytest.mark.parametrize("task", [*DATASETS, "rubiks_cube"])
def test_check_env(task):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(make(task).unwrapped)


def random_action(env, rng: np.random.Generator) -> str:
    answer = env.unwrapped.answer
    choice = int(rng.integers(5))
    if choice == 0:
        return env.action_space.sample()
    if choice == 1:
        return f"[ANSWER] {rng.integers(-100, 100)}"
    if choice == 2:
        return env.unwrapped.answer_action(answer)
    if choice == 3:
        return env.unwrapped.answer_action(answer, tagged=False)
    return "I think the answer is " + str(answer)[: int(rng.integers(0, 8))]


@pytest.mark.parametrize("task", DATASETS)
def test_100_random_action_episodes(task):
    env = make(task)
    env.action_space.seed(0)
    rng = np.random.default_rng(0)
    for seed in range(100):
        env.reset(seed=seed)
        total, done = 0.0, False
        while not done:
            _, reward, terminated, truncated, info = env.step(random_action(env, rng))
            total += reward
            done = terminated or truncated
        assert terminated and not truncated  # single-turn: the one step is the episode
        assert math.isclose(total, sum(info["reward_components"].values()), abs_tol=1e-9)
        assert 0.0 <= info["metrics"]["accuracy"] <= 1.0 and info["end_reason"]


@pytest.mark.parametrize("task", DATASETS)
def test_the_reference_answer_scores_full_reward(task):
    env = make(task)
    for seed in range(5):
        env.reset(seed=seed)
        (action,) = env.unwrapped.oracle_actions()
        obs, reward, terminated, _, info = env.step(action)
        assert (obs, terminated, info["failure_mode"]) == ("CORRECT", True, "success")
        assert info["metrics"]["accuracy"] == 1.0 and reward == pytest.approx(1.2)


@pytest.mark.parametrize("task", DATASETS[:6])
def test_deterministic_per_seed(task):
    questions = []
    for _ in range(2):
        env = make(task)
        questions.append([env.reset(seed=seed)[1]["answer"] and env.unwrapped.question for seed in range(10)])
    assert questions[0] == questions[1] and len(set(questions[0])) > 1


def test_dataset_config_keywords_pass_through_and_are_checked():
    env = make("chain_sum", min_terms=5, max_terms=5, min_digits=1, max_digits=1)
    question, _ = env.reset(seed=1)
    assert question.count("+") + question.count("-") == 4
    with pytest.raises(ValueError, match="no config field min_termz"):
        make("chain_sum", min_termz=5)
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset"):
        make("no_such_dataset")


def test_partial_credit_is_its_own_component():
    grade = ScoreAnswer(lambda answer, entry: 0.25, 1.0)("x", None, None)
    assert grade.score == 0.0 and grade.components == {"partial_credit": 0.25}
    assert ScoreAnswer(lambda answer, entry: 1.0, 1.0)("x", None, None).score == 1.0
    env = make("spell_backward", partial_credit=0.5)
    env.reset(seed=0)
    env.unwrapped.grader.score_answer = lambda answer, entry: 0.5
    _, reward, _, _, info = env.step("[ANSWER] something")
    assert info["reward_components"]["partial_credit"] == 0.25 and reward == pytest.approx(0.45)
    assert info["metrics"]["accuracy"] == 0.0 and info["failure_mode"] == "wrong_answer"


def test_a_dataset_without_a_reference_answer_has_no_oracle():
    env = make("rubiks_cube")
    _, info = env.reset(seed=0)
    assert info["answer"] is None
    with pytest.raises(NotImplementedError, match="no single reference answer"):
        env.unwrapped.oracle_actions()
    _, _, terminated, _, info = env.step("[ANSWER] U R")
    assert terminated and info["failure_mode"] == "wrong_answer"


def test_think_and_calculator():
    env = make("basic_arithmetic", calculator=True, think=True)
    _, info = env.reset(seed=2)
    assert "step by step" in info["system_prompt"] and "CALCULATOR[expression]" in info["system_prompt"]
    assert env.unwrapped.max_turns == 4
    obs, reward, _, _, info = env.step("CALCULATOR[(3 + 4) * 2]")
    assert obs == "CALCULATOR[(3 + 4) * 2] = 14" and reward == 0.0  # no penalty within the budget
    obs, _, _, _, info = env.step("CALCULATOR[__import__('os')]")
    assert "only numbers" in obs and info["step_errors"] == ["tool_error"]
    obs, _, terminated, _, info = env.step(env.unwrapped.oracle_actions()[-1])
    assert (obs, terminated, info["failure_mode"]) == ("CORRECT", True, "success")


def test_multi_line_answers_use_the_submit_tool():
    env = make("mini_sudoku")
    _, info = env.reset(seed=0)
    assert "\n" in info["answer"] and "submit" in info["system_prompt"]
    assert make("mini_sudoku", answer_tool=None).unwrapped.answer_tool is None


@pytest.mark.slow
def test_recorded_and_replayed_exactly_through_the_cli(tmp_path):
    out = tmp_path / "rg.jsonl"

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "toolgym.configs.cli", *args], capture_output=True, text=True, timeout=300
        )

    record = cli(
        "record", "--env", ENV_ID, "--env-kwargs", '{"task": "chain_sum"}', "--policy", "oracle",
        "--p-omit-tag", "0.3", "--tasks", "6", "--group-size", "2", "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert record.returncode == 0, record.stdout + record.stderr
    assert "recorded 12 episodes" in record.stdout, record.stdout
    replay = cli("replay", str(out), "--verify", "--summary-only")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "verify: 12/12 episodes replay exactly" in replay.stdout, replay.stdout
