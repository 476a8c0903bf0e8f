"""Registration under toolgym/ and list_envs()."""

import importlib
import json
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from sandbox_testlib import make_env

import toolgym.envs
from toolgym.envs import list_envs


def test_registered_ids_and_default_kwargs():
    envs = list_envs()
    assert {"toolgym/Zorplex-v0", "toolgym/SumDigits-v0"} <= set(envs)
    assert all(env_id.startswith("toolgym/") for env_id in envs)
    zorplex = envs["toolgym/Zorplex-v0"]
    assert zorplex["tier"] == "simple" and zorplex["difficulty"] is None and zorplex["table_seed"] is None
    assert zorplex["max_turns"] == 5 and zorplex["correct_reward"] == 1.0 and zorplex["format_reward"] == 0.2
    sum_digits = envs["toolgym/SumDigits-v0"]
    assert sum_digits["max_turns"] == 1 and sum_digits["min_value"] == 10 and sum_digits["max_value"] == 99
    json.dumps(envs)


def test_registration_is_idempotent():
    before = dict(gymnasium.registry)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # re-registering would warn "Overriding environment"
        importlib.reload(toolgym.envs)
        toolgym.envs.register_envs()
    assert set(gymnasium.registry) == set(before)


@pytest.mark.parametrize("env_id", sorted(list_envs()))
def test_every_registered_env_passes_check_env(env_id):
    env = make_env(env_id)  # skipped where an env's code sandbox cannot start
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    _, info = env.reset(seed=0)
    assert {"system_prompt", "question", "answer"} <= set(info)


def test_knobs_a_subclass_fixes_are_not_listed(tmp_path, monkeypatch):
    """README's BankEnv passes tool_format="json" to ToolEnv itself: `toolgym envs` used to list
    tool_format as its knob, and passing it raised "multiple values"."""
    (tmp_path / "bank_knobs_env.py").write_text(
        "import gymnasium\n"
        "from toolgym.envs import ToolEnv\n\n\n"
        "class BankEnv(ToolEnv):\n"
        "    def __init__(self, max_turns=6, **knobs):\n"
        '        super().__init__(instructions="bank", tool_format="json", max_turns=max_turns, **knobs)\n\n\n'
        'gymnasium.register(id="knobs/Bank-v0", entry_point=BankEnv)\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("bank_knobs_env")
    knobs = list_envs({"knobs/Bank-v0"})["knobs/Bank-v0"]
    assert "tool_format" not in knobs and "instructions" not in knobs
    assert knobs["max_turns"] == 6 and "correct_reward" in knobs  # its own, and ToolEnv's others
    assert "tool_format" in list_envs()["toolgym/Zorplex-v0"]  # a knob where the env takes it
