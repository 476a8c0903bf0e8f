"""toolgym.agents: tokens and models, never environments.

Importing this package is cheap: only the record types and errors load eagerly. Everything that
needs torch (the model, checkpoints, the torch engine) loads on first attribute access, and vLLM
only ever loads from agents/vllm/ when asked for.

    from toolgym.agents import ModelConfig, build_model, TorchEngine, SamplingParams
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import ContextOverflowError
from .types import Completion, Message, SamplingParams

_LAZY = {
    "Policy": ".policy",
    "ModelConfig": ".model.config",
    "Transformer": ".model.transformer",
    "build_model": ".model.transformer",
    "causal_lm_logprobs": ".model.transformer",
    "load_hf_checkpoint": ".model.checkpoint",
    "save_hf_checkpoint": ".model.checkpoint",
    "hf_named_tensors": ".model.checkpoint",
    "TorchEngine": ".engine.engine",
    "EngineStats": ".engine.engine",
    "EngineReplicas": ".engine.replicas",
}

if TYPE_CHECKING:
    from .engine.engine import EngineStats, TorchEngine
    from .engine.replicas import EngineReplicas
    from .model.checkpoint import hf_named_tensors, load_hf_checkpoint, save_hf_checkpoint
    from .model.config import ModelConfig
    from .model.transformer import Transformer, build_model, causal_lm_logprobs
    from .policy import Policy


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "Completion",
    "ContextOverflowError",
    "EngineReplicas",
    "EngineStats",
    "Message",
    "ModelConfig",
    "Policy",
    "SamplingParams",
    "TorchEngine",
    "Transformer",
    "build_model",
    "causal_lm_logprobs",
    "hf_named_tensors",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
]
assert set(__all__) == set(_LAZY) | {"Completion", "ContextOverflowError", "Message", "SamplingParams"}
