"""Shared helpers for the agents tests."""

from __future__ import annotations

import os

import pytest
import torch

from toolgym.agents.engine.backend import Backend, select_backend
from toolgym.agents.kernels import vllm_ops as vllm_cpu_kernels
from toolgym.agents.model.transformer import Transformer, build_model, rope_cos_sin


def make_model(name: str = "test", seed: int = 0) -> Transformer:
    """HF init x4: peaked enough that tokens repeat, flat enough that sampling varies."""
    model = build_model(name, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model


def backend_for(
    model: Transformer, dtype: torch.dtype | None = None, device: torch.device | str | None = None, **requests
) -> Backend:
    """`select_backend` with `requests` for an engine over `model` in `dtype` on `device` (default:
    the model's), as `TorchEngine(model, dtype=..., device=...)` would run it."""
    return select_backend(model.config, device or model.device, dtype or model.dtype, **requests)


def layer_inputs(model: Transformer, rows: int = 3, length: int = 6) -> tuple[torch.Tensor, ...]:
    """A decoder layer's inputs for positions 0..length-1: hidden states [rows, length, hidden] and
    RoPE's (cos, sin) [1, length, 1, head_dim], as the model passes them."""
    config = model.config
    x = torch.randn(rows, length, config.hidden_size)
    cos, sin = rope_cos_sin(torch.arange(length), config.head_dim, config.rope_theta, torch.float32)
    return x, cos[None, :, None], sin[None, :, None]


def record_decode_shapes(monkeypatch) -> list[tuple[int, int]]:
    """Patch Forwards.decode to record each decode step's (batch, span); returns the list."""
    from toolgym.agents.engine.cache_attention import Forwards

    shapes: list[tuple[int, int]] = []
    decode = Forwards.decode
    monkeypatch.setattr(
        Forwards,
        "decode",
        lambda self, p, span: shapes.append((len(p), span)) or decode(self, p, span),
    )
    return shapes


def require_vllm_cpu_kernels() -> None:
    """Skip where vllm-cpu's kernels do not load; fail instead where TOOLGYM_REQUIRE_VLLM=1 says
    vllm-cpu is installed on a CPU that qualifies (x86 with AVX-512 BF16)."""
    if not vllm_cpu_kernels.kernels_available():
        reason = f"vllm-cpu's kernels did not load: {vllm_cpu_kernels.unavailable_reason()}"
        if os.environ.get("TOOLGYM_REQUIRE_VLLM") == "1" and torch.cpu._is_avx512_bf16_supported():
            pytest.fail(f"TOOLGYM_REQUIRE_VLLM=1 but {reason}")
        pytest.skip(reason)


def require_vllm() -> None:
    """Skip where vllm does not import; fail instead where TOOLGYM_REQUIRE_VLLM=1 says it is
    installed (the README's test command sets it, so a broken install cannot pass as a skip)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install (e.g. CUDA torchvision)
        reason = f"vllm is not importable ({type(exc).__name__}: {exc})"
        if os.environ.get("TOOLGYM_REQUIRE_VLLM") == "1":
            pytest.fail(f"TOOLGYM_REQUIRE_VLLM=1 but {reason}")
        pytest.skip(reason)
