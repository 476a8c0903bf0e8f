"""policy.implementation = "transformers": the settings it needs, each refused in one line."""

from __future__ import annotations

import re

import pytest

from toolgym.agents.model.families import family
from toolgym.configs.load import ConfigError, load_config

OK = [
    "policy.implementation=transformers",
    "model.name=",
    "model.path=/some/hf_dir",
    "policy.backend=vllm",
    "trainer.share_prefix=false",
]


def test_transformers_implementation_accepted_with_its_settings():
    config, _ = load_config(None, OK)
    assert config.policy.implementation == "transformers"
    assert load_config(None, [])[0].policy.implementation == "native"
    # LoRA trains through the same adapter code as a native family's (agents/model/lora.py)
    assert load_config(None, [*OK, "policy.lora.rank=8"])[0].policy.lora.rank == 8


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ("model.path=", "model.path"),
        ("policy.backend=torch", "policy.backend"),
        ("trainer.share_prefix=true", "trainer.share_prefix"),
        ("trainer.compile=true", "trainer.compile"),
    ],
)
def test_transformers_implementation_refuses_what_it_lacks(change, where):
    key = change.split("=")[0]
    overrides = [o for o in OK if not o.startswith(key + "=")] + [change]
    if key == "model.path":
        overrides.remove("model.name=")
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert where in str(info.value) and "implementation" in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_model_type_names_the_fallback():
    with pytest.raises(ValueError, match=re.escape('policy.implementation = "transformers"')):
        family("granite")
