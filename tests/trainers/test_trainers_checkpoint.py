"""Checkpoints: kill-and-resume equals an uninterrupted run; atomic latest; keep-last-K; HF export."""

import gc
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainers_testlib import full_params, random_episodes

from toolgym.agents.model.checkpoint import load_hf_checkpoint
from toolgym.agents.model.transformer import build_model, causal_lm_logprobs
from toolgym.trainers import checkpoint as checkpoint_module
from toolgym.trainers.checkpoint import CheckpointManager, export_hf
from toolgym.trainers.config import OptimizerConfig, TrainerConfig
from toolgym.trainers.losses import LossConfig
from toolgym.trainers.trainer import Trainer

torch.set_num_threads(1)
TIMING = {"step_time_s", "tokens_per_s"}


def _trainer(seed=0):
    config = TrainerConfig(
        loss=LossConfig(name="dapo"),
        micro_batch_tokens=160,
        optimizer=OptimizerConfig(lr=2e-3, warmup_steps=2, decay="cosine", total_steps=6, weight_decay=0.01),
    )
    return Trainer(build_model("test", seed=seed), config, device="cpu")


def _train(trainer, steps):
    out = []
    for step in steps:
        metrics = trainer.train_step(random_episodes(8, seed=100 + step))
        out.append({k: v for k, v in metrics.items() if k not in TIMING})
    return out


def test_kill_and_resume_equals_uninterrupted_run(tmp_path):
    n = 3
    straight = _trainer()
    expected_metrics = _train(straight, range(2 * n))
    expected_params = full_params(straight.model)
    del straight

    first = _trainer()
    metrics = _train(first, range(n))
    manager = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    manager.save(first, data_position={"next_step": n, "seeds": [1, 2]})
    rng_at_save = torch.get_rng_state()
    del first
    gc.collect()
    torch.manual_seed(999)  # the resumed process starts from other RNG state and other weights

    resumed = _trainer(seed=123)
    position = CheckpointManager(tmp_path / "ckpt").load(resumed)
    assert position == {"next_step": n, "seeds": [1, 2]}
    assert resumed.step == n and torch.equal(torch.get_rng_state(), rng_at_save)
    metrics += _train(resumed, range(position["next_step"], 2 * n))

    assert metrics == expected_metrics  # bitwise: same floats
    for name, value in full_params(resumed.model).items():
        assert torch.equal(value, expected_params[name]), name


def test_a_checkpoint_before_the_first_update_changes_nothing(tmp_path):
    """Ctrl-C during the first rollout saves before any update: neither the live run nor a resume
    from that checkpoint may train differently from a run that never saved."""
    straight = _trainer()
    expected_metrics = _train(straight, range(3))
    expected_params = full_params(straight.model)
    del straight

    saved = _trainer()
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(saved, data_position={"next_step": 0})
    assert not saved.optimizer.state  # as before the save
    assert _train(saved, range(3)) == expected_metrics
    assert all(torch.equal(v, expected_params[k]) for k, v in full_params(saved.model).items())

    resumed = _trainer(seed=123)
    assert manager.load(resumed) == {"next_step": 0}
    assert not resumed.optimizer.state
    assert _train(resumed, range(3)) == expected_metrics
    assert all(torch.equal(v, expected_params[k]) for k, v in full_params(resumed.model).items())


def test_crash_during_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    trainer = _trainer()
    _train(trainer, range(1))
    manager = CheckpointManager(tmp_path, keep_last=3)
    good = manager.save(trainer, {"next_step": 1})
    _train(trainer, range(1, 2))

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(checkpoint_module.dcp, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        manager.save(trainer, {"next_step": 2})
    monkeypatch.undo()
    assert manager.latest() == good and (tmp_path / "step_00000002.tmp").exists()
    assert manager.checkpoints() == [good]

    fresh = _trainer(seed=5)
    assert manager.load(fresh) == {"next_step": 1} and fresh.step == 1
    manager.save(trainer, {"next_step": 2})  # the next save cleans the debris
    assert not list(tmp_path.glob("*.tmp"))
    assert manager.latest().name == "step_00000002"


def test_keep_last_k_and_same_step_saves(tmp_path):
    trainer = _trainer()
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.latest() is None and manager.load(trainer) is None
    for step in range(4):
        _train(trainer, [step])
        manager.save(trainer, {"next_step": step + 1})
    assert [p.name for p in manager.checkpoints()] == ["step_00000003", "step_00000004"]
    again = manager.save(trainer, {"next_step": 5})  # no update since: a new name, old one intact
    assert again.name == "step_00000004_1" and manager.latest() == again
    assert [p.name for p in manager.checkpoints()] == ["step_00000004", "step_00000004_1"]
    assert json.loads((again / "meta.json").read_text())["data_position"] == {"next_step": 5}
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_export_hf_loads_in_agents(tmp_path):
    trainer = _trainer()
    _train(trainer, range(2))
    out = export_hf(trainer, tmp_path / "hf")
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    model = load_hf_checkpoint(out)
    episodes = random_episodes(3, seed=7)
    got = trainer.compute_logprobs(episodes)
    for episode, row in zip(episodes, got, strict=True):
        expected = causal_lm_logprobs(model, torch.tensor([episode.tokens]))[0].tolist()
        assert max(abs(a - b) for a, b in zip(row[1:], expected, strict=True)) <= 1e-6
