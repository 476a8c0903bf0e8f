"""Shared helpers for the agents tests."""

from __future__ import annotations

import torch

from toolgym.agents.model import Transformer, build_model


def make_model(name: str = "test", seed: int = 0) -> Transformer:
    """HF init x4: peaked enough that tokens repeat, flat enough that sampling varies."""
    model = build_model(name, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model
