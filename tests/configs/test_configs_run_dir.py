"""The run directory's config.toml: what a plain `--resume RUN` runs with."""

from __future__ import annotations

import tomllib

from toolgym.configs.load import config_from_dict
from toolgym.configs.run_dir import create_run_dir
from toolgym.configs.train import _update_run_config


def test_resume_with_overrides_writes_them_to_the_run_config_and_keeps_the_old_one(tmp_path):
    run = create_run_dir(tmp_path / "run", config_from_dict({"run": {"steps": 12, "name": "x"}}))
    started = run.config.read_text()
    assert _update_run_config(run, config_from_dict(tomllib.loads(started))) is None  # no overrides
    assert run.config.read_text() == started and not (tmp_path / "run" / "config.toml.bak").exists()

    raw = tomllib.loads(started)
    raw["run"]["steps"] = 20
    backup = _update_run_config(run, config_from_dict(raw))
    assert backup == tmp_path / "run" / "config.toml.bak" and backup.read_text() == started
    assert tomllib.loads(run.config.read_text())["run"]["steps"] == 20
