"""A user's env reaches `toolgym train` through `env.module` / `--env-module`: imported before the
env is made (from the current directory, as `python -m` would), kept in config.toml for
`--resume`, refused in one line when it cannot be imported; a preset's env kwargs never reach
another env id."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import msgspec
import pytest

from toolgym.configs.assembly.demos import demo_trajectories
from toolgym.configs.assembly.parts import build_renderer
from toolgym.configs.checks import check_environment
from toolgym.configs.cli.main import main
from toolgym.configs.load import ConfigError, load_config

MODULE = "tg_user_bank_env"  # the user's module, written into each test's folder
ENV_ID = "tgbank/Bank-v0"
USER_MODULE = textwrap.dedent(
    f'''
    import gymnasium

    from toolgym.envs import Task, Tool, ToolEnv


    class BankEnv(ToolEnv):
        """What is an account's balance? Balances change every episode."""

        ACCOUNTS = ("alice", "bob")

        def __init__(self, low: int = 0, **knobs):
            self.low = low
            balance = Tool("BALANCE", "an account's balance", self.balance, arg="account")
            example = "User: What is bob's balance?\\nAssistant: BALANCE[bob]\\nTool: BALANCE[bob] = 7\\nAssistant: [ANSWER] 7"
            super().__init__(tools=[balance], instructions="Answer about balances.", example=example, **knobs)

        def balance(self, account: str) -> str:
            return str(self.balances.get(account.lower(), "UNKNOWN_ACCOUNT"))

        def new_task(self) -> Task:
            rng = self.np_random
            self.balances = {{a: int(rng.integers(self.low, self.low + 100)) for a in self.ACCOUNTS}}
            who = str(rng.choice(self.ACCOUNTS))
            answer = self.balances[who]
            return Task(f"What is {{who}}'s balance?", answer, (f"BALANCE[{{who}}]",))


    if "{ENV_ID}" not in gymnasium.registry:
        gymnasium.register("{ENV_ID}", entry_point=BankEnv)
    '''
)

TINY = textwrap.dedent(
    """
    [run]
    steps = 1
    export_hf = false
    plot = false

    [model]
    name = "test"
    overrides = { vocab_size = 1024 }

    [policy]
    max_batch_size = 8
    max_seq_len = 256

    [rollout]
    group_size = 2
    max_turns = 2
    max_tokens_per_turn = 8
    max_tokens_per_episode = 16

    [batch]
    groups_per_batch = 1

    [eval]
    every_steps = 0
    at_start = false
    num_tasks = 2
    num_examples = 0
    record = false

    [logging]
    progress_bar = false
    headline_metrics = []
    """
)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A folder holding the user's env module, importable in this process (as the current
    directory is in a `toolgym` process)."""
    (tmp_path / f"{MODULE}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _toolgym(args, cwd):
    """The installed `toolgym` script (the console entry point, not `python -m`), run in `cwd`."""
    script = Path(sys.executable).with_name("toolgym")
    if not script.is_file():
        pytest.skip("no toolgym console script next to this interpreter")
    return subprocess.run(
        [str(script), *args], capture_output=True, text=True, cwd=cwd, env=dict(os.environ), timeout=600
    )


@pytest.mark.slow
def test_train_imports_env_module_from_the_current_directory_and_again_on_resume(tmp_path):
    (tmp_path / f"{MODULE}.py").write_text(USER_MODULE)
    config = tmp_path / "bank.toml"
    config.write_text(TINY + f'\n[env]\nid = "{ENV_ID}"\nmodule = "{MODULE}"\nkwargs = {{ low = 50 }}\n')
    done = _toolgym(["train", "bank.toml", "--set", "run.run_dir=run", "--no-progress"], tmp_path)
    assert done.returncode == 0, done.stderr
    written = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert written["env"] == {"id": ENV_ID, "kwargs": {"low": 50}, "module": [MODULE]}
    # a fresh process reads config.toml alone: it imports the module again
    done = _toolgym(["train", "--resume", "run", "--no-progress"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "resuming at step 1" in done.stdout


def test_a_module_that_cannot_be_imported_is_one_line_naming_the_key(tmp_path, capsys):
    run_dir = tmp_path / "run"
    for extra in (["--set", "env.module=no_such_module_xyz"], ["--env-module", "no_such_module_xyz"]):
        args = ["train", "--no-progress", "--set", f"run.run_dir={run_dir}", "--set", "sft.enabled=false"]
        assert main([*args, *extra]) == 2
        out, err = capsys.readouterr()
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith("config error: env.module no_such_module_xyz: cannot import it: "), err
        assert "sft:" not in out and not run_dir.exists()


def test_a_module_that_raises_on_import_is_one_line(user_dir, capsys):
    (user_dir / "tg_broken_user_env.py").write_text("raise RuntimeError('no bank today')\n")
    assert main(["train", "--set", "env.module=tg_broken_user_env", "--set", "sft.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "config error: env.module tg_broken_user_env: cannot import it: RuntimeError: no bank today"
    )


def test_env_module_key_and_flag_join_in_one_list(capsys):
    config, _ = load_config(None, ['env.module="a.b"'], env_modules=["c", "a.b", "c"])
    assert config.env.module == ["a.b", "c"] and config.env.modules == ["a.b", "c"]
    assert load_config(None, ["env.module=[]"])[0].env.module == []
    assert load_config(None)[0].env.module == []
    assert main(["train", "--env-module", "x.y", "--env-module", "z", "--print-config"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["env"]["module"] == ["x.y", "z"]
    assert main(["train", "--set", "env.module=bad-name", "--print-config"]) == 2
    assert "config error: env.module: must be module names" in capsys.readouterr().err


def test_check_environment_imports_the_module_before_making_the_env(user_dir):
    sys.modules.pop(MODULE, None)
    config, _ = load_config(None, [f"env.id={ENV_ID}", "sft.enabled=false"], env_modules=[MODULE])
    check_environment(config)
    assert MODULE in sys.modules


# ---- a preset's env kwargs belong to its env id ------------------------------------------------


def test_preset_kwargs_never_reach_another_env_id(user_dir):
    config, raw = load_config("zorplex_tiny", [f"env.id={ENV_ID}"], env_modules=[MODULE])
    assert config.env.kwargs == {} and raw["env"].get("kwargs", {}) == {} and config.sft.env_kwargs is None
    check_environment(config)  # BankEnv(tier="simple") used to raise TypeError here
    # kwargs given with --set still apply, in any order with env.id
    for overrides in ([f"env.id={ENV_ID}", "env.kwargs.low=7"], ["env.kwargs.low=7", f"env.id={ENV_ID}"]):
        assert load_config("zorplex_tiny", overrides)[0].env.kwargs == {"low": 7}
    assert load_config("zorplex_tiny", [f"env.id={ENV_ID}", "env.kwargs={low = 3}"])[0].env.kwargs == {
        "low": 3
    }
    # the preset's own id keeps its kwargs
    same = load_config("zorplex_tiny", ["env.id=toolgym/Zorplex-v0", "env.kwargs.table_seed=1"])[0]
    assert same.env.kwargs == {"tier": "simple", "table_seed": 1}
    assert load_config("zorplex_tiny")[0].env.kwargs == {"tier": "simple"}


def test_a_files_sft_env_kwargs_stay_with_its_env_id(tmp_path):
    config = tmp_path / "mine.toml"
    config.write_text('[env]\nkwargs = { tier = "recursive" }\n\n[sft]\nenv_kwargs = { tier = "simple" }\n')
    kept = load_config(config)[0]  # no [env] id: the default id is the file's
    assert kept.env.kwargs == {"tier": "recursive"} and kept.sft.env_kwargs == {"tier": "simple"}
    moved = load_config(config, [f"env.id={ENV_ID}", "sft.env_kwargs.low=1"])[0]
    assert moved.env.kwargs == {} and moved.sft.env_kwargs == {"low": 1}


def test_train_cli_with_a_preset_and_another_env_id_prints_no_preset_kwargs(user_dir, capsys):
    args = ["train", "zorplex_tiny", "--set", f"env.id={ENV_ID}", "--env-module", MODULE, "--print-config"]
    assert main(args) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["env"] == {"id": ENV_ID, "kwargs": {}, "module": [MODULE]}


def test_oracle_demos_recorded_in_processes_are_those_one_process_records(user_dir, monkeypatch):
    """`sft.processes`: spawned processes import the user's module themselves (from the current
    directory, as the run does) and record their shares; the demos are the same, in order."""
    monkeypatch.chdir(user_dir)
    overrides = [f"env.id={ENV_ID}", "sft.enabled=true", "sft.num_tasks=7", "env.kwargs.low=50"]
    one, _ = load_config(None, overrides, env_modules=[MODULE])
    two, _ = load_config(None, [*overrides, "sft.processes=2"], env_modules=[MODULE])
    check_environment(one)
    renderer, _ = build_renderer(one)
    alone, source = demo_trajectories(one, renderer)
    shared, shared_source = demo_trajectories(two, renderer)
    assert source == shared_source and len(alone) == 7
    assert [_untimed(t) for t in shared] == [_untimed(t) for t in alone]
    assert all(t.env_id == ENV_ID and t.stop_reason == "answered" and t.total_reward > 0 for t in alone)
    assert len({t.task_seed for t in alone}) == 7


def test_oracle_demos_recorded_in_processes_show_their_progress(user_dir, monkeypatch, capsys):
    """The bar counts the demonstrations every recording process finishes, to the last one."""
    monkeypatch.chdir(user_dir)
    overrides = [f"env.id={ENV_ID}", "sft.enabled=true", "sft.num_tasks=5", "sft.processes=2"]
    config, _ = load_config(None, overrides, env_modules=[MODULE])
    renderer, _ = build_renderer(config)
    demos, _ = demo_trajectories(config, renderer, progress=True)
    assert len(demos) == 5
    bar = capsys.readouterr().err
    assert "sft demos" in bar and "5/5" in bar, bar


def test_a_recording_process_that_fails_raises_its_error(user_dir, monkeypatch):
    """A share that fails (here: the user's module raises when a recording process imports it)
    ends the recording with that share's error, not a wait for demonstrations that never come."""
    monkeypatch.chdir(user_dir)
    (user_dir / "tg_fails_in_workers.py").write_text(
        "import multiprocessing\n"
        "if multiprocessing.parent_process() is not None:\n"
        "    raise RuntimeError('no recording in this process')\n"
    )
    modules = [MODULE, "tg_fails_in_workers"]
    overrides = [f"env.id={ENV_ID}", "sft.enabled=true", "sft.num_tasks=4", "sft.processes=2"]
    config, _ = load_config(None, overrides, env_modules=modules)
    renderer, _ = build_renderer(config)
    with pytest.raises(ValueError, match="tg_fails_in_workers: cannot import it: RuntimeError: no recording"):
        demo_trajectories(config, renderer, progress=True)


def _untimed(trajectory) -> bytes:
    """The trajectory without its timings (metrics generate_s, env_s, wall_s)."""
    metrics = {k: v for k, v in trajectory.metrics.items() if not k.endswith("_s")}
    return msgspec.json.encode(msgspec.structs.replace(trajectory, metrics=metrics))


def test_sft_processes_must_not_be_negative():
    with pytest.raises(ConfigError, match=r"sft\.processes: must be >= 0 \(0: one per usable core\), got -1"):
        load_config(None, ["sft.processes=-1"])


_ORPHANED_POOL = '''
import os, sys, time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing
from toolgym.configs.assembly.demos import exit_with_parent

def share(path):
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    time.sleep(3600)  # a share that outlives its parent

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(1, mp_context=context, initializer=exit_with_parent, initargs=(os.getpid(),))
    pool.submit(share, sys.argv[1]).result()
'''


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie no reaper has collected yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_recording_process_ends_when_its_parent_is_killed(tmp_path):
    script, pid_file = tmp_path / "parent.py", tmp_path / "worker.pid"
    script.write_text(_ORPHANED_POOL)
    parent = subprocess.Popen([sys.executable, str(script), str(pid_file)])
    try:
        while not pid_file.exists():  # the worker is up and inside its share
            assert parent.poll() is None, "the parent ended before its worker started"
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        assert _running(worker)
    finally:
        parent.kill()  # SIGKILL: no cleanup of its own runs
        parent.wait()
    give_up = time.monotonic() + 120  # a hang bound only: the watch ends it within a second
    while _running(worker):
        assert time.monotonic() < give_up, f"worker {worker} still runs after its parent was killed"
        time.sleep(0.05)
