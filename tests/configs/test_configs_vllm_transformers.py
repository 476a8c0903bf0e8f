"""policy.implementation = "transformers" end to end: a Granite directory (no native family)
trained through transformers for two RL steps while vLLM samples. Skips without vllm unless
TOOLGYM_REQUIRE_VLLM=1 (the rule of tests/agents/vllm/test_agents_vllm.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from agents_testlib import require_vllm
from test_configs_loop import records, small_config

from toolgym.configs.cli.train import train
from toolgym.configs.load import config_from_dict

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKENIZERS = Path(__file__).resolve().parents[2] / "configs" / "assets" / "tokenizers"


@pytest.fixture(autouse=True)
def need_vllm():
    require_vllm()


def test_two_rl_steps_through_transformers_on_vllm(tmp_path):
    model_dir = tmp_path / "granite"
    config = transformers.GraniteConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        logits_scaling=2.0,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer = next(TOKENIZERS.rglob("tokenizer.json"))
    shutil.copy(tokenizer, model_dir / "tokenizer.json")
    run_dir = tmp_path / "run"
    raw = small_config(
        run_dir,
        model={"path": str(model_dir)},
        sft={"enabled": False},
        trainer={"share_prefix": False},
        policy={
            "implementation": "transformers",
            "backend": "vllm",
            "vllm": {"dtype": "float32", "kv_cache_gib": 0.0625, "max_num_seqs": 16},
        },
        eval={"every_steps": 0, "at_start": False, "at_end": False},
        checkpoint={"every_steps": 0},
    )
    del raw["model"]["name"], raw["model"]["overrides"]
    assert train(config_from_dict(raw)) == 0
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == [1, 2]
    final = run_dir / "final_model"
    assert json.loads((final / "config.json").read_text())["model_type"] == "granite"
    exported = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert type(exported).__name__ == "GraniteForCausalLM"
