"""Turn-level credit from a config: `batch.advantage.credit` and `gamma` load, are validated as
one-line config errors, reach the batch source, and a run with them trains end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolgym.configs.checks import check_environment
from toolgym.configs.cli.main import main
from toolgym.configs.cli.train import train
from toolgym.configs.load import ConfigError, config_from_dict, load_config
from toolgym.rollouts.scoring.advantages import Credit
from toolgym.trainers.metrics_log import read_metrics


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return str(info.value)


@pytest.mark.parametrize("preset", ["zorplex_recursive_tiny", "zorplex_tiny", "zorplex_chain_credit_tiny"])
def test_a_preset_with_turn_loo_loads_and_passes_the_checks(preset):
    config, _ = load_config(preset, ["batch.advantage.credit=turn_loo", "batch.advantage.gamma=0.9"])
    assert config.batch.advantage.credit is Credit.TURN_LOO and config.batch.advantage.gamma == 0.9
    check_environment(config)
    default, _ = load_config(preset)
    assert default.batch.advantage.credit is Credit.OUTCOME and default.batch.advantage.gamma == 1.0


def test_credit_and_gamma_errors_name_the_field_and_the_choices():
    assert error_of({"batch": {"advantage": {"credit": "td"}}}) == (
        "config error: batch.advantage.credit: invalid value 'td' (expected one of 'outcome', 'turn_loo', "
        "'turn_state')"
    )
    assert error_of({"batch": {"advantage": {"credit": "turn_loo", "gamma": 0.0}}}) == (
        "config error: batch.advantage.gamma: must be in (0, 1], got 0.0"
    )
    assert error_of({"batch": {"advantage": {"credit": "turn_loo", "gamma": 1.5}}}) == (
        "config error: batch.advantage.gamma: must be in (0, 1], got 1.5"
    )
    assert error_of({"batch": {"advantage": {"gamma": 0.9}}}).startswith(
        "config error: batch.advantage.gamma: must be 1 with credit = 'outcome'"
    )
    assert error_of(
        {"rollout": {"group_size": 1}, "batch": {"advantage": {"credit": "turn_loo"}}}
    ).startswith("config error: rollout.group_size: must be >= 2 with batch.advantage.credit = 'turn_loo'")


def test_cli_refuses_an_unknown_credit_with_exit_code_2(capsys):
    assert main(["train", "zorplex_tiny", "--set", "batch.advantage.credit=nope", "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "batch.advantage.credit: invalid value 'nope'" in err
    assert main(["train", "zorplex_tiny", "--set", "batch.advantage.credit=turn_loo", "--print-config"]) == 0
    assert 'credit = "turn_loo"' in capsys.readouterr().out


@pytest.mark.slow
def test_a_turn_loo_run_trains_and_logs_turn_returns(tmp_path: Path):
    run_dir = tmp_path / "run"
    raw = {
        "run": {"steps": 2, "run_dir": str(run_dir), "plot": False, "export_hf": False},
        "env": {"kwargs": {"tier": "recursive", "difficulty": "easy", "max_turns": 4, "chain_reward": 0.1}},
        "model": {"name": "test", "overrides": {"vocab_size": 1024}},
        "policy": {"max_batch_size": 16, "max_seq_len": 256},
        "rollout": {"group_size": 2, "max_turns": 4, "max_tokens_per_turn": 8, "max_tokens_per_episode": 32},
        "batch": {"groups_per_batch": 2, "advantage": {"estimator": "dr_grpo", "credit": "turn_loo"}},
        "eval": {"every_steps": 0, "at_start": False, "num_tasks": 2, "num_examples": 0, "record": False},
        "checkpoint": {"every_steps": 0},
        "logging": {"progress_bar": False},
    }
    assert train(config_from_dict(raw)) == 0
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["credit/reached_turn0"] == 1.0 and "credit/return_turn0_mean" in r


def test_the_credit_demo_preset_runs_its_three_arms_from_one_file():
    # bench/credit_demo.py's arms: the preset, then turn_loo, then turn_loo with the chain reward
    outcome, _ = load_config("zorplex_chain_credit_tiny")
    assert outcome.batch.advantage.credit is Credit.OUTCOME and outcome.batch.advantage.estimator == "dr_grpo"
    assert outcome.env.kwargs["tier"] == "recursive" and outcome.env.kwargs["difficulty"] == "hard"
    dense, _ = load_config(
        "zorplex_chain_credit_tiny", ["batch.advantage.credit=turn_loo", "env.kwargs.chain_reward=0.1"]
    )
    check_environment(dense)
    assert dense.env.kwargs["chain_reward"] == 0.1 and dense.env.kwargs["difficulty"] == "hard"


def test_the_four_link_chain_preset_loads_with_every_arm_of_the_demo():
    # bench/credit_demo.py --preset zorplex_chain4_credit_tiny: five lookups, and a turn_state arm
    outcome, _ = load_config("zorplex_chain4_credit_tiny")
    assert outcome.env.kwargs["redirects"] == 4 and outcome.rollout.max_turns == 7
    for arm in (
        ["batch.advantage.credit=turn_loo", "env.kwargs.chain_reward=0.1"],
        ["batch.advantage.credit=turn_state"],
    ):
        config, _ = load_config("zorplex_chain4_credit_tiny", arm)
        check_environment(config)
    assert config.batch.advantage.credit is Credit.TURN_STATE


def test_the_list_credit_preset_loads_with_every_arm_of_the_demo():
    # bench/credit_demo.py --preset zorplex_list_credit_tiny: outcome, turn_loo, turn_loo with the
    # per-lookup reward, the reward with outcome credit; the demonstrator errs per lookup
    outcome, _ = load_config("zorplex_list_credit_tiny")
    assert outcome.batch.advantage.credit is Credit.OUTCOME and outcome.env.kwargs["tier"] == "list"
    assert outcome.sft.oracle.p_wrong_lookup == 0.15
    for arm in (
        ["batch.advantage.credit=turn_loo", "env.kwargs.chain_reward=0.2"],
        ["env.kwargs.chain_reward=0.2"],
    ):
        config, _ = load_config("zorplex_list_credit_tiny", arm)
        check_environment(config)
        assert config.env.kwargs["chain_reward"] == 0.2 and config.env.kwargs["difficulty"] == "easy"
