"""LoRA: low-rank adapters over a frozen Transformer, in PEFT's layout.

`apply_lora(model, LoraConfig(rank=8))` swaps each targeted `nn.Linear` (by its last name:
q/k/v/o_proj, gate/up/down_proj by default) for a `LoraLinear` in place and freezes every other
parameter. A `LoraLinear` keeps the base layer's Parameters under the same names
(`...q_proj.weight`, `...q_proj.bias`), so a base checkpoint's names are unchanged, and adds
`lora_A.weight` [r, in] (kaiming-uniform, as PEFT) and `lora_B.weight` [out, r] (zeros): at init
the model computes exactly what the base computes. Its output is `base(x) + s * B(A(dropout(x)))`
with s = alpha / r, the adapters unmerged (the base weight is never changed).

- `adapter_tensors(model)`: (module name, tensor) of the adapters, what a weight sync sends;
- `adapter_state(model)`: the same under PEFT's keys (`base_model.model.<name>`), what
  `save_adapter` writes as `adapter_model.safetensors` beside `adapter_config.json`, the
  directory `peft.PeftModel.from_pretrained` (and vLLM's `--lora-modules`) load;
- `merged_state_dict(model)` / `merge_lora(model)`: W + s * B @ A, for a merged HF export;
- `adapter_checksum(named_tensors)`: the check a weight sync makes on what the policy applied.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """rank: r, 0 = no LoRA (full fine-tuning). alpha: the scale is alpha / rank. dropout: on the
    adapter's input while training. target_modules: the linears to adapt, by their last name: any
    names here (a model run through transformers names its linears as its family does: Phi-3's
    qkv_proj, gate_up_proj); a native family's are LORA_TARGETS (`check_native_targets`, which
    the config applies with policy.implementation = "native"), and apply_lora refuses a name that
    matches no nn.Linear.
    dtype: the adapters' dtype in a policy whose model is in bf16/fp16: "float32" (default, the
    trainer's values exactly) or "model" (the policy's dtype). serving: how the torch engine runs
    them, "merged" into its weights on each sync (default: faster decode, bench/RESULTS.md
    "lora_sync") or "unmerged" beside each linear; vLLM always runs them in its LoRA kernels."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(LORA_TARGETS))
    dtype: Literal["float32", "model"] = "float32"
    serving: Literal["merged", "unmerged"] = "merged"

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"LoraConfig.rank must be >= 0 (0 = off), got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout}")
        malformed = [t for t in self.target_modules if not t.isidentifier()]
        if malformed or not self.target_modules:
            raise ValueError(
                "LoraConfig.target_modules must be a non-empty list of linear names (a module's last "
                f"name, e.g. q_proj); got {malformed or self.target_modules}"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraLinear(nn.Module):
    """A frozen linear (the base's own `weight` and `bias` Parameters) plus s * B @ A."""

    def __init__(self, base: nn.Linear, config: LoraConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.scale = config.rank, config.scale
        self.float32_adapters = config.dtype == "float32"
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, config.rank, bias=False, device=device)
        self.lora_B = nn.Linear(config.rank, self.out_features, bias=False, device=device)
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
            nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        a = self.dropout(x)
        if a.dtype != self.lora_A.weight.dtype and not torch.is_autocast_enabled(a.device.type):
            a = a.to(self.lora_A.weight.dtype)
        return out + (self.lora_B(self.lora_A(a)) * self.scale).to(out.dtype)

    def delta_weight(self) -> torch.Tensor:
        """s * B @ A, [out, in], in float32."""
        return self.scale * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scale={self.scale:g}"


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            yield name, module


def has_lora(model: nn.Module) -> bool:
    return next(lora_modules(model), None) is not None


def check_native_targets(config: LoraConfig, where: str = "LoraConfig") -> None:
    """A native family's linears are LORA_TARGETS: raise ValueError naming `where` for others."""
    unknown = [t for t in config.target_modules if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(
            f"{where}.target_modules must be a non-empty list of {', '.join(LORA_TARGETS)} (a native "
            f"family's linears; policy.implementation = 'transformers' takes any); got {unknown}"
        )


def apply_lora(model: nn.Module, config: LoraConfig, seed: int = 0) -> nn.Module:
    """Swap the targeted linears of `model` for LoraLinear in place (A drawn from `seed`, B = 0),
    freeze every other parameter; returns `model`. The adapters are float32 (the master copy).
    A target that names no linear of the model raises (nothing is changed)."""
    if not config.enabled:
        raise ValueError("apply_lora needs LoraConfig.rank >= 1")
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters")
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in config.target_modules
    ]
    missing = sorted(set(config.target_modules) - {name.rsplit(".", 1)[-1] for name, _ in targets})
    if missing:  # e.g. a family run through transformers whose linears are named otherwise
        raise ValueError(
            f"LoRA target_modules {missing} name no nn.Linear in the model; "
            "set policy.lora.target_modules to the linears it has"
        )
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, LoraLinear(module, config, generator))
    return model


def keep_adapter_dtype(model: nn.Module) -> None:
    """After `model.to(dtype)`: adapters configured with dtype "float32" back to float32."""
    for _, module in lora_modules(model):
        if module.float32_adapters:
            module.lora_A.float()
            module.lora_B.float()


def adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(module name, tensor) of every adapter weight, detached, no copies: what a sync sends."""
    for name, module in lora_modules(model):
        yield f"{name}.lora_A.weight", module.lora_A.weight.detach()
        yield f"{name}.lora_B.weight", module.lora_B.weight.detach()


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_key(name: str) -> str:
    return PEFT_PREFIX + name


def adapter_peft_state(adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors by module name -> by PEFT's key (`base_model.model.<module name>...`)."""
    return {peft_key(name): tensor for name, tensor in adapters.items()}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's adapters under PEFT's keys (`base_model.model.<module name>.lora_A.weight`)."""
    return adapter_peft_state(dict(adapter_tensors(model)))


def lora_config_of(model: nn.Module) -> LoraConfig:
    """The LoraConfig of the model's adapters (rank, alpha, dropout, targets)."""
    modules = list(lora_modules(model))
    if not modules:
        raise ValueError("the model has no LoRA adapters")
    first = modules[0][1]
    return LoraConfig(
        rank=first.rank,
        alpha=first.scale * first.rank,
        dropout=first.dropout.p if isinstance(first.dropout, nn.Dropout) else 0.0,
        target_modules=sorted({name.rsplit(".", 1)[-1] for name, _ in modules}),
        dtype="float32" if first.float32_adapters else "model",
    )


def merged_state_dict(
    model: nn.Module, state: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The base's state dict with each adapted weight W + s * B @ A (in W's dtype) and no adapter
    keys. `state`: the model's full state dict when it was gathered elsewhere (FSDP2), else
    `model.state_dict()`."""
    state = dict(model.state_dict() if state is None else state)
    for name, module in lora_modules(model):
        a, b = state.pop(f"{name}.lora_A.weight"), state.pop(f"{name}.lora_B.weight")
        w = state[f"{name}.weight"]
        delta = module.scale * (b.to(w.device, torch.float32) @ a.to(w.device, torch.float32))
        state[f"{name}.weight"] = (w.float() + delta).to(w.dtype)
    return state


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += s * B @ A) and swap the LoraLinear back for a
    plain nn.Linear, in place; returns `model` (its parameters keep their requires_grad)."""
    for name, module in list(lora_modules(model)):
        parent_name, _, child = name.rpartition(".")
        linear = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
        module.weight.add_(module.delta_weight().to(module.weight.dtype))
        linear.weight = module.weight
        linear.bias = module.bias
        setattr(model.get_submodule(parent_name), child, linear)
    return model


class AppliedAdapter(NamedTuple):
    """What a policy reports after loading adapters: their version, `adapter_checksum` of its own
    adapter weights, and their dtype (the trainer's checksum is taken after rounding to it)."""

    version: int
    checksum: str
    dtype: torch.dtype


def adapter_checksum(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> str:
    """`count:sum:abs_sum` over the tensors (each rounded to `dtype` first, then float64), in name
    order: cheap, deterministic for the same values, and changed by any dropped, stale or zeroed
    adapter. One flat tensor, so a few reductions whatever the number of tensors."""
    tensors = [t for _, t in sorted(named_tensors, key=lambda item: item[0])]
    if not tensors:
        return "0:0:0"
    flat = torch.cat([(t.to(dtype) if dtype is not None else t).reshape(-1) for t in tensors]).double()
    return f"{flat.numel()}:{float(flat.sum()):.17g}:{float(flat.abs().sum()):.17g}"


def save_adapter(
    state: Mapping[str, torch.Tensor], directory: str | Path, config: LoraConfig, base_model: str = ""
) -> Path:
    """Write `adapter_state`'s tensors (PEFT keys, float32) and adapter_config.json into `directory`:
    a PEFT LoRA adapter for a causal LM (`PeftModel.from_pretrained(base, directory)`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    save_file(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted(config.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2) + "\n")
    return directory


def load_adapter(model: nn.Module, directory: str | Path) -> None:
    """Copy a PEFT adapter directory's tensors into `model`'s adapters (apply_lora first, with the
    same rank and targets); a missing or unexpected tensor raises."""
    loaded = load_file(Path(directory) / ADAPTER_WEIGHTS)
    params = dict(adapter_tensors(model))
    names = {k.removeprefix(PEFT_PREFIX) for k in loaded}
    if names != set(params):
        raise ValueError(
            f"{directory}: adapter tensors do not match the model's "
            f"(missing {sorted(set(params) - names)[:4]}, unexpected {sorted(names - set(params))[:4]})"
        )
    with torch.no_grad():
        for key, tensor in loaded.items():
            params[key.removeprefix(PEFT_PREFIX)].copy_(tensor)


__all__ = [
    "LORA_TARGETS",
    "AppliedAdapter",
    "LoraConfig",
    "LoraLinear",
    "adapter_checksum",
    "adapter_peft_state",
    "adapter_state",
    "adapter_tensors",
    "apply_lora",
    "check_native_targets",
    "has_lora",
    "is_adapter_name",
    "keep_adapter_dtype",
    "load_adapter",
    "lora_config_of",
    "merge_lora",
    "merged_state_dict",
    "save_adapter",
]
