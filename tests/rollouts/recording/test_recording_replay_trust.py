"""A recording never causes an import: `replay --verify` makes only envs that are registered or
whose module the user named (`--env-module`), through the real CLI in a subprocess."""

import os
import subprocess
import sys
import textwrap

import pytest

from toolgym.envs.registry import EnvModuleNotAllowed, check_env_id, import_env_modules

# A user env module with a side effect on import: it writes the file $MARKER, then registers
# Env-v0 (the Zorplex env under another id).
USER_MODULE = textwrap.dedent(
    """
    import os
    import pathlib

    import gymnasium

    pathlib.Path(os.environ["MARKER"]).write_text("imported")
    if "Env-v0" not in gymnasium.registry:
        gymnasium.register(id="Env-v0", entry_point="toolgym.envs.tasks.zorplex:ZorplexEnv")
    """
)


def _cli(args, tmp_path, marker):
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MARKER": str(marker)}
    return subprocess.run(
        [sys.executable, "-m", "toolgym.configs.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )


@pytest.fixture
def recording(tmp_path):
    """A recording whose header and records name `marker_env_mod:Env-v0` (recorded by a user who
    trusts that module: `record --env` names it)."""
    (tmp_path / "marker_env_mod.py").write_text(USER_MODULE)
    out = tmp_path / "rec.jsonl"
    done = _cli(
        [
            "record", "--env", "marker_env_mod:Env-v0", "--env-kwargs", '{"tier": "simple"}',
            "--policy", "oracle", "--tasks", "2", "--group-size", "2", "--out", str(out), "--no-progress",
        ],
        tmp_path,
        tmp_path / "recorded_marker",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "recorded_marker").exists()  # recording imported it: the user named it
    assert '"env_id":"marker_env_mod:Env-v0"' in out.read_text().replace(" ", "")
    return out


def test_replay_verify_refuses_a_module_the_recording_names(tmp_path, recording):
    marker = tmp_path / "replay_marker"
    done = _cli(["replay", str(recording), "--verify", "--summary-only"], tmp_path, marker)
    assert done.returncode != 0
    assert not marker.exists()  # the module never ran
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "'marker_env_mod'" in lines[0] and "--env-module marker_env_mod" in lines[0]


def test_replay_verify_with_env_module_replays(tmp_path, recording):
    marker = tmp_path / "replay_marker"
    done = _cli(
        ["replay", str(recording), "--verify", "--summary-only", "--env-module", "marker_env_mod"],
        tmp_path,
        marker,
    )
    assert done.returncode == 0, done.stderr
    assert "verify: 4/4 episodes replay exactly" in done.stdout
    assert marker.exists()  # the user allowed it


def test_replay_without_verify_makes_no_env(tmp_path, recording):
    marker = tmp_path / "replay_marker"
    done = _cli(["replay", str(recording), "--limit", "1"], tmp_path, marker)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()


def test_check_env_id():
    check_env_id("toolgym/Zorplex-v0")  # registered
    check_env_id("os:Whatever-v0")  # already imported: gymnasium's import is a no-op
    with pytest.raises(EnvModuleNotAllowed, match="--env-module this"):
        check_env_id("this:Foo-v0")
    assert "this" not in sys.modules


def test_a_record_naming_another_module_is_reported_not_imported():
    """A record's own env_id (not only the header's) is checked before the env is made."""
    from toolgym.rollouts.recording.replay import verify_trajectory
    from toolgym.rollouts.types import StopReason, Trajectory

    trajectory = Trajectory(
        env_id="this:Foo-v0", env_kwargs={}, task_seed=0, group_id=0, transitions=[],
        stop_reason=StopReason.ANSWERED,
    )  # fmt: skip
    problems = verify_trajectory(trajectory)
    assert any("--env-module this" in p for p in problems) and "this" not in sys.modules


def test_an_env_module_that_cannot_be_imported_is_one_line():
    with pytest.raises(ValueError, match="--env-module no_such_module_xyz: cannot import it"):
        import_env_modules(["no_such_module_xyz"])


def test_replay_verify_of_an_env_no_module_registers_is_one_line_with_the_fix(tmp_path):
    """A user env registered under its own namespace (`my/Bank-v0`): without --env-module, verify
    used to print gymnasium's "Namespace my not found" once per episode."""
    (tmp_path / "my_envs.py").write_text(
        "import gymnasium\n"
        "gymnasium.register(id='my/Env-v0', entry_point='toolgym.envs.tasks.zorplex:ZorplexEnv')\n"
    )
    out = tmp_path / "rec.jsonl"
    args = ["record", "--env", "my/Env-v0", "--env-module", "my_envs", "--policy", "oracle", "--tasks", "2"]
    assert _cli([*args, "--out", str(out), "--no-progress"], tmp_path, tmp_path / "m").returncode == 0
    done = _cli(["replay", str(out), "--verify", "--summary-only"], tmp_path, tmp_path / "m")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "'my/Env-v0', which no imported module registers" in lines[0] and "--env-module" in lines[0]
    assert "Namespace" not in done.stdout
