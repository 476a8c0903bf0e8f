"""Shared helpers of the native families' parity tests against transformers
(tests/agents/model/test_model_families.py, test_model_olmo.py): load transformers' model as
ours, a right-padded ragged batch, transformers' greedy continuation."""

from __future__ import annotations

import torch

from toolgym.agents.model.checkpoint import load_hf_checkpoint
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
