"""The run directory's config.toml: what a plain `--resume RUN` runs with."""

from __future__ import annotations

import tomllib

from toolgym.configs.load import config_from_dict
from toolgym.configs.run_dir import create_run_dir, update_run_config


def test_resume_with_overrides_writes_them_to_the_run_config_and_keeps_the_old_one(tmp_path):
    run = create_run_dir(tmp_path / "run", config_from_dict({"run": {"steps": 12, "name": "x"}}))
    started = run.config.read_text()
    assert update_run_config(run, config_from_dict(tomllib.loads(started))) is None  # no overrides
    assert run.config.read_text() == started and not (tmp_path / "run" / "config.toml.bak").exists()

    raw = tomllib.loads(started)
    raw["run"]["steps"] = 20
    backup = update_run_config(run, config_from_dict(raw))
    assert backup == tmp_path / "run" / "config.toml.bak" and backup.read_text() == started
    assert tomllib.loads(run.config.read_text())["run"]["steps"] == 20


def test_the_training_recording_is_cut_at_the_checkpoints_task_positions():
    from toolgym.configs.run_dir import drawn_before

    assert [g for g in range(6) if drawn_before(g, [3])] == [0, 1, 2]
    assert [g for g in range(8) if drawn_before(g, [2, 2])] == [0, 1, 2, 3]
    assert [g for g in range(8) if drawn_before(g, [3, 2])] == [0, 1, 2, 3, 4]  # rank 0 one ahead
    # 1 process drew tasks 0-2, then 2 processes resumed past them (position ceil(3 / 2) = 2 each)
    # and drew 4-7 before the checkpoint: everything up to 7 was drawn by its steps, 8 on was not
    assert [g for g in range(12) if drawn_before(g, [4, 4])] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert not drawn_before(0, [])  # no checkpoint: RL starts over


def test_steps_past_a_decaying_schedule_are_named_and_how_to_stretch_it():
    from toolgym.configs.cli.train import schedule_notes

    fresh = {"run": {"steps": 20}, "trainer": {"optimizer": {"decay": "cosine", "min_lr_ratio": 0.1}}}
    config = config_from_dict(fresh)
    assert config.trainer.optimizer.total_steps == 20 and schedule_notes(config) == []
    # a resume with --set run.steps=40: the stored config.toml already fixed total_steps at 20
    raw = tomllib.loads(_toml(config))
    raw["run"]["steps"] = 40
    (note,) = schedule_notes(config_from_dict(raw))
    assert "trainer.optimizer.total_steps=20 < run.steps=40" in note
    assert "min_lr_ratio=0.1" in note and "--set trainer.optimizer.total_steps=40" in note
    raw["trainer"]["optimizer"]["decay"] = "constant"  # nothing ends: nothing to say
    assert schedule_notes(config_from_dict(raw)) == []
    sft = config_from_dict(
        {"sft": {"enabled": True, "steps": 30, "optimizer": {"decay": "linear", "total_steps": 10}}}
    )
    assert [n.split(":")[1].strip() for n in schedule_notes(sft)] == [
        "sft.optimizer.total_steps=10 < sft.steps=30"
    ]


def _toml(config) -> str:
    from toolgym.configs.load import config_to_toml

    return config_to_toml(config)
