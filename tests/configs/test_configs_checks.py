"""Every config is checked before anything starts, against the machine and against its other
fields (one line naming the field and the rule, exit code 2, no run directory, no SFT), and a run
that cannot learn stops with exit code 1 instead of finishing "successfully"."""

from __future__ import annotations

import math
from types import SimpleNamespace

import gymnasium
import pytest
import torch
from sandbox_testlib import make_env

from toolgym.configs.assembly.parts import (
    build_policy,
    build_renderer,
    check_model,
    initial_model,
    model_config,
)
from toolgym.configs.checks import (
    check_against_machine,
    check_context,
    check_environment,
    first_prompt_length,
    kv_cache_bytes,
)
from toolgym.configs.cli.main import main
from toolgym.configs.load import ConfigError, config_from_dict, load_config
from toolgym.envs import ZorplexEnv
from toolgym.trainers.loop.rl import NoLearningError, RLLoop, no_learning_cause
from toolgym.trainers.metrics_log import read_metrics

CPU_PRESETS = ["zorplex_tiny", "sum_digits_tiny", "zorplex_compositional_tiny", "zorplex_recursive_tiny"]


def refused(tmp_path, capsys, *overrides: str) -> str:
    """The one line `toolgym train` prints refusing the CPU demo with `overrides` (exit code 2,
    no run directory)."""
    run_dir = tmp_path / "run"
    args = ["train", "--no-progress", "--set", f"run.run_dir={run_dir}"]
    for item in overrides:
        args += ["--set", item]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1, err
    assert "sft:" not in out  # refused before the SFT phase
    assert not run_dir.exists()
    return err.strip()


# ---- sizes that cannot be allocated ----------------------------------------------------------------


@pytest.mark.parametrize("sft", ["true", "false"])
def test_a_kv_cache_larger_than_the_machine_is_one_line_before_anything_starts(tmp_path, capsys, sft):
    # it used to be an allocator traceback (with SFT on, after the whole SFT phase) and a run dir
    err = refused(tmp_path, capsys, f"sft.enabled={sft}", "policy.max_batch_size=1000000000")
    assert err.startswith("config error: policy.max_batch_size: must keep the KV cache within "), err
    config, _ = load_config(None, ["policy.max_batch_size=1000000000"])
    needed = kv_cache_bytes(config, model_config(config))
    assert f"need {needed:,} bytes" in err
    for field in ("policy.max_batch_size", "policy.max_seq_len", "policy.history_capacity"):
        assert field in err


def test_a_lora_rank_above_the_hidden_size_is_refused_before_anything_starts(tmp_path, capsys):
    # it used to be accepted: a 290 MB adapter on the tiny model and 40 s steps
    err = refused(tmp_path, capsys, "policy.lora.rank=2048")
    assert err.startswith("config error: policy.lora.rank: must be <= the model's hidden_size (256), got 2048"), err
    refused_nothing = load_config(None, ["policy.lora.rank=256"])[0]  # the hidden size itself is allowed
    check_model(refused_nothing, model_config(refused_nothing), build_renderer(refused_nothing)[0])


@pytest.mark.parametrize("text", ["not json", '{"version": "1.0"}'])
def test_a_tokenizer_file_that_is_not_a_tokenizer_is_a_config_error(tmp_path, capsys, text):
    bad = tmp_path / "tokenizer.json"
    bad.write_text(text)
    err = refused(tmp_path, capsys, f'tokenizer.path="{bad}"')
    assert err.startswith(f"config error: tokenizer.path: could not load tokenizer from {bad}"), err


