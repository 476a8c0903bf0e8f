"""Shared helpers for the agents tests."""

from __future__ import annotations

import torch

from toolgym.agents.model import Transformer, build_model, rope_cos_sin


def make_model(name: str = "test", seed: int = 0) -> Transformer:
    """HF init x4: peaked enough that tokens repeat, flat enough that sampling varies."""
    model = build_model(name, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model


def layer_inputs(model: Transformer, rows: int = 3, length: int = 6) -> tuple[torch.Tensor, ...]:
    """A decoder layer's inputs for positions 0..length-1: hidden states [rows, length, hidden] and
    RoPE's (cos, sin) [1, length, 1, head_dim], as the model passes them."""
    config = model.config
    x = torch.randn(rows, length, config.hidden_size)
    cos, sin = rope_cos_sin(torch.arange(length), config.head_dim, config.rope_theta, torch.float32)
    return x, cos[None, :, None], sin[None, :, None]


def record_decode_shapes(monkeypatch) -> list[tuple[int, int]]:
    """Patch KVCache.start_decode to record each decode step's (batch, span); returns the list."""
    from toolgym.agents.kv_cache import KVCache

    shapes: list[tuple[int, int]] = []
    start_decode = KVCache.start_decode
    monkeypatch.setattr(
        KVCache,
        "start_decode",
        lambda self, p, span: shapes.append((len(p), span)) or start_decode(self, p, span),
    )
    return shapes
