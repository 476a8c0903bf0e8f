"""`toolgym train` end to end on CPU with a test-size model: SFT warm start, evals, RL steps,
checkpoints, the run directory, resume, and `toolgym plot`."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from toolgym.agents.model.checkpoint import load_hf_checkpoint
from toolgym.configs.cli.main import main
from toolgym.configs.cli.train import sft_shortfall, train
from toolgym.configs.load import config_from_dict
from toolgym.rollouts.recording.format import read_recording
from toolgym.trainers.metrics_log import read_metrics

pytestmark = pytest.mark.slow

# reward, its components, the metrics Zorplex reports (envs/core/tool_env.py), the trainer's entropy and KL
PNGS = {"reward.png", "accuracy.png", "tag_rate.png", "success.png", "tool_calls.png", "env_errors.png"}
PNGS |= {"reward_components.png", "entropy.png", "kl.png", "curves.png"}
# Zorplex's named reward components (envs/core/ledger.py), as metrics.jsonl keys
COMPONENTS = ("reward/correct", "reward/format", "reward/tool_penalty", "reward/error_penalty")


def small_config(run_dir: Path, **sections) -> dict:
    """A config that runs in seconds: the 'test' model shape, 2 groups of 2, short episodes."""
    raw = {
        "run": {"steps": 2, "run_dir": str(run_dir)},
        "model": {"name": "test", "overrides": {"vocab_size": 1024}},
        "policy": {"max_batch_size": 16, "max_seq_len": 256},
        "rollout": {"group_size": 2, "max_turns": 3, "max_tokens_per_turn": 8, "max_tokens_per_episode": 24},
        "batch": {"groups_per_batch": 2},
        "trainer": {"optimizer": {"lr": 1e-3}},
        "sft": {
            "enabled": True,
            "num_tasks": 8,
            "steps": 2,
            "batch_episodes": 4,
            "log_every": 1,
            "oracle": {"p_omit_tag": 0.5},
        },
        "eval": {"every_steps": 1, "num_tasks": 4, "num_examples": 1},
        "checkpoint": {"every_steps": 1, "keep_last": 1},
        "logging": {
            "progress_bar": False,
            "record_training": True,
            "headline_metrics": ["tag_rate", "accuracy"],
        },
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == kind]


def test_train_runs_sft_then_rl_end_to_end(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(config_from_dict(small_config(run_dir))) == 0
    out = capsys.readouterr().out

    # the hardware decisions, once, at start (before SFT), with the engine's own description
    (backend_line,) = [line for line in out.splitlines() if line.startswith("backend: ")]
    assert backend_line.startswith("backend: device ") and ", dtype float32, kernels " in backend_line
    assert out.index(backend_line) < out.index("sft: ") < out.index("policy: torch engine")

    # the run directory
    for name in ("config.toml", "metrics.jsonl", "summary.json", "sft_done.json"):
        assert (run_dir / name).is_file(), name
    assert {p.name for p in (run_dir / "plots").iterdir()} == PNGS
    assert (run_dir / "checkpoints" / "rl" / "latest").read_text() == "step_00000002"
    for model_dir in ("sft_model", "final_model"):
        model = load_hf_checkpoint(run_dir / model_dir)
        assert model.config.vocab_size == 1024 and (run_dir / model_dir / "tokenizer.json").is_file()
        # plain ChatML: no template in the exported tokenizer config (transformers' default is its own)
        assert "chat_template" not in json.loads((run_dir / model_dir / "tokenizer_config.json").read_text())

    # SFT: the data record, then one record per step
    sft = records(run_dir, "sft")
    assert sft[0]["step"] == 0 and sft[0]["sft_data/episodes"] == 8
    assert 0.0 < sft[0]["sft_data/tag_rate"] < 1.0 and sft[0]["sft_data/accuracy"] == 1.0
    assert [r["step"] for r in sft[1:]] == [1, 2] and all(r["sft/num_tokens"] > 0 for r in sft[1:])
    _, demos = read_recording(run_dir / "trajectories" / "sft_demos.jsonl")
    assert len(demos) == 8

    # RL: one record per step with the console's metrics
    train_records = records(run_dir, "train")
    assert [r["step"] for r in train_records] == [1, 2]
    for r in train_records:
        for key in (
            "rollout/reward_mean", "rollout/accuracy", "rollout/tag_rate", "train/loss", "train/entropy",
            "train/clip_frac_low", "train/clip_frac_high", "train/sampler_kl_k3", "train/grad_norm",
            "batch/tokens", "time/rollout_s", "time/train_s", "time/sync_s",
            *(f"rollout/{c}" for c in COMPONENTS),
        ):  # fmt: skip
            assert key in r, key
        assert r["rollout/episodes"] == 4
        assert r["memory/host_peak_gib"] > 0.05 and "memory/device_peak_gib" not in r  # CPU: no device peak
        assert abs(r["train/sampler_kl_k3"]) < 1e-4  # the engine samples with the trainer's weights
    assert train_records[-1]["policy_version"] == 2.0

    # evals at the start (after SFT) and after every step, recorded
    evals = records(run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert all(r["eval/episodes"] == 4 for r in evals)
    assert all(isinstance(r[f"eval/{c}"], float) for r in evals for c in COMPONENTS)
    assert [r["eval/policy_version"] for r in evals] == [0.0, 1.0, 2.0]
    assert sorted(p.name for p in (run_dir / "trajectories").glob("eval_step_*.jsonl")) == [
        "eval_step_00000000.jsonl", "eval_step_00000001.jsonl", "eval_step_00000002.jsonl",
    ]  # fmt: skip
    _, trained = read_recording(run_dir / "trajectories" / "train_rank0.jsonl")
    assert len(trained) == 8

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["before"]["label"] == "after SFT" and summary["before"]["step"] == 0
    assert summary["after"]["step"] == 2 and set(summary["after"]) >= {"accuracy", "tag_rate"}
    assert "after SFT (step    0): tag rate" in out and "after RL (step    2): tag rate" in out
    assert "step 2/2  reward" in out and "eval after SFT (step 0)" in out
    # two SFT steps teach nothing: the run says so, naming the knob (demos are all correct)
    assert ("note: held-out accuracy after SFT" in out) == (evals[0]["eval/accuracy"] < 0.5)
    assert evals[0]["eval/accuracy"] >= 0.5 or "--set sft.steps=N" in out


def test_sft_shortfall_hint_only_when_sft_fell_far_short_of_its_demos():
    assert sft_shortfall(None, {"eval/accuracy": 0.0}) is None  # no SFT in this process
    assert sft_shortfall(1.0, None) is None  # not rank 0: no eval here
    assert sft_shortfall(1.0, {"eval/accuracy": 0.6}) is None
    assert sft_shortfall(0.3, {"eval/accuracy": 0.0}) is None  # the demos themselves are weak
    hint = sft_shortfall(1.0, {"eval/accuracy": 0.26})
    assert hint is not None and "0.26" in hint and "1.00" in hint and "sft.steps" in hint


def test_checkpoint_at_end_false_keeps_only_the_periodic_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    raw = small_config(
        run_dir,
        run={"steps": 3},
        sft={"enabled": False},
        eval={"every_steps": 0, "at_start": False, "at_end": False},
        checkpoint={"every_steps": 2, "keep_last": 2, "at_end": False},
    )
    assert train(config_from_dict(raw)) == 0
    assert [r["step"] for r in records(run_dir, "train")] == [1, 2, 3]
    assert sorted(p.name for p in (run_dir / "checkpoints" / "rl").glob("step_*")) == ["step_00000002"]


def test_resume_continues_the_step_count_metrics_and_task_stream(tmp_path, capsys):
    run_dir = tmp_path / "run"
    raw = small_config(run_dir, sft={"enabled": False}, eval={"every_steps": 0, "at_start": False})
    assert train(config_from_dict(raw)) == 0
    meta = json.loads((run_dir / "checkpoints" / "rl" / "step_00000002" / "meta.json").read_text())
    assert meta["data_position"] == {"rl_step": 2, "stream": 0, "positions": [4]}
    # a crashed step 3 left a line behind: the resumed run drops it and redoes the step
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "train", "step": 3, "stale": True}) + "\n")

    assert main(["train", "--resume", str(run_dir), "--set", "run.steps=4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert (
        f"config.toml: updated with this session's settings (the previous one: {run_dir}/config.toml.bak)"
        in out
    )
    steps = [(r["step"], r.get("stale", False)) for r in records(run_dir, "train")]
    assert steps == [(1, False), (2, False), (3, False), (4, False)]
    latest = (run_dir / "checkpoints" / "rl" / "latest").read_text()
    meta = json.loads((run_dir / "checkpoints" / "rl" / latest / "meta.json").read_text())
    assert meta["step"] == 4 and meta["data_position"]["rl_step"] == 4
    assert meta["data_position"]["positions"] == [8]  # the task stream went on, no task repeated
    _, trained = read_recording(run_dir / "trajectories" / "train_rank0.jsonl")
    group_ids = sorted({t.group_id for t in trained})
    assert group_ids == list(range(8))
    assert [r["step"] for r in records(run_dir, "eval")] == [2, 4]  # at the end of each run
    # the override is the run's config now: a plain --resume (the command printed on an interrupt)
    # goes on with run.steps = 4, not the 2 the run was started with
    assert tomllib.loads((run_dir / "config.toml").read_text())["run"]["steps"] == 4
    assert tomllib.loads((run_dir / "config.toml.bak").read_text())["run"]["steps"] == 2
    assert main(["train", "--resume", str(run_dir), "--set", "run.steps=5", "--no-progress"]) == 0
    assert main(["train", "--resume", str(run_dir), "--no-progress"]) == 0
    assert "config.toml: updated" not in capsys.readouterr().out.split("run directory:")[-1]
    assert tomllib.loads((run_dir / "config.toml.bak").read_text())["run"]["steps"] == 4
    assert [r["step"] for r in records(run_dir, "train")] == [1, 2, 3, 4, 5]


def test_resume_after_sft_starts_rl_from_the_sft_model(tmp_path):
    run_dir = tmp_path / "run"
    raw = small_config(run_dir, run={"steps": 0}, eval={"every_steps": 0, "at_start": False, "at_end": False})
    assert train(config_from_dict(raw)) == 0
    sft_records = len(records(run_dir, "sft"))
    assert main(["train", "--resume", str(run_dir), "--set", "run.steps=1", "--no-progress"]) == 0
    assert len(records(run_dir, "sft")) == sft_records  # SFT was not redone
    assert [r["step"] for r in records(run_dir, "train")] == [1]


def test_a_run_without_metrics_jsonl_finishes_without_plots(tmp_path, capsys):
    run_dir = tmp_path / "run"
    raw = small_config(
        run_dir,
        run={"steps": 1},
        sft={"enabled": False},
        eval={"at_start": False},
        logging={"jsonl": False, "record_training": False},
    )
    assert train(config_from_dict(raw)) == 0  # it trained and exported: it used to exit 2 here
    out = capsys.readouterr().out
    assert "plots: none (they are drawn from metrics.jsonl: set logging.jsonl = true)" in out
    assert out.count("logging.jsonl") == 1
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "plots").exists()
    assert (run_dir / "final_model" / "model.safetensors").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["after"]["step"] == 1


def test_the_exported_models_carry_the_chat_template_the_run_trained_with(tmp_path):
    from toolgym.configs.load import SHIPPED_CHAT_TEMPLATES

    run_dir = tmp_path / "run"
    raw = small_config(
        run_dir,
        run={"steps": 1, "plot": False},
        policy={"chat_template": "qwen2.5-style"},
        sft={"steps": 1},
        eval={"at_start": False, "record": False},
        logging={"record_training": False},
    )
    assert train(config_from_dict(raw)) == 0
    template = (SHIPPED_CHAT_TEMPLATES / "qwen2.5-style.jinja").read_text()
    for model_dir in ("sft_model", "final_model"):
        config = json.loads((run_dir / model_dir / "tokenizer_config.json").read_text())
        assert config["chat_template"] == template, model_dir


def test_resume_leaves_one_copy_of_each_recorded_episode(tmp_path):
    run_dir = tmp_path / "run"
    raw = small_config(
        run_dir,
        run={"steps": 4},
        sft={"enabled": False},
        eval={"every_steps": 2},
        checkpoint={"every_steps": 2, "keep_last": 2},
    )
    assert train(config_from_dict(raw)) == 0
    trajectories = run_dir / "trajectories"

    def recorded() -> tuple[list[int], dict[str, int]]:
        _, trained = read_recording(trajectories / "train_rank0.jsonl")
        evals = {p.name: len(read_recording(p)[1]) for p in sorted(trajectories.glob("eval_step_*.jsonl"))}
        return sorted(t.group_id for t in trained), evals

    once = ([g for g in range(8) for _ in range(2)], {f"eval_step_{s:08d}.jsonl": 4 for s in (0, 2, 4)})
    assert recorded() == once  # 4 steps x 2 groups of 2; evals of 4 tasks at steps 0, 2, 4
    # a crash after step 4 whose last checkpoint was step 2: steps 3-4 and the step-4 eval are
    # redone, and were appended a second time to the recordings
    rl = run_dir / "checkpoints" / "rl"
    shutil.rmtree(rl / "step_00000004")
    (rl / "latest").write_text("step_00000002")
    assert main(["train", "--resume", str(run_dir), "--no-progress"]) == 0
    assert recorded() == once
    # no RL checkpoint at all: RL starts over, the step-0 eval included
    shutil.rmtree(rl)
    assert main(["train", "--resume", str(run_dir), "--no-progress"]) == 0
    assert recorded() == once
    assert [r["step"] for r in records(run_dir, "eval")] == [0, 2, 4]
    assert [r["step"] for r in records(run_dir, "train")] == [1, 2, 3, 4]
