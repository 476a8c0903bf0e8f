"""Resumable training checkpoints (torch.distributed.checkpoint) and Hugging Face export.

Layout of `directory`:

    latest                      text file naming the newest complete checkpoint ("step_00000004";
                                a name inside `directory`, never a path: anything else is refused)
    step_00000004/
        dcp/                    model and optimizer, sharded as trained (DCP reshards on load)
        rank0.pt ...            per rank: step, scheduler, RNG states (python, numpy, torch, cuda),
                                tensors and plain data only: read with torch.load(weights_only=True)
        meta.json               step, world size, the loop's data position (written last)
        adapter/                with LoRA: the adapters as a PEFT directory (adapter_config.json,
                                adapter_model.safetensors); resume reads dcp/, as for any model

A checkpoint is written under `step_N.tmp/` and renamed into place only when every rank has
finished; then `latest` is replaced atomically (write a temp file, fsync, rename, fsync the
directory). A crash at any moment leaves `latest` naming a complete checkpoint. Only the newest
`keep_last` checkpoints are kept.

All functions here are collectives: every rank calls them.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ..agents.model.checkpoint import save_hf_checkpoint
from ..agents.model.lora import (
    adapter_peft_state,
    has_lora,
    is_adapter_name,
    lora_config_of,
    merged_state_dict,
    save_adapter,
)
from .distributed import all_gather_objects, barrier
from .weight_sync import gather_weights

if TYPE_CHECKING:
    from .trainer import Trainer

LATEST = "latest"
STEP_PREFIX = "step_"
ADAPTER_DIR = "adapter"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def rng_state() -> dict[str, Any]:
    """The python, numpy, torch (and cuda) RNG states as tensors, ints, floats, strings, tuples and
    lists only, so that `torch.load(weights_only=True)` reads them back (no pickled objects)."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (
            numpy_state["name"],
            np.asarray(numpy_state["keys"].numpy(), dtype=np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointError(ValueError):
    """A checkpoint that is refused (it would run code, or points outside its directory); str()
    is one line naming the file."""


def _numpy_array_globals() -> list[Any]:
    """What a numpy uint32 array pickle needs: the RNG state of checkpoints written before the
    numpy state was stored as a tensor. Only array construction; no other callable is allowed."""
    try:
        from numpy._core.multiarray import _reconstruct  # type: ignore[attr-defined]
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[attr-defined,no-redef]
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_rank_state(path: Path) -> dict[str, Any]:
    """A rank's `rank<N>.pt` read with `torch.load(weights_only=True)`: tensors and plain
    containers only, so a crafted file cannot run code. Raises CheckpointError (one line)."""
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            local = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if "WeightsUnpickler error" in line]
        reason = lines[0].split("WeightsUnpickler error:", 1)[-1].strip() if lines else type(exc).__name__
        reason = reason.split(" was not an allowed global")[0]  # drop torch's advice to allowlist it
        raise CheckpointError(
            f"{path}: refused: it holds more than tensors and plain data, and loading it could run "
            f"code ({reason})"
        ) from None
    except (RuntimeError, EOFError) as exc:  # truncated, not a torch file
        raise CheckpointError(
            f"{path}: unreadable: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        ) from None
    if not isinstance(local, dict) or not {"step", "skipped_steps", "scheduler", "rng"} <= local.keys():
        raise CheckpointError(
            f"{path}: not a toolgym rank state (expected step, skipped_steps, scheduler, rng)"
        )
    return local


def _order(path: Path) -> tuple[int, int]:
    step, _, suffix = path.name.removeprefix(STEP_PREFIX).partition("_")
    return int(step), int(suffix or 0)


class CheckpointManager:
    """Save and restore a Trainer (and the loop's data position) under one directory."""

    def __init__(self, directory: str | Path, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None. Its rank states are read here already
        (`load_rank_state`): a resume that would be refused is refused before it writes anything."""
        pointer = self.directory / LATEST
        if not pointer.is_file():
            return None
        name = pointer.read_text().strip()
        # `latest` names a checkpoint inside this directory, never a path: another run's files
        # (`../../other_run/...`) or an absolute path are refused, not followed.
        if not name.startswith(STEP_PREFIX) or Path(name).name != name or "\\" in name or name in (".", ".."):
            raise CheckpointError(
                f"{pointer}: refused: it names {name!r}, not a checkpoint inside {self.directory} "
                f"(expected a name like {STEP_PREFIX}00000004)"
            )
        path = self.directory / name
        # nor through a link: a step directory (or its files) that is a symlink into another run
        home = self.directory.resolve()
        for part in (path, path / "meta.json", path / "dcp"):
            if part.is_symlink() or (part.exists() and home not in part.resolve().parents):
                raise CheckpointError(
                    f"{pointer}: refused: {part} is a link to {part.resolve()}, outside {self.directory}"
                )
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"{pointer} names {path}, which is not a complete checkpoint")
        for rank_file in sorted(path.glob("rank*.pt")):
            load_rank_state(rank_file)
        return path

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        found = [
            p
            for p in self.directory.glob(f"{STEP_PREFIX}*")
            if p.is_dir() and not p.name.endswith(".tmp") and (p / "meta.json").is_file()
        ]
        return sorted(found, key=_order)

    def save(self, trainer: Trainer, data_position: dict[str, Any] | None = None) -> Path:
        """Write a checkpoint of `trainer` at its current step; return its path."""
        rank = trainer.dist.rank
        name = f"{STEP_PREFIX}{trainer.step:08d}"
        # Saving the same step twice (skipped updates, the data moved on): a new name, so the
        # checkpoint `latest` names is never touched.
        suffix = 0
        while (self.directory / name).exists():
            suffix += 1
            name = f"{STEP_PREFIX}{trainer.step:08d}_{suffix}"
        name = all_gather_objects(name)[0]  # rank 0's view of the directory decides
        final, tmp = self.directory / name, self.directory / f"{name}.tmp"
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier()

        # get_state_dict fills an optimizer that has no state yet with a zero-gradient lr-0 step
        # (AdamW step 1, zero moments): the first real update would then be bias-corrected as the
        # second. So a checkpoint taken before any update leaves the optimizer as it found it, and
        # says so, for `load` to do the same.
        optimizer_fresh = not trainer.optimizer.state
        model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / "dcp"))
        if optimizer_fresh:
            trainer.optimizer.state.clear()
        local = {
            "step": trainer.step,
            "skipped_steps": trainer.skipped_steps,
            "scheduler": trainer.scheduler.state_dict(),
            "rng": rng_state(),
        }
        if has_lora(trainer.model):
            adapters = gather_weights(trainer)  # the adapters alone, whole on every rank
            if rank == 0:
                save_adapter(adapter_peft_state(adapters), tmp / ADAPTER_DIR, lora_config_of(trainer.model))
        with open(tmp / f"rank{rank}.pt", "wb") as f:
            torch.save(local, f)
            f.flush()
            os.fsync(f.fileno())
        barrier()

        if rank == 0:
            meta = {
                "step": trainer.step,
                "world_size": trainer.dist.world_size,
                "data_position": data_position or {},
                "optimizer_fresh": optimizer_fresh,
            }
            _write_atomic(tmp / "meta.json", json.dumps(meta, indent=2))
            for file in (tmp / "dcp").iterdir():
                _fsync_path(file)
            os.replace(tmp, final)
            _fsync_path(self.directory)
            _write_atomic(self.directory / LATEST, name)
            self._prune(keep=final)
        barrier()
        return final

    def _prune(self, keep: Path) -> None:
        complete = self.checkpoints()
        for old in complete[: max(0, len(complete) - self.keep_last)]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.directory.glob(f"{STEP_PREFIX}*.tmp"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)

    def load(self, trainer: Trainer, path: str | Path | None = None) -> dict[str, Any] | None:
        """Restore `trainer` from `path` (default: latest); return the data position, or None if
        there is no checkpoint yet."""
        path = Path(path) if path is not None else self.latest()
        if path is None:
            return None
        meta_file = path / "meta.json"
        if not meta_file.is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json)")
        meta = json.loads(meta_file.read_text())

        model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(
            trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        if meta.get("optimizer_fresh"):  # saved before any update: no state, as then (see `save`)
            trainer.optimizer.state.clear()
        rank_file = path / f"rank{trainer.dist.rank}.pt"
        if not rank_file.is_file():  # more ranks than when saved: rank 0's step/schedule, its RNG too
            rank_file = path / "rank0.pt"
        local = load_rank_state(rank_file)
        trainer.step = local["step"]
        trainer.skipped_steps = local["skipped_steps"]
        trainer.scheduler.load_state_dict(local["scheduler"])
        set_rng_state(local["rng"])
        if local["step"] != meta["step"]:
            raise ValueError(f"{path}: rank state step {local['step']} != meta step {meta['step']}")
        return meta["data_position"]


def full_state_dict(trainer: Trainer, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The whole model's weights (unsharded, HF names). Collective; every rank gets it unless
    `cpu` is set, then only rank 0 (the others get {})."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu)
    return cast(dict[str, torch.Tensor], get_model_state_dict(trainer.model, options=options))


def export_hf(
    trainer: Trainer,
    directory: str | Path,
    tokenizer_path: str | Path | None = None,
    dtype: torch.dtype | None = None,
    chat_template: str | None = None,
    adapter_directory: str | Path | None = None,
    base_model: str = "",
) -> Path:
    """Write the policy as a Hugging Face directory (config.json, model.safetensors[, tokenizer,
    with `chat_template`: the template text the policy was trained with]) that
    `toolgym.agents.model.checkpoint.load_hf_checkpoint`, transformers and vLLM load. Rank 0 writes.

    With LoRA the directory holds the merged weights (W + s * B @ A), and `adapter_directory`
    (when given) the adapters alone as a PEFT directory over `base_model` (its
    base_model_name_or_path)."""
    if trainer.model_config is None:
        raise ValueError("export_hf needs a model with a `config` (agents' Transformer)")
    state = full_state_dict(trainer, cpu=True)
    if trainer.dist.is_main:
        if has_lora(trainer.model):
            if adapter_directory is not None:
                adapters = {k: v for k, v in state.items() if is_adapter_name(k)}
                save_adapter(
                    adapter_peft_state(adapters), adapter_directory, lora_config_of(trainer.model), base_model
                )
            state = merged_state_dict(trainer.model, state)
        save_hf_checkpoint(
            state, trainer.model_config, directory, tokenizer_path, dtype=dtype, chat_template=chat_template
        )
    barrier()  # everyone waits until the directory is written
    return Path(directory)
