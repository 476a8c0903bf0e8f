"""toolgym/ReasoningGym-v0: reasoning-gym's datasets through check_env, random actions, the
library's reference answers, determinism per seed, partial credit, the calculator, and a
recording replayed with --verify through the CLI."""

import math
import os
import subprocess
import sys
import tomllib
import warnings

import gymnasium
import msgspec
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

pytest.importorskip("reasoning_gym")

from toolgym.configs.assembly.parts import build_renderer, model_config
from toolgym.configs.checks import check_against_machine, check_environment
from toolgym.configs.cli.main import main as cli_main
from toolgym.configs.load import config_from_dict, config_to_toml, load_config
from toolgym.envs import list_envs
from toolgym.envs.adapters.reasoning_gym import ScoreAnswer
from toolgym.trainers.metrics_log import read_metrics

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


def test_long_reference_answers_are_read_whole():
    """tower_of_hanoi answers run past 4,096 characters (codeio's past 26,000): the adapter's
    max_action_chars holds them, so the oracle's answer is graded correct, not cut."""
    env = make("tower_of_hanoi")
    longest = 0
    for seed in range(40):
        env.reset(seed=seed)
        action = env.unwrapped.oracle_actions()[-1]
        longest = max(longest, len(action))
        *_, info = env.step(action)
        assert info["failure_mode"] == "success", (seed, len(action))
    assert longest > 4096


def test_a_dataset_without_a_reference_answer_has_no_oracle():
    env = make("rubiks_cube")
    _, info = env.reset(seed=0)
    assert info["answer"] is None
    with pytest.raises(NotImplementedError, match="no single reference answer"):
        env.unwrapped.oracle_actions()
    _, _, terminated, _, info = env.step("[ANSWER] U R")
    assert terminated and info["failure_mode"] == "wrong_answer"


def test_the_calculator_answers_in_the_decimals_the_task_is_graded_in():
    from toolgym.envs.adapters.reasoning_gym import calculator

    # floats would answer 2940.2540999999997 and 0.30000000000000004: graded wrong when copied
    assert repr(calculator("1000.1 + 1940.1541")) == "2940.2541"
    assert repr(calculator("0.1 + 0.2")) == "0.3" and calculator("(3 + 4) * 2") == 14
    assert calculator("7 / 2") == 3.5 and calculator("2 ** 0.5") == 2**0.5 and calculator("-9 // 2") == -5
    env = make("basic_arithmetic", calculator=True)
    env.reset(seed=0)
    obs, *_ = env.step("CALCULATOR[1000.1 + 1940.1541]")
    assert obs == "CALCULATOR[1000.1 + 1940.1541] = 2940.2541"


def _first_items(task: str, hash_seed: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    code = (
        "import gymnasium, toolgym.envs\n"
        f"env = gymnasium.make('{ENV_ID}', task='{task}')\n"
        "print([env.reset(seed=s)[0] for s in range(8)])"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_dataset_that_depends_on_string_hashing_needs_it_fixed():
    """polynomial_multiplication's items differ between processes with random string hashing: a
    recording made in one would not replay in another. It is refused there, and the same in every
    process where PYTHONHASHSEED is set."""
    refused = _first_items("polynomial_multiplication", None)
    assert refused.returncode != 0 and "set PYTHONHASHSEED" in refused.stderr
    first, second = (
        _first_items("polynomial_multiplication", "0"),
        _first_items("polynomial_multiplication", "0"),
    )
    assert first.returncode == 0 and first.stdout == second.stdout
    assert _first_items("polynomial_multiplication", "1").stdout != first.stdout  # why it is refused


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


# ---- the CPU demo preset (configs/reasoning_gym_chain_sum_tiny.toml) -------------------------------

DEMO = "reasoning_gym_chain_sum_tiny"


def test_the_demo_preset_parses_and_passes_the_checks():
    config, _ = load_config(DEMO)
    assert config.env.id == ENV_ID and config.env.kwargs["task"] == "chain_sum"
    again = config_from_dict(tomllib.loads(config_to_toml(config)))
    assert msgspec.to_builtins(again) == msgspec.to_builtins(config)
    check_environment(config)
    renderer, _ = build_renderer(config)
    check_against_machine(config, model_config(config), renderer, torch.device("cpu"))
    # what the demo rests on: demonstrations that leave out the tag half the time, an SFT long
    # enough (at beta2 0.95) for the sum table to form, and a sampled eval
    assert config.sft.enabled and config.sft.oracle.p_omit_tag == 0.5 and config.sft.steps >= 400
    assert config.sft.optimizer.betas[1] == 0.95 and not config.eval.greedy


def test_the_demo_env_reads_only_tagged_answers():
    # RL's signal in the demo: the untagged answer its demonstrations teach is no answer at all
    config, _ = load_config(DEMO)
    env = make(**config.env.kwargs)
    env.reset(seed=3)
    answer = env.unwrapped.answer
    _, reward, _, _, info = env.step(env.unwrapped.answer_action(answer, tagged=False))
    assert info["metrics"]["accuracy"] == 0.0 and info["failure_mode"] == "no_answer"
    assert reward == pytest.approx(-0.1)
    env.reset(seed=3)
    _, reward, _, _, info = env.step(env.unwrapped.answer_action(answer))
    assert info["metrics"]["accuracy"] == 1.0 and reward == pytest.approx(1.2)


def test_the_demo_preset_trains_end_to_end_when_shortened(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [
        f"run.run_dir={run_dir}", "run.steps=2", "sft.steps=4", "sft.optimizer.warmup_steps=1",
        "sft.num_tasks=64",
        "batch.groups_per_batch=4", "eval.num_tasks=8", "eval.every_steps=1",
        "run.export_hf=false", "run.plot=false", "parallel.threads=1",
    ]  # fmt: skip
    assert cli_main(["train", DEMO, "--no-progress", *(a for o in overrides for a in ("--set", o))]) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)


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
