"""A user's env module through `toolgym envs|record|replay`: `envs --env-module` lists what it
registers; `record` fails when every episode errored and counts them in a mixed batch;
`replay --verify` reports error-only episodes as errors, never as exact."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from toolgym.configs.cli.main import main
from toolgym.rollouts.recording.format import read_recording

MODULE = "tg_user_shop_env"  # the user's module, written into each test's folder
USER_MODULE = textwrap.dedent(
    '''
    import gymnasium

    from toolgym.envs import Task, Tool, ToolEnv


    class ShopEnv(ToolEnv):
        """What does an item cost? Prices change every episode."""

        ITEMS = ("pear", "plum", "fig")

        def __init__(self, markup: int = 0, **knobs):
            self.markup = markup
            price = Tool("PRICE", "an item's price", self.price, arg="item")
            example = "User: What does a fig cost?\\nAssistant: PRICE[fig]\\nTool: PRICE[fig] = 3\\nAssistant: [ANSWER] 3"
            super().__init__(tools=[price], instructions="Answer about prices.", example=example, **knobs)

        def price(self, item: str) -> str:
            return str(self.prices.get(item.lower(), "UNKNOWN_ITEM"))

        def new_task(self) -> Task:
            rng = self.np_random
            self.prices = {i: self.markup + int(rng.integers(1, 50)) for i in self.ITEMS}
            item = str(rng.choice(self.ITEMS))
            answer = self.prices[item]
            return Task(f"What does a {item} cost?", answer, (f"PRICE[{item}]",))


    class ClosedShopEnv(ShopEnv):
        """Every step raises: every episode ends as env_error."""

        def step(self, action):
            raise RuntimeError("the shop is closed")


    _closed = {}  # task seed -> whether the shop is closed: every second seed this process sees


    class FlakyShopEnv(ShopEnv):
        """Raises on the first step of every second task seed (the same seeds when replayed)."""

        def reset(self, *, seed=None, options=None):
            self.closed = _closed.setdefault(seed, len(_closed) % 2 == 1)
            return super().reset(seed=seed, options=options)

        def step(self, action):
            if self.closed:
                raise RuntimeError("closed for lunch")
            return super().step(action)


    for env_id, entry in (("tgshop/Shop-v0", ShopEnv), ("tgshop/Closed-v0", ClosedShopEnv), ("tgshop/Flaky-v0", FlakyShopEnv)):
        if env_id not in gymnasium.registry:
            gymnasium.register(env_id, entry_point=entry, kwargs={"markup": 5} if entry is FlakyShopEnv else {})
    '''
)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture
def tokenizer_file(tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def record(tokenizer_file, env_id, out, tasks=3):
    return main([
        "record", "--env", env_id, "--env-module", MODULE, "--policy", "oracle", "--tasks", str(tasks),
        "--group-size", "2", "--out", str(out), "--tokenizer", tokenizer_file, "--no-progress",
    ])  # fmt: skip


def replay_verify(tokenizer_file, out):
    return main(
        [
            "replay",
            str(out),
            "--verify",
            "--summary-only",
            "--env-module",
            MODULE,
            "--tokenizer",
            tokenizer_file,
        ]
    )


def test_envs_lists_the_ids_a_module_registers_with_their_defaults(user_dir, capsys):
    assert main(["envs", "--env-module", MODULE]) == 0
    out = capsys.readouterr().out
    for env_id in ("tgshop/Shop-v0", "tgshop/Closed-v0", "tgshop/Flaky-v0", "toolgym/Zorplex-v0"):
        assert env_id in out
    assert '"markup": 0' in out and '"markup": 5' in out and '"max_turns"' in out
    # imported already (a second import registers nothing new): still listed, by entry point
    assert main(["envs", "--env-module", MODULE]) == 0
    assert "tgshop/Shop-v0" in capsys.readouterr().out
    # without the module, toolgym's own only
    assert main(["envs"]) == 0
    assert "tgshop" not in capsys.readouterr().out


def test_envs_with_a_module_that_cannot_be_imported_is_one_line(capsys):
    assert main(["envs", "--env-module", "no_such_module_xyz"]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip()
        == "toolgym envs: error: --env-module no_such_module_xyz: cannot import it: No module named 'no_such_module_xyz'"
    )


def test_the_toolgym_script_imports_env_modules_from_the_current_directory(tmp_path):
    script = Path(sys.executable).with_name("toolgym")
    if not script.is_file():
        pytest.skip("no toolgym console script next to this interpreter")
    (tmp_path / f"{MODULE}.py").write_text(USER_MODULE)
    done = subprocess.run(
        [str(script), "envs", "--env-module", MODULE],
        capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "tgshop/Shop-v0" in done.stdout


def test_record_and_verify_a_user_env(user_dir, tokenizer_file, tmp_path, capsys):
    out = tmp_path / "shop.jsonl"
    assert record(tokenizer_file, "tgshop/Shop-v0", out) == 0
    assert "errored" not in capsys.readouterr().out
    assert replay_verify(tokenizer_file, out) == 0
    assert "verify: 6/6 episodes replay exactly" in capsys.readouterr().out


def test_record_fails_when_every_episode_errored_and_verify_counts_them(
    user_dir, tokenizer_file, tmp_path, capsys
):
    out = tmp_path / "closed.jsonl"
    assert record(tokenizer_file, "tgshop/Closed-v0", out) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("toolgym record: error: every episode errored (6 of 6: env_error or no steps)")
    assert "the shop is closed" in err
    assert all(t.stop_reason == "env_error" for t in read_recording(out)[1])  # written all the same
    assert replay_verify(tokenizer_file, out) == 1
    text = " ".join(capsys.readouterr().out.split())
    assert "verify: 0/6 episodes replay exactly, 6 errored (env_error or no steps)" in text
    assert text.count(") errored: ") == 6 and "the shop is closed" in text


def test_a_mixed_batch_records_with_exit_0_and_counts_the_errored(user_dir, tokenizer_file, tmp_path, capsys):
    out = tmp_path / "flaky.jsonl"
    assert record(tokenizer_file, "tgshop/Flaky-v0", out, tasks=4) == 0
    text = " ".join(capsys.readouterr().out.split())
    failed = sum(t.stop_reason == "env_error" for t in read_recording(out)[1])
    assert failed == 4  # 2 of the 4 task seeds, a group of 2 each
    assert (
        f"errored: {failed} of 8 episodes (env_error or no steps); the first:" in text
        and "closed for lunch" in text
    )
    assert replay_verify(tokenizer_file, out) == 1
    text = " ".join(capsys.readouterr().out.split())
    assert f"verify: {8 - failed}/8 episodes replay exactly, {failed} errored" in text
