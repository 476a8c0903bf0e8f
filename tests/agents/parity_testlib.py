"""Shared helpers of the native families' parity tests against transformers
(tests/agents/model/test_model_families.py, OLMo's cases included, and test_model_yarn.py): load
transformers' model as ours, a right-padded ragged batch, transformers' greedy continuation."""

from __future__ import annotations

import torch

from toolgym.agents.model.checkpoint import load_hf_checkpoint
from toolgym.agents.model.lora import LoraConfig, adapter_state, apply_lora, lora_config_of, save_adapter
from toolgym.agents.model.transformer import Transformer


def ours_from(hf, tmp_path) -> Transformer:
    hf.save_pretrained(tmp_path / "hf")
    return load_hf_checkpoint(tmp_path / "hf").eval()


def ragged_batch(vocab: int, lengths=(41, 30, 17), seed: int = 0):
    """Right-padded rows (padding 0); 0 is also a real token (Gemma's pad_token_id, whose
    embedding row gets no gradient from lookups, in transformers and here)."""
    tokens = torch.randint(
        0, vocab, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(seed)
    )
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return tokens * mask, mask


def hf_greedy(hf, prompt: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=None,
                          pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def peft_logits(hf, tmp_path, **lora) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our model of `hf`'s checkpoint with LoRA on every target (random adapters; `lora`: more
    LoraConfig fields), its adapter saved in PEFT's layout and loaded by `peft` onto `hf`: (our
    base logits, ours with the adapter, peft's) on one 29-token row."""
    import peft

    ours = ours_from(hf, tmp_path)
    tokens, _ = ragged_batch(ours.config.vocab_size, (29,))
    with torch.no_grad():
        base_logits = ours(tokens)
    apply_lora(ours, LoraConfig(rank=4, alpha=16, **lora))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    ours.eval()
    save_adapter(adapter_state(ours), tmp_path / "adapter", lora_config_of(ours), str(tmp_path / "hf"))
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        return base_logits, ours(tokens), with_adapter(tokens).logits
