"""policy.implementation = "transformers": a family toolgym has no native code for (Granite),
run through transformers with the native model's training interface."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from toolgym.agents.model.hf_fallback import load_transformers_model  # noqa: E402
from toolgym.trainers.logprobs import token_logprobs  # noqa: E402


def _granite_dir(tmp_path):
    config = transformers.GraniteConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        logits_scaling=2.0,
        residual_multiplier=0.5,
        embedding_multiplier=3.0,
        attention_multiplier=0.3,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    return tmp_path


def test_adapter_logits_equal_transformers(tmp_path):
    directory = _granite_dir(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    model = load_transformers_model(directory)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = model(ids, positions)
        via_head = model(ids, positions, head=lambda h, lm_head: lm_head(h))
    assert not torch.allclose(expected, torch.zeros_like(expected))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(via_head, got)
    names = set(model.state_dict())
    assert names == set(reference.state_dict())
    assert len(model.model.layers) == 2


def test_adapter_refuses_shared_prefix_cache(tmp_path):
    model = load_transformers_model(_granite_dir(tmp_path))
    with pytest.raises(ValueError, match="share_prefix"):
        model(torch.zeros(1, 3, dtype=torch.long), None, cache=object())


def test_gradient_step_changes_weights(tmp_path):
    model = load_transformers_model(_granite_dir(tmp_path))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    logits = model(ids, torch.arange(9).expand(2, 9))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    assert torch.isfinite(loss)
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert "lm_head.weight" in changed and any(k.startswith("model.layers.1.") for k in changed)


def test_trainer_logprobs_through_adapter_equal_direct(tmp_path):
    directory = _granite_dir(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    model = load_transformers_model(directory)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model(
            ids,
            torch.arange(7)[None],
            head=lambda h, lm_head: token_logprobs(lm_head(h)[:, :-1], ids[:, 1:], 0.7),
        )
        direct = torch.log_softmax(reference(input_ids=ids).logits[:, :-1] / 0.7, -1).gather(
            -1, ids[:, 1:, None]
        )[..., 0]
    torch.testing.assert_close(got, direct)


def test_shape_config_reads_the_sizes(tmp_path):
    from toolgym.agents.model.hf_fallback import shape_config

    shape = shape_config(_granite_dir(tmp_path))
    assert (shape.vocab_size, shape.hidden_size, shape.num_hidden_layers, shape.max_position_embeddings) == (
        97,
        32,
        2,
        128,
    )


def test_lora_over_transformers_model_matches_peft(tmp_path):
    """LoRA on the fallback: the base's logits at init, PEFT's logits over transformers' own Granite
    once lora_B is non-zero (the adapter saved by save_adapter), and the merged export equal too."""
    peft = pytest.importorskip("peft")
    from toolgym.agents.model.checkpoint import save_hf_checkpoint
    from toolgym.agents.model.lora import (
        LoraConfig,
        adapter_state,
        apply_lora,
        lora_config_of,
        lora_modules,
        merged_state_dict,
        save_adapter,
    )

    directory = _granite_dir(tmp_path / "base")
    model = load_transformers_model(directory)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        base = model(ids, positions)
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    assert len(list(lora_modules(model))) == 2 * 7
    with torch.no_grad():
        torch.testing.assert_close(model(ids, positions), base, rtol=0, atol=0)
        generator = torch.Generator().manual_seed(5)
        for _, module in lora_modules(model):
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=generator) * 0.1)
        ours = model(ids, positions)
    assert (ours - base).abs().max() > 1e-3  # the adapters matter
    save_adapter(adapter_state(model), tmp_path / "adapter", lora_config_of(model), str(directory))
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(input_ids=ids).logits, ours, rtol=0, atol=1e-4)
    save_hf_checkpoint(merged_state_dict(model), model.config, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert type(merged).__name__ == "GraniteForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, ours, rtol=0, atol=1e-4)


def test_lora_gradient_step_changes_only_adapters(tmp_path):
    from toolgym.agents.model.lora import LoraConfig, apply_lora, is_adapter_name

    model = apply_lora(load_transformers_model(_granite_dir(tmp_path)), LoraConfig(rank=4))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_name(name) for name in trainable)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    logits = model(ids, torch.arange(9).expand(2, 9))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    loss.backward()
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(is_adapter_name(k) for k in changed)
    assert any(".lora_B." in k and k.startswith("model.layers.1.") for k in changed)


def test_lora_target_the_family_lacks_is_refused(tmp_path):
    from toolgym.agents.model.lora import LoraConfig, apply_lora, has_lora

    model = load_transformers_model(_granite_dir(tmp_path))
    for layer in model.model.layers:  # as a family whose MLP has no gate_proj linear
        del layer.mlp.gate_proj
    with pytest.raises(ValueError, match=r"\['gate_proj'\] name no nn.Linear"):
        apply_lora(model, LoraConfig(rank=4))
    assert not has_lora(model) and all(p.requires_grad for p in model.parameters())


def _phi3_dir(tmp_path):
    """A random tiny Phi-3: its attention's one qkv_proj and its MLP's one gate_up_proj are names
    no native family has."""
    config = transformers.Phi3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32
        num_key_value_heads=1,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return tmp_path


PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def test_lora_on_phi3_linear_names_matches_peft(tmp_path):
    """LoRA on a family's own linear names (Phi-3's fused qkv_proj, gate_up_proj): the base's
    logits at init, PEFT's over transformers' Phi-3 once lora_B is non-zero."""
    peft = pytest.importorskip("peft")
    from toolgym.agents.model.lora import (
        LoraConfig,
        adapter_state,
        apply_lora,
        lora_config_of,
        lora_modules,
        save_adapter,
    )

    directory = _phi3_dir(tmp_path / "base")
    model = load_transformers_model(directory)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        base = model(ids, positions)
    apply_lora(model, LoraConfig(rank=4, alpha=8, target_modules=PHI3_TARGETS))
    assert sorted({name.rsplit(".", 1)[-1] for name, _ in lora_modules(model)}) == sorted(PHI3_TARGETS)
    assert len(list(lora_modules(model))) == 2 * 4
    with torch.no_grad():
        torch.testing.assert_close(model(ids, positions), base, rtol=0, atol=0)
        generator = torch.Generator().manual_seed(5)
        for _, module in lora_modules(model):
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=generator) * 0.1)
        ours = model(ids, positions)
    assert (ours - base).abs().max() > 1e-3
    save_adapter(adapter_state(model), tmp_path / "adapter", lora_config_of(model), str(directory))
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(input_ids=ids).logits, ours, rtol=0, atol=1e-4)


def test_lora_on_phi3_step_changes_only_adapters(tmp_path):
    from toolgym.agents.model.lora import LoraConfig, apply_lora, is_adapter_name

    model = apply_lora(load_transformers_model(_phi3_dir(tmp_path)), LoraConfig(rank=4, target_modules=PHI3_TARGETS))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_name(name) for name in trainable)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    logits = model(ids, torch.arange(9).expand(2, 9))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    loss.backward()
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(is_adapter_name(k) for k in changed)
    assert any(k.endswith("qkv_proj.lora_B.weight") for k in changed)
    assert any(k.endswith("gate_up_proj.lora_B.weight") for k in changed)
    # the standard names are refused on Phi-3 (it has no q_proj, gate_proj ...), by name
    with pytest.raises(ValueError, match=r"name no nn.Linear"):
        apply_lora(load_transformers_model(_phi3_dir(tmp_path / "again")), LoraConfig(rank=4))


def test_the_config_takes_any_linear_names_with_transformers_only():
    from toolgym.configs.load import ConfigError, config_from_dict

    lora = {"rank": 4, "target_modules": ["qkv_proj", "gate_up_proj"]}
    transformers_policy = {"implementation": "transformers", "backend": "vllm", "lora": lora}
    raw = {"model": {"path": "/some/hf_dir"}, "policy": transformers_policy, "trainer": {"compile": False, "share_prefix": False}}
    assert config_from_dict(raw).policy.lora.target_modules == ["qkv_proj", "gate_up_proj"]
    with pytest.raises(ConfigError, match=r"policy.lora.target_modules: must be a non-empty list of q_proj"):
        config_from_dict({"policy": {"lora": lora}})
