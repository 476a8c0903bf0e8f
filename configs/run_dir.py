"""The run directory: everything one `toolgym train` run writes, in one place.

runs/zorplex_tiny-20250101-120000/
    config.toml              the resolved config (every default filled in); --resume reads it
    metrics.jsonl            one JSON object per line: {"kind": "sft"|"train"|"eval", ...}
    summary.json             before/after eval numbers (written at the end)
    checkpoints/rl/          DCP checkpoints of the RL phase (trainers/checkpoint.py layout)
    sft_model/               the policy after the SFT warm start (Hugging Face directory)
    initial_model/           the initial weights as a HF directory (vLLM backend, named model)
    final_model/             the final policy (Hugging Face directory + tokenizer.json; with LoRA merged)
    final_adapter/           with policy.lora: the final adapters as a PEFT directory
    trajectories/            eval_step_00000010.jsonl per eval, train_rank0.jsonl (optional)
    plots/                   reward.png, <metric>.png per env metric, entropy.png, kl.png, curves.png
    tensorboard/             (optional)

Resuming (below): the latest RL checkpoint's point, the recordings cut back to it, the config
updated with the resuming session's overrides.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..rollouts.recording.format import RecordingReader, RecordingWriter
from ..trainers.checkpoint import CheckpointManager
from ..trainers.metrics_log import METRICS_FILE
from .load import ConfigError, config_to_toml, load_config
from .schema import Config

CONFIG_FILE = "config.toml"
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
        self.final_adapter = self.root / "final_adapter"
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


# ---- resuming a run --------------------------------------------------------------------------------


def update_run_config(run: RunDir, config: Config) -> Path | None:
    """On resume: write `config` to the run's config.toml when it differs (--resume with --set),
    keeping the previous one as config.toml.bak. A later `--resume RUN` (the command printed on
    an interrupt) reads config.toml alone: without this it would run with the old values, e.g.
    the old run.steps, train nothing and exit 0. Returns the backup, or None when unchanged."""
    text = config_to_toml(config)
    try:
        unchanged = config_to_toml(load_config(run.config)[0]) == text
    except ConfigError:  # the old file no longer loads (the overrides may be what fixes it)
        unchanged = False
    if unchanged:
        return None
    backup = run.config.with_name(run.config.name + ".bak")
    shutil.copy2(run.config, backup)
    run.write_text(run.config, text)
    return backup


def resume_point(run: RunDir) -> tuple[Path | None, int, list[int], list[int]]:
    """The latest RL checkpoint (or None), the RL step it holds, the task streams' positions and
    (async mode) the task indices drawn but not trained on by then."""
    latest = CheckpointManager(run.rl_checkpoints).latest()
    if latest is None:
        return None, 0, [], []
    data = json.loads((latest / "meta.json").read_text())["data_position"]
    positions = [int(p) for p in data.get("positions", [0])]
    return latest, int(data.get("rl_step", 0)), positions, [int(i) for i in data.get("pending", [])]


def drawn_before(group_id: int, positions: list[int]) -> bool:
    """Whether training task `group_id` (its index in the stream) was drawn by the checkpoint's
    steps: rank r of W draws the indices k * W + r for k < positions[r]. A session run with
    another world size drew only indices below where the checkpoint's session started, or (a
    later one, resumed from it) at or past every rank's position: the rule holds for those too."""
    world = len(positions)
    return world > 0 and group_id // world < positions[group_id % world]


def cut_recordings(run: RunDir, last_step: int, positions: list[int], pending: Sequence[int] = ()) -> None:
    """On resume: leave the recordings as they were at the checkpoint, so each step the resumed
    run redoes is recorded once (the writers append). Evals after `last_step` are deleted (they
    are redone, like their metrics records); train_rank*.jsonl keeps the episodes of the tasks
    the checkpoint's steps drew (task index = group id, below the streams' positions: this holds
    for surplus and dropped groups too, and needs no step number in the file), less the `pending`
    ones (async mode: drawn but not trained on by the checkpoint, so rolled out again), and is
    rewritten through a RecordingWriter, header kept. No checkpoint (`positions` empty): RL starts over,
    and the file goes."""
    for path in run.trajectories.glob("eval_step_*.jsonl"):
        step = path.stem.removeprefix("eval_step_")
        if step.isdigit() and int(step) > last_step:
            path.unlink()
    redone = set(pending)
    for path in run.trajectories.glob("train_rank*.jsonl"):
        reader = RecordingReader(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        kept = 0
        with RecordingWriter(tmp, reader.header) as writer:
            for trajectory in reader:
                if drawn_before(trajectory.group_id, positions) and trajectory.group_id not in redone:
                    writer.write(trajectory)
                    kept += 1
        if kept:
            tmp.replace(path)
        else:  # the run starts over: its writer makes a new file, with this session's header
            tmp.unlink()
            path.unlink()


def stream_position(data: dict[str, Any], rank: int, world_size: int) -> int:
    """This rank's task-stream position in a checkpoint's data position."""
    positions = [int(p) for p in data.get("positions", [0])]
    if len(positions) == world_size:
        return positions[rank]
    # Another world size: start past every task index the old ranks drew (index = k * W + r).
    return math.ceil(max(positions) * len(positions) / world_size)
