"""Checkpoint directories: ours load in transformers (and tokenizer files alongside), transformers'
load in ours (single file and sharded), bad directories fail with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from toolgym.agents.model.checkpoint import hf_named_tensors, load_hf_checkpoint, save_hf_checkpoint
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import build_model

transformers = pytest.importorskip("transformers")


def randomised(name: str, seed: int = 0):
    model = build_model(name, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("name", ["test", "test-qwen3"])
def test_transformers_saved_checkpoint_loads(tmp_path, name: str) -> None:
    ours = randomised(name)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**ours.config.to_hf_dict())
    )
    hf.load_state_dict(ours.state_dict())
    hf.save_pretrained(tmp_path)
    loaded = load_hf_checkpoint(tmp_path)
    assert loaded.config == ours.config
    tokens = torch.randint(0, ours.config.vocab_size, (2, 17))
    with torch.no_grad():
        assert (logits(loaded, tokens) - hf.eval()(tokens).logits).abs().max() <= 1e-5
    if ours.config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_sharded_checkpoints_load(tmp_path) -> None:
    ours = randomised("test-qwen3")
    tokens = torch.randint(0, 256, (2, 9))
    # Sharded by transformers...
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**ours.config.to_hf_dict())
    )
    hf.load_state_dict(ours.state_dict())
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert torch.equal(logits(load_hf_checkpoint(tmp_path / "hf"), tokens), logits(ours, tokens))
    # ...and by us: transformers reads our shards too.
    save_hf_checkpoint(ours, ours.config, tmp_path / "ours", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert torch.equal(logits(load_hf_checkpoint(tmp_path / "ours"), tokens), logits(ours, tokens))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(tokens).logits - logits(ours, tokens)).abs().max() <= 1e-5


def test_save_round_trip_dtype_and_tied(tmp_path) -> None:
    model = randomised("tiny")
    save_hf_checkpoint(model, model.config, tmp_path, dtype=torch.bfloat16)
    stored = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in stored  # tied: HF stores the embedding only
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    config = json.loads((tmp_path / "config.json").read_text())
    assert (
        config["architectures"] == ["Qwen3ForCausalLM"] and config["torch_dtype"] == "bfloat16"
    )  # tiny: qwen3
    loaded = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.bfloat16().float())
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_hf_named_tensors_skips_tied_head() -> None:
    tied, untied = build_model("tiny"), build_model("test-qwen3")
    names = [n for n, _ in hf_named_tensors(tied)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert len(names) == len(set(names)) == len(tied.state_dict()) - 1
    assert "lm_head.weight" in dict(hf_named_tensors(untied))
    # No copies: the tensors share storage with the parameters.
    assert dict(hf_named_tensors(tied))["model.norm.weight"].data_ptr() == tied.model.norm.weight.data_ptr()


SHIPPED_TOKENIZER = Path(__file__).resolve().parents[3] / "configs" / "assets" / "tokenizer.json"


@pytest.mark.skipif(not SHIPPED_TOKENIZER.is_file(), reason="configs/assets/tokenizer.json not built yet")
def test_saved_directory_loads_tokenizer_in_transformers(tmp_path) -> None:
    model = build_model("tiny")
    save_hf_checkpoint(model, model.config, tmp_path, tokenizer_path=SHIPPED_TOKENIZER)
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert theirs.eos_token == "<|im_end|>" and theirs.eos_token_id == ours.token_to_id("<|im_end|>")
    for text in [
        "What is the digit sum of [12, 345]?",
        "LOOKUP[apple] café 🙂\n\n  x",
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        assert theirs.encode(text) == ours.encode(text).ids
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path) is not None


def test_bad_directories_fail_clearly(tmp_path) -> None:
    model = build_model("test")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_hf_checkpoint(tmp_path)
    save_hf_checkpoint(model, model.config, tmp_path)
    state = load_file(tmp_path / "model.safetensors")

    def rewrite(tensors):
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})

    rewrite({k: v for k, v in state.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match=r"missing tensors.*model\.norm\.weight"):
        load_hf_checkpoint(tmp_path)
    rewrite(state | {"model.layers.0.mlp.gate_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="shape"):
        load_hf_checkpoint(tmp_path)
    rewrite(state | {"model.extra.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="unexpected"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(ModelConfig.named("test").to_hf_dict() | {"model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="model_type"):
        load_hf_checkpoint(tmp_path)
