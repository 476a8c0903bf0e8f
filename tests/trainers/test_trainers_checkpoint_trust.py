"""Checkpoints hold no code: a crafted rank state is refused, the RNG state survives weights_only,
and the `latest` pointer never leaves its directory."""

import pickle
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainers_testlib import random_episodes

from toolgym.agents.model.transformer import build_model
from toolgym.trainers.checkpoint import CheckpointError, CheckpointManager, rng_state, set_rng_state
from toolgym.trainers.config import OptimizerConfig, TrainerConfig
from toolgym.trainers.losses import LossConfig
from toolgym.trainers.trainer import Trainer

torch.set_num_threads(1)


def _trainer(seed=0):
    config = TrainerConfig(
        loss=LossConfig(name="dapo"),
        micro_batch_tokens=160,
        optimizer=OptimizerConfig(lr=2e-3, warmup_steps=2, total_steps=4),
    )
    return Trainer(build_model("test", seed=seed), config, device="cpu")


class _WritesMarker:
    """Unpickling this calls `Path(marker).write_text(...)`: code run from data."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "code ran"))


def _saved(tmp_path) -> tuple[CheckpointManager, Path]:
    trainer = _trainer()
    trainer.train_step(random_episodes(4, seed=1))
    manager = CheckpointManager(tmp_path / "ckpt")
    return manager, manager.save(trainer, data_position={"next_step": 1})


def test_the_rank_state_is_plain_data(tmp_path):
    _, path = _saved(tmp_path)
    local = torch.load(path / "rank0.pt", weights_only=True)  # raises if it held anything else
    assert local["step"] == 1 and isinstance(local["rng"]["numpy"]["keys"], torch.Tensor)


def test_rng_state_round_trips_through_weights_only(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.standard_normal()  # a cached gaussian in the numpy state
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.standard_normal(), np.random.random(), torch.rand(3))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.standard_normal(), np.random.random(), torch.rand(3))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])


def test_a_rank_state_that_would_run_code_is_refused(tmp_path):
    manager, path = _saved(tmp_path)
    marker = tmp_path / "pwned"
    local = torch.load(path / "rank0.pt", weights_only=True)
    local["scheduler"] = _WritesMarker(str(marker))
    torch.save(local, path / "rank0.pt")
    with open(path / "rank0.pt", "rb") as f:  # the file really would write the marker
        assert b"write_text" in f.read()

    with pytest.raises(CheckpointError) as err:
        manager.load(_trainer(seed=1))
    message = str(err.value)
    assert "\n" not in message and str(path / "rank0.pt") in message and "refused" in message
    assert not marker.exists()


def test_a_plain_pickle_that_would_run_code_is_refused(tmp_path):
    manager, path = _saved(tmp_path)
    marker = tmp_path / "pwned"
    with open(path / "rank0.pt", "wb") as f:  # not even a torch zip file: a bare pickle
        pickle.dump({"step": 1, "x": _WritesMarker(str(marker))}, f, protocol=2)
    with pytest.raises(CheckpointError, match=r"rank0\.pt"):
        manager.load(_trainer(seed=1))
    assert not marker.exists()


def test_a_rank_state_with_a_numpy_rng_array_still_loads(tmp_path):
    """Checkpoints written before the numpy RNG state became a tensor (a numpy array in the
    pickle) still resume: array construction is the one extra thing allowed."""
    manager, path = _saved(tmp_path)
    local = torch.load(path / "rank0.pt", weights_only=True)
    np.random.seed(7)
    local["rng"]["numpy"] = np.random.get_state()
    expected = np.random.random()
    torch.save(local, path / "rank0.pt")
    np.random.seed(0)
    manager.load(_trainer(seed=1))
    assert np.random.random() == expected


@pytest.mark.parametrize(
    "pointer", ["../../other_run/checkpoints/rl/step_00000001", "/tmp/step_00000001", "..", "step_1/../../x"]
)
def test_a_latest_pointer_outside_the_directory_is_refused(tmp_path, pointer):
    manager, _ = _saved(tmp_path)
    (manager.directory / "latest").write_text(pointer)
    with pytest.raises(CheckpointError) as err:
        manager.latest()
    assert "\n" not in str(err.value) and repr(pointer) in str(err.value)


@pytest.mark.parametrize("what", ["step", "dcp"])
def test_a_checkpoint_linked_into_another_run_is_refused(tmp_path, what):
    """`latest` names a step directory here, but the directory (or its weights) is a symlink into
    another run: resuming from it would train on that run's weights."""
    manager, path = _saved(tmp_path / "this")
    _, other_path = _saved(tmp_path / "other")
    if what == "step":
        shutil.rmtree(path)
        path.symlink_to(other_path, target_is_directory=True)
    else:
        shutil.rmtree(path / "dcp")
        (path / "dcp").symlink_to(other_path / "dcp", target_is_directory=True)
    with pytest.raises(CheckpointError, match="outside") as err:
        manager.latest()
    assert "\n" not in str(err.value) and str(tmp_path / "other") in str(err.value)
