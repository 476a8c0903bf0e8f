"""Any decoder transformers can load, for a model_type without a native family
(`policy.implementation = "transformers"`, the optional `transformers` extra).

`HFCausalLM` wraps `AutoModelForCausalLM.from_pretrained(path, dtype=float32)` with the
native `Transformer`'s training interface: `forward(input_ids, positions, cache=None, head=None)`,
`model.layers` (FSDP2 / activation checkpointing wrap each layer), and a state_dict under HF's own
names (`model.layers.{i}...`, `lm_head.weight`) so the vLLM backend's weight sync and HF saves read
it as they read the native model's. LoRA is agents/model/lora.py's `apply_lora` over the family's
own q_proj/.../down_proj linears (a target it lacks is refused there). Shared-prefix attention
(`cache`) and per-block torch.compile are refused at config time (configs/load.py); `cache` is
refused here too.

This is the only library module that imports transformers (tests/test_architecture.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import ModelConfig


class HFConfigView:
    """The transformers config with what the checkpoint writer reads of a ModelConfig:
    `to_hf_dict(dtype)` (config.json's content) and every HF field (tie_word_embeddings, ...)."""

    def __init__(self, hf_config: Any) -> None:
        self.hf_config = hf_config

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hf_config, name)

    def to_hf_dict(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        out = self.hf_config.to_dict()
        if dtype is not None:
            out["dtype"] = str(dtype).removeprefix("torch.")
        return out


class HFCausalLM(nn.Module):
    """A transformers `<Family>ForCausalLM`'s `model` (decoder stack) and `lm_head`, as attributes of
    the same names so parameter names match HF's checkpoint names."""

    def __init__(self, hf_model: Any) -> None:
        super().__init__()
        self.config: Any = HFConfigView(hf_model.config)
        self.model: Any = hf_model.model
        self.lm_head: Any = hf_model.get_output_embeddings()
        # Families whose logits are scaled after lm_head (Granite's logits_scaling)
        self.logits_scaling = float(getattr(self.config, "logits_scaling", 1.0) or 1.0)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: object | None = None,
        head: Callable[[torch.Tensor, nn.Module], Any] | None = None,
    ) -> Any:
        """input_ids [B, T] -> logits [B, T, V] (causal), or `head(hidden, lm_head)` when given."""
        if cache is not None:
            raise ValueError(
                "policy.implementation = 'transformers' has no shared-prefix attention; "
                "set trainer.share_prefix = false"
            )
        hidden = self.model(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state
        if self.logits_scaling != 1.0:
            hidden = hidden / self.logits_scaling  # lm_head is linear: same as scaling the logits
        return self.lm_head(hidden) if head is None else head(hidden, self.lm_head)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


def shape_config(path: str | Path) -> ModelConfig:
    """The sizes of the HF directory at `path` (vocab, hidden size, layers, heads, max positions) as
    a llama-shaped ModelConfig, for the start-time checks and the backend's memory sizing; it never
    builds weights (the model itself is `load_transformers_model`'s)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    return ModelConfig.from_hf_dict({**raw, "model_type": "llama"})


def directory_parameter_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every weight's HF name -> shape in the directory's safetensors files (the names a weight
    sync may send), with lm_head.weight added where the embeddings are tied."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes


def load_transformers_model(path: str | Path, dtype: torch.dtype = torch.float32) -> HFCausalLM:
    """The HF directory at `path` through transformers' AutoModelForCausalLM (float32 master copy)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "policy.implementation = 'transformers' needs the transformers extra: pip install 'toolgym[transformers]'"
        ) from e
    hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return HFCausalLM(hf_model)


__all__ = ["HFCausalLM", "directory_parameter_shapes", "load_transformers_model", "shape_config"]
