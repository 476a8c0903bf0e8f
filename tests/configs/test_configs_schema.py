"""Run configs: presets parse, `--set` overrides, one-line errors naming the field, and the CLI
refusing a bad config with exit code 2 before anything starts."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec
import pytest

from toolgym.configs.assembly.demos import sft_trainer_config
from toolgym.configs.checks import check_environment
from toolgym.configs.cli.main import main
from toolgym.configs.load import (
    ConfigError,
    apply_overrides,
    config_from_dict,
    config_to_toml,
    load_config,
    parse_value,
    preset_names,
    resolve_config_path,
)
from toolgym.configs.schema import Config
from toolgym.rollouts.context import KeepAll, Notes, SlidingWindow
from toolgym.rollouts.scoring.advantages import AdvantageEstimator

PRESETS = [
    "zorplex_tiny",
    "sum_digits_tiny",
    "zorplex_compositional_tiny",
    "zorplex_recursive_tiny",
    "selfplay_tiny",
    "selfplay_tictactoe_tiny",
    "qwen2.5_0.5b_vllm",
]


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return str(info.value)


@pytest.mark.parametrize("name", PRESETS)
def test_every_shipped_preset_parses_and_round_trips(name):
    assert name in preset_names()
    config, _ = load_config(name)
    assert config.run.name == name
    again = config_from_dict(tomllib.loads(config_to_toml(config)))
    assert msgspec.to_builtins(again) == msgspec.to_builtins(config)


def test_cpu_presets_pass_the_environment_checks():
    for name in PRESETS[:-1]:
        config, _ = load_config(name)
        check_environment(config)
        assert config.policy.backend == "torch" and config.sft.enabled


def test_gpu_preset_says_it_is_not_runnable_here():
    path = resolve_config_path("qwen2.5_0.5b_vllm")
    head = path.read_text().splitlines()[0]
    assert "NOT RUNNABLE ON THE CPU MACHINE" in head
    config, _ = load_config("qwen2.5_0.5b_vllm")
    assert config.policy.backend == "vllm" and config.model.path and config.parallel.device == "cuda"


def test_the_cpu_demo_is_the_default_and_the_presets_reproduce_the_issue_shape():
    config, _ = load_config(None)
    assert config.run.name == "zorplex_tiny"
    assert config.env.kwargs == {"tier": "simple"} and config.model.name == "tiny"
    assert config.sft.enabled and config.sft.source == "oracle" and config.sft.oracle.p_omit_tag == 0.5
    assert config.trainer.loss.name in ("grpo", "dapo")


def test_preset_names_and_paths_resolve(tmp_path):
    assert resolve_config_path("zorplex_tiny") == resolve_config_path("zorplex_tiny.toml")
    own = tmp_path / "mine.toml"
    own.write_text("[run]\nsteps = 3\n")
    config, _ = load_config(own)
    assert config.run.steps == 3 and config.run.name == "mine"
    with pytest.raises(ConfigError, match="no config file or preset 'nope'"):
        resolve_config_path("nope")


def test_parse_value_is_toml_with_a_string_fallback():
    assert parse_value("3") == 3 and parse_value("1e-4") == 1e-4 and parse_value("true") is True
    assert parse_value('"x"') == "x" and parse_value("[1, 2]") == [1, 2]
    assert parse_value("{tier = 'simple'}") == {"tier": "simple"}
    assert parse_value('{"tier": "compositional", "difficulty": "easy"}') == {
        "tier": "compositional",
        "difficulty": "easy",
    }  # JSON, as `toolgym record --env-kwargs` takes it
    assert parse_value("[0.9, 0.95]") == [0.9, 0.95] and parse_value("{tier: simple}") == "{tier: simple}"
    assert parse_value("toolgym/SumDigits-v0") == "toolgym/SumDigits-v0"


def test_parse_value_takes_floats_toml_refuses_but_not_non_finite_ones():
    # TOML needs digits on both sides of the point; these used to stay strings ("expected float")
    assert parse_value(".001") == 0.001 and parse_value("1.") == 1.0 and parse_value("-.5e-3") == -5e-4
    assert parse_value("NaN") == "NaN" and parse_value("Infinity") == "Infinity"
    config, _ = load_config("zorplex_tiny", ["trainer.optimizer.lr=.001", "sft.optimizer.lr=1."])
    assert config.trainer.optimizer.lr == 0.001 and config.sft.optimizer.lr == 1.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.optimizer.lr=nan", "config error: trainer.optimizer.lr: must be a finite number, got nan"),
        ("trainer.optimizer.lr=inf", "config error: trainer.optimizer.lr: must be a finite number, got inf"),
        ("policy.top_p=-inf", "config error: policy.top_p: must be a finite number, got -inf"),
        ("trainer.optimizer.betas=[0.9, nan]", "config error: trainer.optimizer.betas: must be a finite"),
        ("rollout.episode_timeout_s=nan", "config error: rollout.episode_timeout_s: must be a finite"),
        ("env.kwargs={tier='simple', x=nan}", "config error: env.kwargs.x: must be a finite number"),
    ],
)
def test_non_finite_numbers_are_refused_at_load_time(override, message, capsys):
    # `nan <= 0` is False: a nan learning rate passed every check and trained on nan
    assert main(["train", "zorplex_tiny", "--set", override, "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(message) and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("key", ["trainer.optimizer.lr", "sft.optimizer.lr"])
def test_a_learning_rate_that_would_destroy_the_weights_is_refused(key, capsys):
    # lr = 1e30 used to train to "done": every weight moved by ~1e30 on the first update
    assert main(["train", "zorplex_tiny", "--set", f"{key}=1e30", "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"config error: {key}: ") and "must be in (0, 1], got 1e+30" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["train", "zorplex_tiny", "--set", f"{key}=1.0", "--print-config"]) == 0


def test_overrides_set_nested_keys_and_keep_the_rest():
    raw = {"rollout": {"group_size": 8, "max_turns": 4}}
    out = apply_overrides(
        raw, ["rollout.group_size=4", "trainer.loss.name=dapo", "env.kwargs={tier='simple'}"]
    )
    assert out["rollout"] == {"group_size": 4, "max_turns": 4}
    assert out["trainer"]["loss"]["name"] == "dapo" and out["env"]["kwargs"] == {"tier": "simple"}
    assert raw["rollout"]["group_size"] == 8  # a copy
    config, _ = load_config("zorplex_tiny", ["rollout.group_size=4", "trainer.optimizer.lr=3e-4"])
    assert config.rollout.group_size == 4 and config.trainer.optimizer.lr == 3e-4
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["rollout.group_size"])
    with pytest.raises(ConfigError, match=r"rollout\.group_size: is a value, not a table"):
        apply_overrides(raw, ["rollout.group_size.x=1"])


def test_setting_a_tagged_tables_tag_switches_the_variant_and_drops_the_old_fields():
    # the notes preset's table is {policy = "notes", keep_last = 1}; keep_last is unknown to "window"
    config, _ = load_config("zorplex_notes_tiny", ["rollout.context.policy=window", "rollout.context.turns=2"])
    assert config.rollout.context == SlidingWindow(turns=2)
    config, _ = load_config("zorplex_notes_tiny", ["rollout.context.policy=keep_all"])
    assert config.rollout.context == KeepAll()
    # the same tag again keeps the table; a field set before a new tag is dropped with the old variant
    config, _ = load_config("zorplex_notes_tiny", ["rollout.context.policy=notes", "rollout.context.keep_last=2"])
    assert config.rollout.context == Notes(keep_last=2)
    out = apply_overrides({"rollout": {"context": {"policy": "notes", "keep_last": 3}}},
                          ["rollout.context.turns=2", "rollout.context.policy=window"])  # fmt: skip
    assert out["rollout"]["context"] == {"policy": "window"}
    # an ordinary key that shares a tag field's name elsewhere is just set
    assert apply_overrides({"env": {"kwargs": {"policy": "a", "x": 1}}}, ["env.kwargs.policy=b"]) == {
        "env": {"kwargs": {"policy": "b", "x": 1}}
    }


def test_errors_are_one_line_naming_the_field():
    assert (
        error_of({"rollout": {"group_size": "8"}})
        == "config error: rollout.group_size: expected int, got str"
    )
    assert error_of({"rollout": {"gruop_size": 8}}).startswith(
        "config error: rollout.gruop_size: unknown key (rollout keys: context, context_length,"
    )
    assert error_of({"rollouts": {}}).startswith(
        "config error: rollouts: unknown key (sections: agent_program, batch,"
    )
    # inside reused component Structs that would otherwise ignore unknown keys
    assert error_of({"policy": {"vllm": {"gpu_mem": 0.5}}}).startswith(
        "config error: policy.vllm.gpu_mem: unknown key"
    )
    assert error_of({"batch": {"advantage": {"estimater": "grpo"}}}).startswith(
        "config error: batch.advantage.estimater: unknown key"
    )
    assert error_of({"trainer": {"loss": {"name": "ppo"}}}) == (
        "config error: trainer.loss.name: invalid value 'ppo' (expected one of 'cispo', 'dapo', 'grpo', 'gspo', 'reinforce')"
    )
    assert "expected one of 'grpo', 'dr_grpo'" in error_of({"batch": {"advantage": {"estimator": "x"}}})
    assert error_of({"trainer": {"optimizer": {"lr": [1]}}}) == (
        "config error: trainer.optimizer.lr: expected float, got array"
    )
    # a component's own validation, as one line naming the key
    assert error_of({"batch": {"groups_per_batch": 0}}) == (
        "config error: batch.groups_per_batch: must be >= 1, got 0"
    )
    assert error_of({"sft": {"oracle": {"p_omit_tag": 1.5}}}).startswith(
        "config error: sft.oracle.p_omit_tag: must be"
    )
    assert error_of({"batch": {"advantage": {"eps": -1.0}}}).startswith(
        "config error: batch.advantage.eps: must be"
    )
    assert error_of({"run": {"seed": -1}}) == "config error: run.seed: must be >= 0, got -1"
    assert error_of({"policy": {"temperature": 0.7}, "trainer": {"temperature": 1.0}}).startswith(
        "config error: trainer.temperature (1.0) must equal policy.temperature (0.7)"
    )  # the deprecated key, still checked
    for message in (error_of({"rollout": {"group_size": 0}}), error_of({"eval": {"num_tasks": 0}})):
        assert "\n" not in message


def test_derived_defaults_follow_the_values_they_copy():
    config = config_from_dict({"policy": {"temperature": 0.7}, "run": {"steps": 30}, "sft": {"steps": 12}})
    assert config.policy.temperature == 0.7 and not hasattr(config.trainer, "temperature")  # one place
    assert config.trainer.optimizer.total_steps == 30 and config.sft.optimizer.total_steps == 12
    assert config.sft.optimizer.lr == 1e-3
    explicit = config_from_dict({"sft": {"optimizer": {"lr": 5e-4, "total_steps": 7}}})
    assert explicit.sft.optimizer.lr == 5e-4 and explicit.sft.optimizer.total_steps == 7


def test_components_get_their_configs():
    config = config_from_dict(
        {
            "env": {"kwargs": {"tier": "compositional"}},
            "policy": {"temperature": 0.9, "top_k": 5},
            "run": {"seed": 3},
        }
    )
    rollout = config.rollout_config()
    assert rollout.env_kwargs == {"tier": "compositional"} and rollout.sampling.temperature == 0.9
    assert (
        rollout.sampling.top_k == 5 and rollout.seed == 3 and rollout.group_size == config.rollout.group_size
    )
    assert config.batch.advantage.estimator is AdvantageEstimator.GRPO
    assert config.eval.to_eval_config().num_tasks == config.eval.num_tasks
    assert isinstance(Config(), Config)


def test_sft_takes_the_trainer_settings_with_its_own_optimizer_and_precision():
    config = config_from_dict({"trainer": {"precision": "bf16", "micro_batch_tokens": 4096}})
    sft = sft_trainer_config(config)
    assert (
        sft.precision == "bf16" and sft.micro_batch_tokens == 4096 and sft.optimizer == config.sft.optimizer
    )
    config = config_from_dict({"sft": {"precision": "bf16", "micro_batch_tokens": 2048}})
    sft = sft_trainer_config(config)
    assert config.trainer.precision == "fp32" and sft.precision == "bf16" and sft.micro_batch_tokens == 2048
    with pytest.raises(ConfigError, match=r"sft\.precision"):
        config_from_dict({"sft": {"precision": "fp16"}})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("context_length", 1, "config error: rollout.context_length: must be >= 2, got 1"),
        ("episode_timeout_s", 0.0, "config error: rollout.episode_timeout_s: must be > 0, got 0.0"),
        ("episode_timeout_s", -1.0, "config error: rollout.episode_timeout_s: must be > 0, got -1.0"),
        ("max_turns", 0, "config error: rollout.max_turns: must be >= 1, got 0"),
        ("max_concurrent_episodes", 0, "config error: rollout.max_concurrent_episodes: must be >= 1, got 0"),
    ],
)
def test_rollout_section_refuses_at_load_time_what_the_rollout_config_would_refuse(
    key, value, message, capsys
):
    assert error_of({"rollout": {key: value}}) == message
    # --print-config checks it too: nothing is printed, exit 2 (it used to fail after setup)
    assert main(["train", "sum_digits_tiny", "--set", f"rollout.{key}={value}", "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == message


def test_the_rollout_config_a_run_builds_is_the_one_validated():
    config = config_from_dict({"rollout": {"context_length": 2, "episode_timeout_s": 0.5}})
    rollout = config.rollout_config({"tier": "simple"})
    assert rollout.context_length == 2 and rollout.episode_timeout_s == 0.5
    assert rollout.env_id == config.env.id and rollout.env_kwargs == {"tier": "simple"}
    assert config.rollout_config().env_kwargs == config.env.kwargs


@pytest.mark.parametrize("setting", ["cuda_graphs", "fused_layers"])
@pytest.mark.parametrize("on", [True, False])
def test_policy_gpu_settings_reach_the_engine(setting, on):
    import torch

    from toolgym.configs.assembly.parts import build_policy, build_renderer, initial_model

    config, _ = load_config("zorplex_tiny", ["model.name=test", f"policy.{setting}={str(on).lower()}"])
    assert getattr(config.policy, setting) is on
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    renderer, _ = build_renderer(config)
    engine_attribute = {"cuda_graphs": "cuda_graphs", "fused_layers": "fused"}[setting]
    with build_policy(config, initial_model(config), None, renderer, device) as engine:
        # never asked for on CPU
        assert getattr(engine, engine_attribute) is (on and device.type == "cuda")


@pytest.mark.parametrize(("setting", "positions"), [(None, 128 * 256), (0, 0), (1000, 1000)])
def test_policy_history_capacity_reaches_the_engine(setting, positions):
    import torch

    from toolgym.configs.assembly.parts import build_policy, build_renderer, describe_policy, initial_model

    overrides = ["model.name=test"] + ([] if setting is None else [f"policy.history_capacity={setting}"])
    config, _ = load_config("zorplex_tiny", overrides)  # 128 slots of 256 positions
    renderer, _ = build_renderer(config)
    with build_policy(config, initial_model(config), None, renderer, torch.device("cpu")) as engine:
        assert engine.cache.history_capacity == positions
        line = describe_policy(engine)  # what `toolgym train` prints about it
    assert line.startswith("policy: torch engine, 128 slots x 256 tokens, KV cache ")
    assert ("kept histories" in line) is (positions > 0)


@pytest.mark.slow
def test_policy_replicas_build_engine_processes():
    import torch

    from toolgym.agents.types import SamplingParams
    from toolgym.configs.assembly.parts import build_policy, build_renderer, describe_policy, initial_model

    config, _ = load_config(
        "zorplex_tiny", ["model.name=test", "policy.replicas=2", "policy.max_batch_size=4"]
    )
    renderer, _ = build_renderer(config)
    with build_policy(config, initial_model(config), None, renderer, torch.device("cpu")) as engine:
        assert describe_policy(engine).startswith("policy: 2 torch engine processes (policy.replicas)")
        prompt = [1, 2, 3]
        completions = engine.generate_sync([prompt, prompt], SamplingParams(max_tokens=3, n=2, seed=0))
    assert [len(c.tokens) for c in completions] == [3, 3, 3, 3]
    assert completions[0].text == renderer.tokenizer.decode(completions[0].tokens)  # the tokenizer went too
    assert engine.stats.requests == 2  # one prompt on each replica


def test_model_path_wins_over_the_named_config(tmp_path):
    config = config_from_dict({"model": {"name": "tiny", "path": str(tmp_path)}})
    assert config.model.name == "" and config.model.path == str(tmp_path)
    with pytest.raises(ConfigError, match=r"model.path: .* is not a Hugging Face directory"):
        check_environment(config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.group_size=x"], "config error: rollout.group_size: expected int, got str"),
        (["rollout.bogus=1"], "config error: rollout.bogus: unknown key"),
        (["trainer.loss.name=ppo"], "config error: trainer.loss.name: invalid value 'ppo'"),
        (["env.id=toolgym/Nope-v0"], "config error: env: cannot make env 'toolgym/Nope-v0'"),
        (["env.kwargs={tier='deep'}"], "config error: env: cannot make env"),
        (["model.name=huge"], "config error: model.name: unknown named config 'huge'"),
        (["batch.groups_per_batch=0"], "config error: batch.groups_per_batch: must be >= 1"),
        (
            ["batch.max_groups_per_round=-2"],
            "config error: batch.max_groups_per_round: must be >= 1 (or unset), got -2",
        ),
        (["policy.history_capacity=-2"], "config error: policy.history_capacity: must be -1"),
        (["policy.replicas=0"], "config error: policy.replicas: must be >= 1, got 0"),
        (
            ["model.overrides={vocab_size=100}"],
            "config error: model: vocab_size 100 is smaller than the tokenizer's",
        ),
        (["policy.max_seq_len=1"], "config error: policy.max_seq_len: must be in [2, "),
        (["policy.max_seq_len=100000"], "config error: policy.max_seq_len: must be in [2, "),
        (["rollout.context_length=1"], "config error: rollout.context_length: must be >= 2, got 1"),
        (["rollout.episode_timeout_s=0"], "config error: rollout.episode_timeout_s: must be > 0, got 0"),
        (
            ["sft.source=recording", "sft.recording=/no/such.jsonl"],
            "config error: sft.recording: no such file",
        ),
    ],
)
def test_cli_rejects_a_bad_config_with_exit_code_2_and_starts_nothing(tmp_path, capsys, overrides, message):
    run_dir = tmp_path / "run"
    args = ["train", "zorplex_tiny", "--set", f"run.run_dir={run_dir}"]
    for item in overrides:
        args += ["--set", item]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message), err
    assert len(err.splitlines()) == 1
    assert not run_dir.exists()


def test_cli_refuses_an_sft_recording_of_another_tokenizer_and_starts_nothing(tmp_path, capsys):
    from toolgym.rollouts.recording.format import RecordingHeader, RecordingWriter

    recording, run_dir = tmp_path / "demos.jsonl", tmp_path / "run"
    RecordingWriter(recording, RecordingHeader(tokenizer_fingerprint="another", env_id="x")).close()
    args = ["train", "--set", f"run.run_dir={run_dir}", "--set", "sft.source=recording"]
    assert main([*args, "--set", f"sft.recording={recording}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: sft.recording: {recording}: recorded with tokenizer another")
    assert len(err.strip().splitlines()) == 1 and not run_dir.exists()


def test_cli_refuses_a_damaged_sft_recording_in_one_line_and_starts_nothing(tmp_path, capsys):
    recording, run_dir = tmp_path / "demos.jsonl", tmp_path / "run"
    assert (
        main(
            [
                "record",
                "--env",
                "toolgym/Zorplex-v0",
                "--policy",
                "oracle",
                "--tasks",
                "4",
                "--out",
                str(recording),
            ]
        )
        == 0
    )
    lines = recording.read_text().splitlines(keepends=True)
    lines[2] = '{"transitions": [oops\n'  # a damaged record in the middle (not a torn last line)
    recording.write_text("".join(lines))
    capsys.readouterr()
    args = ["train", "--set", f"run.run_dir={run_dir}", "--set", "sft.source=recording"]
    assert main([*args, "--set", f"sft.recording={recording}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: sft.recording: {recording}") and "line 3" in err, err
    assert len(err.strip().splitlines()) == 1 and not run_dir.exists()


def test_cli_refuses_an_existing_run_dir_and_a_missing_one_to_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "something").write_text("x")
    assert (
        main(
            ["train", "--set", f"run.run_dir={run_dir}", "--set", "run.steps=0", "--set", "sft.enabled=false"]
        )
        == 2
    )
    assert "already exists and is not empty" in capsys.readouterr().err
    assert sorted(p.name for p in run_dir.iterdir()) == ["something"]
    assert main(["train", "--resume", str(tmp_path / "nope")]) == 2
    assert "is not a toolgym run directory" in capsys.readouterr().err


def test_cli_print_config_prints_the_resolved_toml(capsys):
    assert main(["train", "sum_digits_tiny", "--set", "run.steps=7", "--print-config"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["run"]["steps"] == 7 and printed["env"]["id"] == "toolgym/SumDigits-v0"
    assert printed["trainer"]["optimizer"]["total_steps"] == 7


def test_presets_ship_as_package_data():
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "*.toml" in pyproject["tool"]["setuptools"]["package-data"]["toolgym.configs"]


def test_deprecated_trainer_temperature_still_loads_with_a_warning():
    with pytest.warns(DeprecationWarning, match="trainer.temperature is deprecated"):
        config = config_from_dict({"policy": {"temperature": 0.7}, "trainer": {"temperature": 0.7}})
    assert config.policy.temperature == 0.7


def test_rollout_settings_are_declared_once():
    import msgspec

    from toolgym.rollouts.episode.config import EnvRolloutConfig
    from toolgym.rollouts.types import PolicySampling, RolloutSettings

    config = config_from_dict({"rollout": {"max_turns": 3}, "policy": {"top_p": 0.5}})
    assert type(config.rollout) is RolloutSettings and isinstance(config.policy, PolicySampling)
    rollout = config.rollout_config()
    assert isinstance(rollout, EnvRolloutConfig) and rollout.max_turns == 3 and rollout.sampling.top_p == 0.5
    own = {f.name for f in msgspec.structs.fields(EnvRolloutConfig)} - set(RolloutSettings.__struct_fields__)
    assert own == {"env_id", "env_kwargs", "sampling", "seed"}


def test_the_old_agent_section_still_loads_with_a_warning(tmp_path, capsys):
    with pytest.warns(DeprecationWarning, match=r"\[agent\] is deprecated: it is now \[policy\]"):
        config = config_from_dict({"agent": {"temperature": 0.5, "vllm": {"dtype": "float32"}}})
    assert config.policy.temperature == 0.5 and config.policy.vllm.dtype == "float32"
    with pytest.warns(DeprecationWarning, match=r"policy\.\*"):
        config, _ = load_config("zorplex_tiny", ["agent.max_batch_size=7"])
    assert config.policy.max_batch_size == 7
    assert error_of({"agent": {"top_k": 1}, "policy": {"top_k": 2}}).startswith(
        "config error: agent.top_k: is also set as policy.top_k"
    )
    old = tmp_path / "old.toml"
    old.write_text("[agent]\ntemperature = 1.0\n[run]\nsteps = 1\n")
    assert main(["train", str(old), "--set", "agent.top_k=3", "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert "[policy]" in out and "top_k = 3" in out and "[agent]" not in out
    assert "warning: config key [agent] is deprecated: it is now [policy]" in err
    assert "warning: config key agent.* is deprecated: it is now policy.*" in err
