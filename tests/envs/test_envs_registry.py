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


def test_a_knob_an_init_sets_with_setdefault_is_listed_with_the_value_it_takes(tmp_path, monkeypatch):
    """`toolgym envs` used to list ToolEnv's max_turns 5 for an env whose __init__ does
    `knobs.setdefault("max_turns", 6)`: the value the env uses is 6."""
    (tmp_path / "setdefault_knobs_env.py").write_text(
        "import gymnasium\n"
        "from toolgym.envs import ToolEnv\n\n\n"
        "class Quiz(ToolEnv):\n"
        "    def __init__(self, level=1, **knobs):\n"
        '        knobs.setdefault("max_turns", 6)\n'
        '        knobs.setdefault("tool_format", "json")\n'
        "        if level > 1:\n"
        '            knobs.setdefault("error_penalty", 0.5)  # only sometimes: the default stays\n'
        '        knobs.setdefault("grader", None)  # code, not a config value: not listed\n'
        '        super().__init__(instructions="quiz", **knobs)\n\n\n'
        "class HardQuiz(Quiz):\n"
        "    def __init__(self, max_turns=9, **knobs):\n"
        "        super().__init__(max_turns=max_turns, level=2, **knobs)\n\n\n"
        'gymnasium.register(id="knobs/Quiz-v0", entry_point=Quiz)\n'
        'gymnasium.register(id="knobs/HardQuiz-v0", entry_point=HardQuiz)\n'
        'gymnasium.register(id="knobs/ShortQuiz-v0", entry_point=Quiz, kwargs={"max_turns": 2})\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("setdefault_knobs_env")
    envs = list_envs({"knobs/Quiz-v0", "knobs/HardQuiz-v0", "knobs/ShortQuiz-v0"})
    quiz = envs["knobs/Quiz-v0"]
    assert quiz["max_turns"] == 6 and quiz["tool_format"] == "json" and quiz["level"] == 1
    assert quiz["error_penalty"] == 0.1 and "grader" not in quiz
    assert envs["knobs/HardQuiz-v0"]["max_turns"] == 9 and "level" not in envs["knobs/HardQuiz-v0"]
    assert envs["knobs/ShortQuiz-v0"]["max_turns"] == 2  # registration kwargs win
