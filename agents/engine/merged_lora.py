"""LoRA adapters served merged: the engine's layers hold W0 + s * B @ A, refolded on each sync.

The engine samples from plain weights, so every layer form (oneDNN-packed, fused, vLLM's
kernels) runs as without LoRA; the cost moves to the sync, which recomputes the adapted weights
(a rank-r product and an add per adapted linear) and refreshes the packed copies. The choice
against serving them unmerged (the model's LoraLinear, an extra pair of thin matmuls per linear per
token, on plain layers) is a measurement: bench/RESULTS.md, "lora_sync".

`MergedAdapters(model)` takes the engine's own copy of a model with adapters, keeps each adapted
linear's base weight W0 and its adapters aside, and folds them into the model in place
(`merge_lora`). `load(updates)` takes a sync's tensors, keeps those it owns (adapters, and the
base weights of adapted linears in a full sync) and returns the others for the caller to copy;
`fold(params)` writes the refolded weights of the linears that changed. Float32 arithmetic, one
rounding to the model's dtype, as `merged_state_dict`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from ..model.lora import lora_modules, merge_lora


class _Adapted:
    """One adapted linear: its base weight W0 and adapters A [r, in], B [out, r], scale s."""

    __slots__ = ("a", "b", "base", "scale")

    def __init__(self, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        self.base, self.a, self.b, self.scale = base, a, b, scale

    def fold_into(self, weight: torch.Tensor) -> None:
        """weight = W0 + s * B @ A: one fused pass in float32, else computed in float32 and
        rounded once to the weight's dtype."""
        if weight.dtype == self.base.dtype == self.a.dtype == self.b.dtype == torch.float32:
            torch.addmm(self.base, self.b, self.a, alpha=self.scale, out=weight)
        else:
            weight.copy_(torch.addmm(self.base.float(), self.b.float(), self.a.float(), alpha=self.scale))


class MergedAdapters:
    """The adapters of an engine that serves them merged, and the base weights they fold into."""

    def __init__(self, model: nn.Module) -> None:
        self._linears: dict[str, _Adapted] = {}
        with torch.no_grad():
            for name, module in lora_modules(model):
                self._linears[name] = _Adapted(
                    module.weight.detach().clone(),
                    module.lora_A.weight.detach().clone(),
                    module.lora_B.weight.detach().clone(),
                    module.scale,
                )
        if not self._linears:
            raise ValueError("MergedAdapters needs a model with LoRA adapters")
        merge_lora(model)
        self._changed: set[str] = set()

    def load(self, updates: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Keep the adapters and adapted base weights among `updates` (copied into this store's
        tensors, which keep their dtype); returns the other updates, for the caller to copy."""
        rest = []
        with torch.no_grad():
            for name, tensor in updates:
                module, _, leaf = name.rpartition(".")
                if leaf == "weight" and module in self._linears:
                    self._linears[module].base.copy_(tensor)
                    self._changed.add(module)
                    continue
                owner, _, part = module.rpartition(".")
                if part in ("lora_A", "lora_B") and leaf == "weight":
                    adapted = self._linears.get(owner)
                    if adapted is None:
                        raise KeyError(f"load_weights: {name!r} adapts no linear this engine holds")
                    (adapted.a if part == "lora_A" else adapted.b).copy_(tensor)
                    self._changed.add(owner)
                    continue
                rest.append((name, tensor))
        return rest

    def fold(self, params: Mapping[str, nn.Parameter]) -> list[str]:
        """Write W0 + s * B @ A into each changed linear's weight in `params` (the model's
        parameters by name); returns the names of the weights written."""
        changed, self._changed = self._changed, set()
        written = [f"{name}.weight" for name in sorted(changed)]
        with torch.no_grad():
            for name, weight in zip(sorted(changed), written, strict=True):
                self._linears[name].fold_into(params[weight])
        return written

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every adapter weight, named as the trainer's (`adapter_tensors`)."""
        for name, adapted in self._linears.items():
            yield f"{name}.lora_A.weight", adapted.a
            yield f"{name}.lora_B.weight", adapted.b
