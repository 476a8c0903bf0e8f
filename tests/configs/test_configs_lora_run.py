"""`toolgym train` with `policy.lora`: RL trains adapters over the base it starts from, the run ends
with the merged model and a PEFT adapter over that base (written to initial_model/), and resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from toolgym.agents.model.checkpoint import load_hf_checkpoint
from toolgym.agents.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraConfig, apply_lora, load_adapter
from toolgym.configs.cli.main import main
from toolgym.configs.cli.train import train
from toolgym.configs.cli.viewer.index import RecordingIndex
from toolgym.configs.load import config_from_dict
from toolgym.rollouts.recording.format import POLICY_MODEL, read_recording

pytestmark = pytest.mark.slow


def lora_config(run_dir: Path, steps: int) -> dict:
    return {
        "run": {"steps": steps, "run_dir": str(run_dir), "plot": False},
        "model": {"name": "test", "overrides": {"vocab_size": 1024}},
        "policy": {"max_batch_size": 16, "max_seq_len": 256, "lora": {"rank": 4, "alpha": 8}},
        "rollout": {"group_size": 2, "max_turns": 3, "max_tokens_per_turn": 8, "max_tokens_per_episode": 24},
        "batch": {"groups_per_batch": 2},
        "sft": {"enabled": False},
        "eval": {"every_steps": 0, "at_start": False},
        "checkpoint": {"every_steps": 1, "keep_last": 1},
        "logging": {"progress_bar": False, "record_training": True},
    }


def test_a_lora_run_exports_merged_and_peft_over_its_base_and_resumes(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(config_from_dict(lora_config(run_dir, steps=2))) == 0
    assert "LoRA adapters merged" in capsys.readouterr().out
    with safe_open(run_dir / "final_model" / "model.safetensors", "pt") as f:
        assert not [k for k in f.keys() if "lora_" in k]  # noqa: SIM118
    config = json.loads((run_dir / "final_adapter" / ADAPTER_CONFIG).read_text())
    base_dir = Path(config["base_model_name_or_path"])
    assert base_dir == (run_dir / "initial_model").resolve() and (base_dir / "config.json").is_file()
    assert (run_dir / "final_adapter" / ADAPTER_WEIGHTS).is_file()

    # base + adapter == the merged export
    base = load_hf_checkpoint(base_dir)
    tokens = torch.randint(0, 1024, (2, 11), generator=torch.Generator().manual_seed(0))
    apply_lora(base, LoraConfig(rank=4, alpha=8))
    load_adapter(base, run_dir / "final_adapter")
    merged = load_hf_checkpoint(run_dir / "final_model")
    with torch.no_grad():
        ours, theirs = base(tokens), merged(tokens)
    assert (ours - theirs).abs().max() <= 1e-5
    assert (run_dir / "checkpoints" / "rl" / "step_00000002" / "adapter" / ADAPTER_CONFIG).is_file()

    assert train(config_from_dict(lora_config(run_dir, steps=3)), resume=run_dir) == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if m.get("kind") == "train"][-1] == 3


def test_a_lora_runs_recordings_name_the_base_and_the_adapter_that_sampled_each_episode(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(config_from_dict(lora_config(run_dir, steps=2))) == 0
    recording = run_dir / "trajectories" / "train_rank0.jsonl"
    header, trajectories = read_recording(recording)
    entry = header.extra[POLICY_MODEL]
    assert entry["base"] == "test" and entry["adapter"]["rank"] == 4 and entry["adapter"]["alpha"] == 8
    assert {t.policy_version for t in trajectories} == {0, 1}  # the adapter versions of steps 1 and 2
    capsys.readouterr()
    assert main(["replay", str(recording), "--summary-only"]) == 0
    assert "model test + LoRA adapter r4 alpha 8" in capsys.readouterr().out
    index = RecordingIndex(recording)
    assert index.summary()["model"].startswith("model test + LoRA adapter r4")
    last = next(i for i, t in enumerate(trajectories) if t.policy_version == 1)
    assert index.episode(last, None)["sampled_by"] == "adapter v1"

    full = lora_config(tmp_path / "full", steps=1)
    full["policy"].pop("lora")
    assert train(config_from_dict(full)) == 0
    header, trajectories = read_recording(tmp_path / "full" / "trajectories" / "train_rank0.jsonl")
    assert header.extra[POLICY_MODEL] == {"base": "test", "adapter": None}
    assert RecordingIndex(tmp_path / "full" / "trajectories" / "train_rank0.jsonl").episode(0, None)["sampled_by"] == "policy v0"