def test_an_oversized_history_pool_names_its_own_field(tmp_path, capsys):
    err = refused(tmp_path, capsys, "sft.enabled=false", "policy.history_capacity=100000000000000")
    assert err.startswith("config error: policy.history_capacity: must keep the KV cache within "), err


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("policy.max_batch_size=100000000000000000000000000000", "policy.max_batch_size"),
        ("run.steps=100000000000000000000000000000", "run.steps"),
        ("env.kwargs={tier='simple', x=-100000000000000000000}", "env.kwargs.x"),
    ],
)
def test_integers_beyond_64_bits_are_refused_at_load_time(override, field, capsys):
    # "Overflow when unpacking long long", after setup, used to be the message
    assert main(["train", "--set", "sft.enabled=false", "--set", override, "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"config error: {field}: must fit in 64 bits"), err


def test_the_kv_cache_estimate_is_what_the_engine_allocates():
    for extra in (
        [],
        ["policy.history_capacity=0"],
        ["policy.history_capacity=1000"],
        ["model.dtype=bfloat16"],
    ):
        config, _ = load_config("zorplex_tiny", ["model.name=test", "policy.max_batch_size=8", *extra])
        renderer, _ = build_renderer(config)
        with build_policy(config, initial_model(config), None, renderer, torch.device("cpu")) as engine:
            assert kv_cache_bytes(config, model_config(config)) == engine.cache.nbytes, extra


@pytest.mark.parametrize("name", CPU_PRESETS)
def test_every_cpu_preset_passes_the_checks_against_the_machine(name):
    config, _ = load_config(name)
    renderer, _ = build_renderer(config)
    check_against_machine(config, model_config(config), renderer, torch.device("cpu"))


# ---- a context too small for the env's first prompt -------------------------------------------------


@pytest.mark.parametrize("sft", ["true", "false"])
def test_a_context_that_cannot_hold_the_first_prompt_is_refused(tmp_path, capsys, sft):
    # with SFT: "the SFT demonstrations give no trainable episodes", no field named; without:
    # 6 steps on 0 tokens and exit 0
    err = refused(tmp_path, capsys, f"sft.enabled={sft}", "rollout.context_length=40")
    assert err.startswith("config error: rollout.context_length: must be >= "), err
    assert "to hold the env's first prompt (" in err and "rollout.max_tokens_per_turn = 16" in err
    assert err.endswith("got 40")
    err = refused(tmp_path, capsys, f"sft.enabled={sft}", "policy.max_seq_len=40")
    assert err.startswith("config error: policy.max_seq_len: must be >= "), err


def test_the_context_rule_is_the_first_prompt_plus_one_turn():
    config, _ = load_config("zorplex_tiny")
    renderer, _ = build_renderer(config)
    model = model_config(config)
    prompt, _ = first_prompt_length(config, renderer, config.env.kwargs)
    need = prompt + config.rollout.max_tokens_per_turn
    fits, _ = load_config("zorplex_tiny", [f"rollout.context_length={need}"])
    check_context(fits, model, renderer)
    short, _ = load_config("zorplex_tiny", [f"rollout.context_length={need - 1}"])
    with pytest.raises(ConfigError, match=rf"rollout.context_length: must be >= {need} .* got {need - 1}$"):
        check_context(short, model, renderer)
    # a context longer than the policy's changes nothing: the policy's is the one to raise
    too_long, _ = load_config("zorplex_tiny", ["policy.max_seq_len=64", "rollout.context_length=200"])
    with pytest.raises(ConfigError, match=r"^config error: policy.max_seq_len: must be >= "):
        check_context(too_long, model, renderer)


# ---- fields that contradict each other ---------------------------------------------------------------


@pytest.mark.parametrize("dynamic", ["true", "false"])
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_a_group_of_one_with_a_group_relative_estimator_is_refused(tmp_path, capsys, dynamic, estimator):
    # every step "groups 0", the policy never changed, exit 0
    err = refused(
        tmp_path, capsys, "rollout.group_size=1", f"batch.dynamic_sampling={dynamic}",
        f"batch.advantage.estimator={estimator}",
    )  # fmt: skip
    assert err.startswith(
        f"config error: rollout.group_size: must be >= 2 with batch.advantage.estimator = '{estimator}'"
    ), err
    assert err.endswith("got 1") and ("dynamic_sampling drops" in err) == (dynamic == "true")
    assert main(["train", "--set", "rollout.group_size=1", "--print-config"]) == 2  # at load time


def test_route_replay_needs_the_torch_engine(tmp_path, capsys):
    err = refused(tmp_path, capsys, "trainer.replay_routes=true", "policy.backend=vllm")
    assert err == (
        "config error: trainer.replay_routes: replays the routes the torch engine records: needs "
        "policy.backend = 'torch', got 'vllm'"
    ), err


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"eval": {"num_tasks": 0}}, "config error: eval.num_tasks: must be >= 1, got 0"),
        ({"eval": {"samples_per_task": 0}}, "config error: eval.samples_per_task: must be >= 1, got 0"),
        ({"eval": {"num_examples": -1}}, "config error: eval.num_examples: must be >= 0, got -1"),
        (
            {"eval": {"num_tasks": 2**21}},
            "config error: eval.num_tasks: must be <= 1048576 (the held-out seeds), got 2097152",
        ),
        (
            {"batch": {"advantage": {"overlong": {"max_length": 4, "cache_length": 8}}}},
            "config error: batch.advantage.overlong: needs 0 < cache_length <= max_length, "
            "got cache_length=8, max_length=4",
        ),
        (
            {"model": {"path": "x", "overrides": {"num_hidden_layers": 1}}},
            "config error: model.overrides: must be empty with model.path (they apply to a named config)",
        ),
        (
            {"sft": {"enabled": True, "source": "recording"}},
            'config error: sft.recording: must name a `toolgym record` file when sft.source = "recording"',
        ),
        (
            {"run": {"max_steps_without_learning": -1}},
            "config error: run.max_steps_without_learning: must be >= 0",
        ),
    ],
)
def test_section_checks_name_the_field_and_the_rule_not_a_repr(raw, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert str(info.value).startswith(message), str(info.value)
    assert "Config(" not in str(info.value) and "bad " not in str(info.value)


def test_eval_num_tasks_zero_from_the_cli(capsys):
    # it was "config error: eval: bad EvalConfig: EvalConfig(num_tasks=0, ...)"
    assert main(["train", "--set", "eval.num_tasks=0", "--print-config"]) == 2
    assert capsys.readouterr().err.strip() == "config error: eval.num_tasks: must be >= 1, got 0"


# ---- a run that cannot learn stops --------------------------------------------------------------------


def small_run(run_dir, *extra: str) -> list[str]:
    return [
        "train", "--no-progress", "--set", f"run.run_dir={run_dir}", "--set", "sft.enabled=false",
        "--set", "model.name=test", "--set", "model.overrides={vocab_size=1024}",
        "--set", "policy.max_batch_size=16", "--set", "rollout.group_size=2",
        "--set", "batch.groups_per_batch=2", "--set", "eval.at_start=false", "--set", "eval.at_end=false",
        "--set", "eval.every_steps=0", "--set", "run.export_hf=false", "--set", "run.plot=false",
        "--set", "run.steps=20", "--set", "run.max_steps_without_learning=3",
        *(a for item in extra for a in ("--set", item)),
    ]  # fmt: skip


@pytest.mark.slow
def test_a_run_whose_every_group_is_dropped_stops_with_exit_code_1(tmp_path, capsys):
    # a constant reward (every reward knob of the env at 0): every group has zero variance and
    # dynamic sampling drops it, step after step; it used to run every step and exit 0
    run_dir = tmp_path / "run"
    knobs = ("correct_reward", "format_reward", "incorrect_reward", "tool_call_penalty", "error_penalty")
    extra = ["env.kwargs={tier='simple', " + ", ".join(f"{k}=0.0" for k in knobs) + "}"]
    extra += ["rollout.max_tokens_per_turn=4", "batch.dynamic_sampling=true", "batch.max_extra_rounds=0"]
    assert main(small_run(run_dir, *extra)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the run cannot learn: 3 steps in a row"), err
    assert "batch.dynamic_sampling dropped every group" in err[0] and "reward mean 0.000" in err[0]
    assert "run.max_steps_without_learning = 3" in err[0]
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3]
    assert not (run_dir / "summary.json").exists()  # it did not finish "successfully"


@pytest.mark.slow
def test_a_run_whose_every_update_is_skipped_stops_with_exit_code_1(tmp_path, capsys, monkeypatch):
    from toolgym.trainers.trainer import Trainer

    # a non-finite gradient every step (what a diverged model gives): every update is skipped
    monkeypatch.setattr(Trainer, "_clip_grad_norm", lambda self: math.nan)
    run_dir = tmp_path / "run"
    assert main(small_run(run_dir)) == 1
    err = capsys.readouterr().err
    assert "error: the run cannot learn: 3 steps in a row" in err
    assert "the update was skipped (non-finite loss or gradient)" in err
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["train/skipped"] == 1.0 for r in records)


