"""The run directory: everything one `toolgym train` run writes, in one place.

runs/zorplex_tiny-20250101-120000/
    config.toml              the resolved config (every default filled in); --resume reads it
    metrics.jsonl            one JSON object per line: {"kind": "sft"|"train"|"eval", ...}
    summary.json             before/after eval numbers (written at the end)
    checkpoints/rl/          DCP checkpoints of the RL phase (trainers/checkpoint.py layout)
    sft_model/               the policy after the SFT warm start (Hugging Face directory)
    initial_model/           the initial weights as a HF directory (vLLM backend, named model)
    final_model/             the final policy (Hugging Face directory + tokenizer.json)
    trajectories/            eval_step_00000010.jsonl per eval, train_rank0.jsonl (optional)
    plots/                   reward.png, <metric>.png per env metric, entropy.png, kl.png, curves.png
    tensorboard/             (optional)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .load import ConfigError, config_to_toml
from .schema import Config

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SFT_DONE_FILE = "sft_done.json"


class RunDir:
    """The paths of one run directory. Every path is inside `root`: a `checkpoint_directory`
    that is absolute or climbs out with `..` raises ConfigError (the schema refuses it first)."""

    def __init__(self, root: str | Path, checkpoint_directory: str = "checkpoints") -> None:
        self.root = Path(root)
        if not _stays_inside(checkpoint_directory):
            raise ConfigError(
                "checkpoint.directory",
                f"must be a relative folder inside the run directory {self.root}: got {checkpoint_directory!r}",
            )
        self.checkpoints = self.root / checkpoint_directory
        self.config = self.root / CONFIG_FILE
        self.metrics = self.root / METRICS_FILE
        self.summary = self.root / SUMMARY_FILE
        self.sft_done = self.root / SFT_DONE_FILE
        self.sft_model = self.root / "sft_model"
        self.initial_model = self.root / "initial_model"
        self.final_model = self.root / "final_model"
        self.trajectories = self.root / "trajectories"
        self.plots = self.root / "plots"
        self.tensorboard = self.root / "tensorboard"

    @property
    def rl_checkpoints(self) -> Path:
        return self.checkpoints / "rl"

    def eval_recording(self, step: int) -> Path:
        return self.trajectories / f"eval_step_{step:08d}.jsonl"

    def train_recording(self, rank: int) -> Path:
        return self.trajectories / f"train_rank{rank}.jsonl"

    def write_json(self, path: Path, data: Any) -> None:
        self.write_text(path, json.dumps(data, indent=2) + "\n")

    def write_text(self, path: Path, text: str) -> None:
        """Replace `path` with `text` atomically: a crash leaves the old file or the new one."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def _stays_inside(relative: str) -> bool:
    """Whether `root / relative` is under `root` for any root: not absolute (pathlib would drop
    the root), no drive, no `..` part. Judged by the parts: nothing has to exist yet."""
    path = Path(relative)
    return not path.is_absolute() and not path.drive and ".." not in path.parts and "\\" not in relative


def default_run_path(config: Config) -> Path:
    """run.run_dir when set, else <run.root>/<run.name>-<timestamp> (run.name is a name, never a
    path: the schema refuses separators and `..`)."""
    if config.run.run_dir:
        return Path(config.run.run_dir)
    return Path(config.run.root) / f"{config.run.name or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"


def create_run_dir(path: Path, config: Config) -> RunDir:
    """A new run directory with the resolved config; an existing non-empty one is refused."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(
            "run.run_dir",
            f"{path} already exists and is not empty; resume it with --resume {path} or pick another",
        )
    run = RunDir(path, config.checkpoint.directory)
    path.mkdir(parents=True, exist_ok=True)
    run.config.write_text(config_to_toml(config))
    return run


def existing_run_config(path: str | Path) -> Path:
    """The resolved config of a run to resume."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        raise ConfigError("--resume", f"{path} is not a toolgym run directory (no {CONFIG_FILE})")
    return config
