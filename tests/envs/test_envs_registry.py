"""Registration under toolgym/ and list_envs()."""

import importlib
import json
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

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
    env = gymnasium.make(env_id)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    _, info = env.reset(seed=0)
    assert {"system_prompt", "question", "answer"} <= set(info)
