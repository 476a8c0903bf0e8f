"""Paths stay where they belong: run.name is a name, the runs folder is run.root, the checkpoint
directory and the `latest` pointer stay inside the run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolgym.configs.cli.main import main
from toolgym.configs.load import ConfigError, load_config
from toolgym.configs.run_dir import RunDir, create_run_dir, default_run_path


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["../../x", "/tmp/abs", "..", ".", "a/b", "a\\b"])
def test_a_run_name_that_is_a_path_is_refused_at_load(name):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"run.name='{name}'"])
    message = str(err.value)
    assert message.startswith("config error: run.name: ") and "\n" not in message and repr(name) in message


def test_a_run_name_is_still_a_name():
    config, _ = load_config(None, ["run.name='my-run_2.v1'"])
    assert config.run.name == "my-run_2.v1"


def test_the_cli_refuses_a_path_as_run_name_and_writes_nothing(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work" / "deep"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert main(["train", "--set", "run.name=../../x", "--set", "run.steps=1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: run.name: ")
    assert _snapshot(tmp_path) == {}  # no run directory anywhere, inside or outside


def test_the_runs_folder_is_its_own_setting(tmp_path):
    config, _ = load_config(None, [f"run.root={str(tmp_path / 'my_runs')!r}", "run.name='exp'"])
    path = default_run_path(config)
    assert path.parent == tmp_path / "my_runs" and path.name.startswith("exp-")
    default, _ = load_config(None, ["run.name='exp'"])
    assert default_run_path(default).parent == Path("runs")
    explicit, _ = load_config(None, [f"run.run_dir={str(tmp_path / 'exactly')!r}"])
    assert default_run_path(explicit) == tmp_path / "exactly"


@pytest.mark.parametrize("directory", ["/tmp/elsewhere", "../other_run", "ckpt/../../x", "~/ckpt", "C:\\x"])
def test_a_checkpoint_directory_outside_the_run_is_refused(directory):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"checkpoint.directory={directory!r}"])
    message = str(err.value)
    assert message.startswith("config error: checkpoint.directory: ") and "\n" not in message
    if not directory.startswith("~"):  # the schema's rule is stricter (a folder named ~ is inside)
        with pytest.raises(ConfigError, match=r"checkpoint\.directory"):
            RunDir("runs/x", directory)


def test_a_checkpoint_directory_inside_the_run_is_kept(tmp_path):
    config, _ = load_config(None, ["checkpoint.directory='ckpt/nested'"])
    assert RunDir(tmp_path, config.checkpoint.directory).rl_checkpoints == tmp_path / "ckpt/nested/rl"


def test_resume_refuses_a_latest_pointer_into_another_run(tmp_path, monkeypatch, capsys):
    """A `latest` of ../../../other_run/... is refused with one line; nothing is written."""
    monkeypatch.chdir(tmp_path)
    config, _ = load_config(None, ["run.steps=1", "sft.enabled=false"])
    run = create_run_dir(tmp_path / "runs" / "mine", config)
    other = tmp_path / "other_run" / "checkpoints" / "rl" / "step_00000001"
    other.mkdir(parents=True)
    (other / "meta.json").write_text('{"step": 1, "world_size": 1, "data_position": {}}')
    run.rl_checkpoints.mkdir(parents=True)
    pointer = "../../../../other_run/checkpoints/rl/step_00000001"
    (run.rl_checkpoints / "latest").write_text(pointer)
    assert (run.rl_checkpoints / pointer / "meta.json").is_file()  # it would be followed
    before = _snapshot(tmp_path)

    for extra in ([], ["--set", "run.steps=3"]):  # with --set, config.toml is not rewritten either
        assert main(["train", "--resume", str(run.root), "--no-progress", *extra]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and "latest" in err[0] and repr(pointer) in err[0] and "refused" in err[0]
        assert _snapshot(tmp_path) == before


class _WritesMarker:
    """Unpickling this writes a file: code run from data."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "code ran"))


def test_resume_refuses_a_rank_state_that_would_run_code(tmp_path, capsys):
    """`toolgym train --resume` with a crafted rank0.pt: one line naming the file, no code run."""
    import torch

    from toolgym.configs.cli.train import train
    from toolgym.configs.load import config_from_dict

    run_dir = tmp_path / "run"
    raw = {
        "run": {"steps": 1, "run_dir": str(run_dir), "export_hf": False, "plot": False},
        "model": {"name": "test", "overrides": {"vocab_size": 1024}},
        "policy": {"max_batch_size": 8, "max_seq_len": 256},
        "rollout": {"group_size": 2, "max_turns": 2, "max_tokens_per_turn": 8, "max_tokens_per_episode": 16},
        "batch": {"groups_per_batch": 2},
        "eval": {"at_start": False, "at_end": False, "every_steps": 0},
        "checkpoint": {"every_steps": 1},
        "logging": {"progress_bar": False},
    }
    assert train(config_from_dict(raw)) == 0
    rank_file = run_dir / "checkpoints" / "rl" / "step_00000001" / "rank0.pt"
    local = torch.load(rank_file, weights_only=True)
    marker = tmp_path / "pwned"
    local["scheduler"] = _WritesMarker(str(marker))
    torch.save(local, rank_file)
    capsys.readouterr()
    before = _snapshot(tmp_path)

    assert main(["train", "--resume", str(run_dir), "--set", "run.steps=2", "--no-progress"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and str(rank_file) in err[0] and "refused" in err[0]
    assert not marker.exists() and _snapshot(tmp_path) == before  # config.toml not rewritten either
