"""LoRA adapters served merged: the engine's layers hold W0 + s * B @ A, refolded on each sync.

The engine samples from plain weights, so every layer form (oneDNN-packed, fused, vLLM's
kernels) runs as without LoRA; the cost moves to the sync, which recomputes the adapted weights
(a rank-r product and an add per adapted linear) and refreshes the packed copies. The choice
against serving them unmerged (the model's LoraLinear, an extra pair of thin matmuls per linear per
token, on plain layers) is a measurement: bench/RESULTS.md, "lora_sync".

`MergedAdapters(model)` takes the engine's own copy of a model with adapters, keeps each adapted
weight's base W0 and its adapters aside (a linear's, or a MoE block's stacked experts'), and folds them into the model in place
(`merge_lora`). `load(updates)` takes a sync's tensors, keeps those it owns (adapters, and the
base weights of adapted linears in a full sync) and returns the others for the caller to copy;
`fold(params)` writes the refolded weights of the linears that changed. Float32 arithmetic, one
rounding to the model's dtype, as `merged_state_dict`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from ..model.lora import AdaptedWeight, LoraLinear, adapted_weights, merge_lora


class _Adapted:
    """One adapted weight: its base W0, its adapters A and B, and what computes their update."""

    __slots__ = ("a", "b", "base", "of")

    def __init__(self, of: AdaptedWeight, base: torch.Tensor) -> None:
        self.of = of
        self.base = base.detach().clone()
        self.a, self.b = of.lora_A.detach().clone(), of.lora_B.detach().clone()

    def fold_into(self, weight: torch.Tensor) -> None:
        """weight = W0 + update(A, B): a linear's in one fused pass in float32, else computed in
        float32 and rounded once to the weight's dtype."""
        module = self.of.module
        if (
            isinstance(module, LoraLinear)
            and weight.dtype == self.base.dtype == self.a.dtype == self.b.dtype == torch.float32
        ):
            torch.addmm(self.base, self.b, self.a, alpha=module.scale, out=weight)
        else:
            weight.copy_(self.base.float() + self.of.delta(self.a, self.b))


class MergedAdapters:
    """The adapters of an engine that serves them merged, and the base weights they fold into."""

    def __init__(self, model: nn.Module) -> None:
        self._adapted: dict[str, _Adapted] = {}  # by the adapters' owner
        with torch.no_grad():
            for of in adapted_weights(model):
                self._adapted[of.owner] = _Adapted(of, model.get_parameter(of.weight))
        if not self._adapted:
            raise ValueError("MergedAdapters needs a model with LoRA adapters")
        self._owner_of = {adapted.of.weight: owner for owner, adapted in self._adapted.items()}
        merge_lora(model)
        self._changed: set[str] = set()

    def load(self, updates: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Keep the adapters and adapted base weights among `updates` (copied into this store's
        tensors, which keep their dtype); returns the other updates, for the caller to copy."""
        rest = []
        with torch.no_grad():
            for name, tensor in updates:
                if name in self._owner_of:
                    self._adapted[self._owner_of[name]].base.copy_(tensor)
                    self._changed.add(self._owner_of[name])
                    continue
                owner, _, part = name.removesuffix(".weight").rpartition(".")
                if part in ("lora_A", "lora_B") and name.endswith(".weight"):
                    adapted = self._adapted.get(owner)
                    if adapted is None:
                        raise KeyError(f"load_weights: {name!r} adapts no weight this engine holds")
                    (adapted.a if part == "lora_A" else adapted.b).copy_(tensor)
                    self._changed.add(owner)
                    continue
                rest.append((name, tensor))
        return rest

    def fold(self, params: Mapping[str, nn.Parameter]) -> list[str]:
        """Write W0 + the update into each changed weight in `params` (the model's parameters by
        name); returns the names of the weights written."""
        changed, self._changed = sorted(self._changed), set()
        written = [self._adapted[owner].of.weight for owner in changed]
        with torch.no_grad():
            for owner, weight in zip(changed, written, strict=True):
                self._adapted[owner].fold_into(params[weight])
        return written

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every adapter weight, named as the trainer's (`adapter_tensors`)."""
        for owner, adapted in self._adapted.items():
            yield f"{owner}.lora_A.weight", adapted.a
            yield f"{owner}.lora_B.weight", adapted.b
