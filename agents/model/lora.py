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

Experts (target "experts", mixture-of-experts models): `LoraExperts` adapts every expert of a
block's stacked `gate_up_proj` and `down_proj` (agents/model/moe.py) as peft's `target_parameters`
does (`ParamWrapper`): per projection A [r*E, in] (expert e's rows e*r .. e*r+r-1) and B [out, r*E]
(expert e's columns e, e+E, e+2E, ...), the update einsum("o r e, e r i -> e o i") x s, laid out as
the weight. peft nests the two wrappers, so gate_up_proj's adapters are named
`<block>.experts.base_layer.lora_A.weight` and down_proj's `<block>.experts.lora_A.weight`; ours
are named the same, so the directory loads in peft (no dropout there: peft has none for them).
`adapted_weights(model)` lists every adapted weight of either kind, which the functions below read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

import msgspec
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .moe import Experts

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Qwen3.5's Gated DeltaNet layers' linears (agents/model/linear_attention.py), targets on request.
LINEAR_ATTENTION_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
EXPERTS_TARGET = "experts"  # the MoE blocks' stacked expert projections (LoraExperts)
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")
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


def _adapter_pair(
    in_features: int, out_features: int, rows: int, device: torch.device, generator: torch.Generator | None
) -> tuple[nn.Linear, nn.Linear]:
    """lora_A [rows, in] (kaiming-uniform, as peft) and lora_B [out, rows] (zeros)."""
    a = nn.Linear(in_features, rows, bias=False, device=device)
    b = nn.Linear(rows, out_features, bias=False, device=device)
    with torch.no_grad():
        nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(b.weight)
    return a, b


class LoraLinear(nn.Module):
    """A frozen linear (the base's own `weight` and `bias` Parameters) plus s * B @ A."""

    def __init__(self, base: nn.Linear, config: LoraConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.scale = config.rank, config.scale
        self.float32_adapters = config.dtype == "float32"
        self.lora_A, self.lora_B = _adapter_pair(
            self.in_features, self.out_features, config.rank, base.weight.device, generator
        )
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        a = self.dropout(x)
        if a.dtype != self.lora_A.weight.dtype and not torch.is_autocast_enabled(a.device.type):
            a = a.to(self.lora_A.weight.dtype)
        return out + (self.lora_B(self.lora_A(a)) * self.scale).to(out.dtype)

    def delta_of(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """s * b @ a in float32: the update adapters (a, b) make to the weight."""
        return self.scale * (b.float() @ a.float())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scale={self.scale:g}"


def experts_delta(
    a: torch.Tensor, b: torch.Tensor, scale: float, num_experts: int, transposed: bool
) -> torch.Tensor:
    """s x the update of a stacked expert weight from peft-layout adapters (module doc): A [r*E, in],
    B [out, r*E] -> [E, out, in] (or [E, in, out] when `transposed`), float32."""
    a = a.float().reshape(num_experts, -1, a.shape[-1])  # e r i
    b = b.float().reshape(b.shape[0], -1, num_experts)  # o r e
    delta = scale * torch.einsum("ore,eri->eoi", b, a)
    return delta.transpose(1, 2) if transposed else delta


class _GateUpAdapters(nn.Module):
    """gate_up_proj's adapters, under the name peft's nesting gives them (`base_layer`)."""

    def __init__(self, a: nn.Linear, b: nn.Linear) -> None:
        super().__init__()
        self.lora_A, self.lora_B = a, b


class LoraExperts(nn.Module):
    """A block's stacked experts (their own Parameters, under the same names) plus LoRA on every
    expert's gate_up_proj and down_proj in peft's layout (module doc). Its forward runs the base's
    grouped computation on W + the update, materialised per forward as peft's does."""

    base: Experts  # not a submodule (its Parameters are this module's): it computes

    def __init__(self, base: Experts, config: LoraConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.__dict__["base"] = base  # computes only: its Parameters move here (merge_lora gives them back),
        gate_up_proj = base.gate_up_proj
        for name in base.stacked:  # so FSDP2's sharded copies are the only ones
            self.register_parameter(name, base._parameters.pop(name))
        self.rank, self.scale = config.rank, config.scale
        self.float32_adapters = config.dtype == "float32"
        self.dropout = nn.Identity()
        self.num_experts, self.transposed = int(gate_up_proj.shape[0]), base.transposed
        device = gate_up_proj.device
        rows = config.rank * self.num_experts
        self.base_layer = _GateUpAdapters(
            *_adapter_pair(*self._features("gate_up_proj"), rows, device, generator)
        )
        self.lora_A, self.lora_B = _adapter_pair(*self._features("down_proj"), rows, device, generator)

    def _features(self, name: str) -> tuple[int, int]:
        """(in, out) of each expert's projection `name`."""
        _, first, second = getattr(self, name).shape
        return (first, second) if self.transposed else (second, first)

    def adapters(self) -> dict[str, tuple[str, nn.Linear, nn.Linear]]:
        """Projection name -> (its adapters' owner, relative to this module; lora_A; lora_B)."""
        return {
            "gate_up_proj": ("base_layer", self.base_layer.lora_A, self.base_layer.lora_B),
            "down_proj": ("", self.lora_A, self.lora_B),
        }

    def delta_of(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return experts_delta(a, b, self.scale, self.num_experts, self.transposed)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        adapters = self.adapters()
        weights = []
        for name in self.base.stacked:
            weight = getattr(self, name)
            if name in adapters:
                _, a, b = adapters[name]
                weight = weight + self.delta_of(a.weight, b.weight).to(weight.dtype)
            weights.append(weight)
        return self.base.compute(x, counts, *weights)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, rank={self.rank}, scale={self.scale:g}"


class _Adapter(Protocol):
    def delta_of(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor: ...


class AdaptedWeight(NamedTuple):
    """One adapted weight of a model: its adapters are `owner`.lora_A.weight and .lora_B.weight,
    the base weight they update is `weight` (names as the model's), `module` computes the update."""

    owner: str
    weight: str
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    module: _Adapter

    def delta(self, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
        """The update (float32, the weight's shape) of adapters a, b (default: the module's own)."""
        return self.module.delta_of(self.lora_A if a is None else a, self.lora_B if b is None else b)


def adapted_weights(model: nn.Module) -> Iterator[AdaptedWeight]:
    """Every adapted weight of `model`: each LoraLinear's, each LoraExperts' two, in module order."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            yield AdaptedWeight(name, f"{name}.weight", module.lora_A.weight, module.lora_B.weight, module)
        elif isinstance(module, LoraExperts):
            for projection, (owner, a, b) in module.adapters().items():
                owner = f"{name}.{owner}" if owner else name
                yield AdaptedWeight(owner, f"{name}.{projection}", a.weight, b.weight, module)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoraLinear | LoraExperts]]:
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear | LoraExperts):
            yield name, module


def has_lora(model: nn.Module) -> bool:
    return next(lora_modules(model), None) is not None


def check_native_targets(config: LoraConfig, where: str = "LoraConfig") -> None:
    """A native family's linears are LORA_TARGETS (and, Qwen3.5's Gated DeltaNet layers',
    LINEAR_ATTENTION_TARGETS), and "experts" its MoE blocks' experts: raise ValueError naming
    `where` for others."""
    known = (*LORA_TARGETS, *LINEAR_ATTENTION_TARGETS, EXPERTS_TARGET)
    unknown = [t for t in config.target_modules if t not in known]
    if unknown:
        raise ValueError(
            f"{where}.target_modules must be a non-empty list of {', '.join(LORA_TARGETS)} (a native "
            f"family's linears), {', '.join(LINEAR_ATTENTION_TARGETS)} (Qwen3.5's linear-attention "
            f"layers') or {EXPERTS_TARGET!r} (its experts); policy.implementation = "
            f"'transformers' takes any linear's name; got {unknown}"
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
        if name.rsplit(".", 1)[-1] in config.target_modules
        and (isinstance(module, nn.Linear) or (isinstance(module, Experts) and name.endswith(EXPERTS_TARGET)))
    ]
    missing = sorted(set(config.target_modules) - {name.rsplit(".", 1)[-1] for name, _ in targets})
    if missing:  # e.g. a family run through transformers whose linears are named otherwise
        raise ValueError(
            f"LoRA target_modules {missing} name no nn.Linear (or, for {EXPERTS_TARGET!r}, no MoE "
            "block's experts) in the model; set policy.lora.target_modules to the ones it has"
        )
    if EXPERTS_TARGET in config.target_modules and config.dropout:
        raise ValueError("LoRA on experts has no dropout (nor does peft's): set dropout = 0")
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        adapted = (
            LoraExperts(module, config, generator)
            if isinstance(module, Experts)
            else LoraLinear(module, config, generator)
        )
        setattr(model.get_submodule(parent_name), child, adapted)
    return model


def keep_adapter_dtype(model: nn.Module) -> None:
    """After `model.to(dtype)`: adapters configured with dtype "float32" back to float32."""
    for _, module in lora_modules(model):
        if module.float32_adapters:
            for child in module.children():  # the adapters (the base weights are Parameters)
                child.float()


def adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(module name, tensor) of every adapter weight, detached, no copies: what a sync sends."""
    for adapted in adapted_weights(model):
        yield f"{adapted.owner}.lora_A.weight", adapted.lora_A.detach()
        yield f"{adapted.owner}.lora_B.weight", adapted.lora_B.detach()


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
        target_modules=sorted(
            {EXPERTS_TARGET if isinstance(m, LoraExperts) else name.rsplit(".", 1)[-1] for name, m in modules}
        ),
        dtype="float32" if first.float32_adapters else "model",
    )


def merged_state_dict(
    model: nn.Module, state: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The base's state dict with each adapted weight W + s * B @ A (in W's dtype) and no adapter
    keys. `state`: the model's full state dict when it was gathered elsewhere (FSDP2), else
    `model.state_dict()`."""
    state = dict(model.state_dict() if state is None else state)
    for adapted in adapted_weights(model):
        a, b = state.pop(f"{adapted.owner}.lora_A.weight"), state.pop(f"{adapted.owner}.lora_B.weight")
        w = state[adapted.weight]
        state[adapted.weight] = (w.float() + adapted.delta(a.to(w.device), b.to(w.device))).to(w.dtype)
    return state


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += s * B @ A) and swap the LoraLinear back for a
    plain nn.Linear (a LoraExperts for its experts module), in place; returns `model` (its
    parameters keep their requires_grad)."""
    for adapted in list(adapted_weights(model)):
        weight = model.get_parameter(adapted.weight)
        weight.add_(adapted.delta().to(weight.dtype))
    for name, module in list(lora_modules(model)):
        parent_name, _, child = name.rpartition(".")
        if isinstance(module, LoraExperts):
            base = module.base
            for stacked in base.stacked:  # the experts module takes back the (merged) Parameters
                setattr(base, stacked, getattr(module, stacked))
            setattr(model.get_submodule(parent_name), child, base)
            continue
        linear = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
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
    linears = sorted(t for t in config.target_modules if t != EXPERTS_TARGET)
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": linears or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    if EXPERTS_TARGET in config.target_modules:  # peft's names for the stacked expert weights
        peft_config["target_parameters"] = [f"mlp.{EXPERTS_TARGET}.{p}" for p in EXPERT_PROJECTIONS]
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
    "EXPERTS_TARGET",
    "LINEAR_ATTENTION_TARGETS",
    "LORA_TARGETS",
    "AdaptedWeight",
    "AppliedAdapter",
    "LoraConfig",
    "LoraExperts",
    "LoraLinear",
    "adapted_weights",
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