def test_the_count_is_of_steps_in_a_row_and_names_the_cause():
    assert (
        no_learning_cause({"train/episodes": 4.0, "batch/sampled_tokens": 10.0, "train/skipped": 0.0}) is None
    )
    zero = {"train/episodes": 4.0, "batch/sampled_tokens": 0.0}
    zero_cause = "0 trainable tokens (no sampled token in any episode)"
    assert no_learning_cause(zero) == zero_cause
    assert "dropped every group" in (no_learning_cause({"train/episodes": 0.0}) or "")
    # every group dropped for one reward after the run has learned: a converged policy, not counted
    assert no_learning_cause({"train/episodes": 0.0}, updated_before=True) is None
    # every group dropped for having no trainable token: counted, whatever came before
    none_trainable = {"train/episodes": 0.0, "dynamic_sampling/groups_rolled_out": 4.0}
    none_trainable["batch/groups_without_trainable"] = 4.0
    assert no_learning_cause(none_trainable, updated_before=True) == zero_cause
    loop = SimpleNamespace(
        settings=SimpleNamespace(max_steps_without_learning=2),
        step=0, steps_without_learning=0, _no_learning_cause="", trainer=SimpleNamespace(step=0),
    )  # fmt: skip
    learned = {"train/episodes": 4.0, "batch/sampled_tokens": 10.0}
    for metrics in (zero, learned, zero, learned):  # never two in a row
        loop.step += 1
        RLLoop._check_learning(loop, metrics)  # type: ignore[arg-type]
    loop.step += 1
    RLLoop._check_learning(loop, zero)  # type: ignore[arg-type]
    with pytest.raises(NoLearningError, match=r"2 steps in a row \(up to step 6\).*0 trainable tokens"):
        loop.step += 1
        RLLoop._check_learning(loop, zero)  # type: ignore[arg-type]
    loop.settings.max_steps_without_learning = 0  # never stops
    for _ in range(10):
        RLLoop._check_learning(loop, zero)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.max_turns=1", "config error: rollout.max_turns: every sampled SFT demonstration of "
         "toolgym/Zorplex-v0 is cut short (max_turns); they need rollout.max_turns >= 2 (it is 1)"),
        ("rollout.max_tokens_per_turn=4", "config error: rollout.max_tokens_per_turn: every sampled SFT "
         "demonstration of toolgym/Zorplex-v0 is cut short (max_tokens); they need rollout.max_tokens_per_turn >= "),
    ],
)  # fmt: skip
def test_limits_that_cut_every_sft_demonstration_short_are_refused_before_the_run(tmp_path, capsys, override, message):
    """SFT used to train for minutes on nothing but cut-off demonstrations (their accuracy 0.00)."""
    run_dir = tmp_path / "run"
    assert main(["train", "zorplex_tiny", "--set", f"run.run_dir={run_dir}", "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1, err
    assert not run_dir.exists()


def test_the_pycalc_preset_passes_the_checks_against_the_machine():
    config, _ = load_config("pycalc_tiny")
    assert config.run.name == "pycalc_tiny" and config.sft.oracle.p_skip_lookup == 0.5
    make_env(config.env.id, **config.env.kwargs)  # skipped where its code sandbox cannot start
    renderer, _ = build_renderer(config)
    check_against_machine(config, model_config(config), renderer, torch.device("cpu"))


class ZeroWindowZorplex(ZorplexEnv):
    """An env declaring a window of 0 turns (it used to fail every episode, and the run went on)."""

    def __init__(self, **knobs):
        super().__init__(**knobs)
        self.context_policy = {"policy": "window", "turns": 0}


gymnasium.register("test/ZeroWindowZorplex-v0", entry_point=ZeroWindowZorplex)


def test_an_env_declared_context_policy_that_cannot_build_stops_the_run_before_it_starts(tmp_path, capsys):
    err = refused(tmp_path, capsys, 'env.id="test/ZeroWindowZorplex-v0"', "env.kwargs={tier='simple'}")
    assert err.startswith("config error: env: 'test/ZeroWindowZorplex-v0' declares context_policy"), err
    assert "turns" in err and not (tmp_path / "run").exists()
    # the config's own policy wins over the env's: nothing to refuse then
    config, _ = load_config(None, ['env.id="test/ZeroWindowZorplex-v0"', 'rollout.context={policy="keep_all"}'])
    check_environment(config)


def test_a_notes_policy_on_an_env_without_the_note_tool_is_refused(tmp_path, capsys):
    err = refused(tmp_path, capsys, 'rollout.context={policy="notes"}')
    assert err.startswith("config error: rollout.context: the notes policy keeps the turns that wrote a note, but "), err
    assert "no NOTE tool" in err
    config, _ = load_config("zorplex_notes_tiny", [])  # the notes preset has the tool
    check_environment(config)


def test_an_unknown_context_policy_names_the_known_ones(tmp_path, capsys):
    err = refused(tmp_path, capsys, 'rollout.context={policy="lru"}')
    assert err == (
        "config error: rollout.context.policy: invalid value 'lru' "
        "(expected one of 'keep_all', 'window', 'elide', 'notes')"
    ), err


def test_an_elide_policy_that_cannot_bound_the_notes_chain_is_named_as_the_cause(tmp_path, capsys):
    # it blamed policy.max_seq_len alone
    args = ["train", "zorplex_notes_tiny", "--no-progress", "--set", f"run.run_dir={tmp_path / 'run'}"]
    assert main([*args, "--set", 'rollout.context={policy="elide"}']) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: rollout.context: every sampled SFT demonstration"), err
    assert "under the 'elide' policy" in err and "window, notes" in err and "policy.max_seq_len >=" in err


class NoOracleZorplex(ZorplexEnv):
    def oracle_actions(self) -> list[str]:
        raise NotImplementedError("this env has no oracle")


gymnasium.register("test/NoOracleZorplex-v0", entry_point=NoOracleZorplex)


def test_guided_samples_need_the_env_runner_and_an_oracle(tmp_path, capsys):
    err = refused(tmp_path, capsys, 'env.id="test/NoOracleZorplex-v0"', "rollout.guided_samples=1")
    assert err == (
        "config error: rollout.guided_samples: needs the env's oracle, and 'test/NoOracleZorplex-v0' "
        "gave none: NotImplementedError: this env has no oracle"
    ), err
    err = refused(tmp_path, capsys, "rollout.guided_samples=8")
    assert err.startswith("config error: rollout.guided_samples: must be in [0, group_size=8)"), err
    config, _ = load_config("zorplex_tiny", ["rollout.guided_samples=1"])
    check_environment(config)
