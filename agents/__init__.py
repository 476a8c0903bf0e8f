"""toolgym.agents: tokens and models, never environments.

Importing this package is cheap: only the record types and errors load eagerly. Everything that
needs torch (the model, checkpoints, the torch engine) loads on first attribute access, and vLLM
only ever loads from agents/vllm_*.py when asked for.

    from toolgym.agents import ModelConfig, build_model, TorchEngine, SamplingParams
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import ContextOverflowError
from .types import Completion, Message, SamplingParams

_LAZY = {
    "Policy": ".policy",
    "ModelConfig": ".model_config",
    "Transformer": ".model",
    "build_model": ".model",
    "causal_lm_logprobs": ".model",
    "load_hf_checkpoint": ".checkpoint",
    "save_hf_checkpoint": ".checkpoint",
    "hf_named_tensors": ".checkpoint",
    "TorchEngine": ".engine",
    "EngineStats": ".engine",
    "EngineReplicas": ".replicas",
}

if TYPE_CHECKING:
    from .checkpoint import hf_named_tensors, load_hf_checkpoint, save_hf_checkpoint
    from .engine import EngineStats, TorchEngine
    from .model import Transformer, build_model, causal_lm_logprobs
    from .model_config import ModelConfig
    from .policy import Policy
    from .replicas import EngineReplicas


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
