"""Code that runs inside vLLM's worker: the in-place weight update for `VLLMPolicy`.

vLLM mixes this class into its worker class (`worker_extension_cls`), so its methods can be called
by name with `collective_rpc` whether the worker lives in this process or in an engine process.
It imports nothing from vLLM at module level: `toolgym.agents` must import without vllm.

Why not just `model.load_weights(...)`: vLLM's CPU backend pre-packs linear weights for its GEMM
kernels after loading, so copying new values into the original parameters leaves the packed copies
stale. The worker's `reload_weights` (vLLM >= 0.31) reloads layer by layer and re-runs that
processing. It does not re-process the output layer of a tied-embedding model (its only weight is
the embedding's, loaded under the embedding's name), so on CPU `lm_head` kept sampling from the
old packed embedding: we re-run its processing here. On CUDA that processing is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch

from ..model.checkpoint import read_safetensors


class ToolgymWorkerExtension:
    """Methods vLLM adds to its worker (names prefixed to avoid clashing with the worker's own)."""

    def toolgym_reload_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        weights_dir: str | None = None,
    ) -> int:
        """Load HF-named tensors (in process) or a safetensors directory (across processes) into
        the running model, in place. Returns the number of tensors loaded."""
        if (weights is None) == (weights_dir is None):
            raise ValueError("pass exactly one of weights and weights_dir")
        if weights is not None:
            tensors = list(weights)
        else:
            tensors = list(read_safetensors(cast(str, weights_dir)))
        worker: Any = self
        if hasattr(worker, "reload_weights"):
            worker.reload_weights(weights_iterator=tensors)
        else:  # older vLLM: the documented path (fine on CUDA, stale packed weights on CPU)
            worker.model_runner.get_model().load_weights(tensors)
        model = worker.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if lm_head is not None and embed is not None and getattr(lm_head, "weight", None) is embed.weight:
            quant_method = getattr(lm_head, "quant_method", None)
            if quant_method is not None:
                with torch.no_grad():
                    quant_method.process_weights_after_loading(lm_head)
        _repack_cpu_experts(model)
        return len(tensors)


def _repack_cpu_experts(model: torch.nn.Module) -> None:
    """vLLM's CPU MoE kernel prepacks the experts' weights once, at the first load; a weight update
    copies the new (unpacked) values into the packed tensors and stops there, so the kernel would
    read them as packed. Pack them again, as the first load did. (CUDA packs nothing: a no-op.)"""
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        weight = getattr(layer, "w13_weight", None)
        if experts is None or weight is None or weight.device.type != "cpu":
            continue
        with torch.no_grad():
            experts.process_weights_after_loading(layer)


__all__ = ["ToolgymWorkerExtension"]
