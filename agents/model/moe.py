"""The mixture-of-experts MLPs (Qwen3-MoE's sparse block, gpt-oss's), read top to bottom.

Qwen3-MoE (`SparseMoE`):
    router logits = x @ gate.weight^T                              [N, E]
    probs = softmax(logits) in float32; the top `num_experts_per_tok` experts of each token, their
        probabilities renormalised to sum 1 when `norm_topk_prob`
    y = sum over a token's chosen experts e of p_e * down_e(silu(gate_e(x)) * up_e(x))
gpt-oss (`GptOssMoE`):
    router logits = x @ router.weight^T + router.bias              [N, E]
    the top k logits of each token, their softmax as the weights p_e
    y = sum over the chosen e of p_e * (down_e((up + 1) * g * sigmoid(alpha * g)) + down_bias_e),
        [g, up] = gate_up_e(x) + gate_up_bias_e (interleaved columns: g the even ones, up the
        odd), g clamped above at `swiglu_limit` and up to +-`swiglu_limit`

The experts are stored stacked, as transformers 5 holds them in memory: `experts.gate_up_proj`
[E, 2 * I, H] (each expert's gate rows, then its up rows) and `experts.down_proj` [E, H, I], so
FSDP2's dim-0 sharding keeps each expert whole on one rank. They run as one grouped computation:
the (token, expert) pairs sorted by expert, then one grouped matmul per projection over the groups
(`torch.nn.functional.grouped_mm`, CPU and CUDA bf16 on sm90+), else one batched matmul over the
experts padded to the busiest one's count; never a Python loop over experts.

gpt-oss's experts are held as transformers holds them: `experts.gate_up_proj` [E, H, 2 * I],
`gate_up_proj_bias` [E, 2 * I], `down_proj` [E, I, H], `down_proj_bias` [E, H] (checkpoints
store them stacked under these names too, so they load and save as they are).

Qwen3-MoE checkpoints keep Hugging Face's per-expert names (`mlp.experts.{e}.gate_proj.weight`, `up_proj`,
`down_proj`), which transformers, vLLM and peft read: `fuse_experts` stacks them on load and
`split_experts` writes them back (agents/model/checkpoint.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .families.base import MoeStyle

_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


class Experts(nn.Module):
    """The stacked expert weights (module doc) and their grouped SwiGLU.

    `stacked` names the weights `compute` takes, in its order; `transposed`: stored [E, in, out]
    (gpt-oss) rather than [E, out, in] (peft reads the same flag to lay out LoRA on them)."""

    stacked: tuple[str, ...] = ("gate_up_proj", "down_proj")
    transposed = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [M, H]: the rows routed to expert 0, then those to expert 1, ... (`counts` [E] rows
        each) -> [M, H], each row through its expert."""
        return self.compute(x, counts, *(getattr(self, name) for name in self.stacked))

    def compute(self, x: torch.Tensor, counts: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        """`forward` with the `stacked` weights given (LoRA passes adapted ones)."""
        x, (gate_up_proj, down_proj) = _in_autocast_dtype(x, *weights)
        with torch.autocast(x.device.type, enabled=False):
            gate, up = grouped_matmul(x, gate_up_proj, counts).chunk(2, dim=-1)
            return grouped_matmul(F.silu(gate) * up, down_proj, counts)


def _in_autocast_dtype(
    x: torch.Tensor, *weights: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """x and the experts' weights in the autocast dtype where autocast is on (grouped_mm takes one
    dtype), else as they are; the caller then computes with autocast off."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, weights
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), tuple(w.to(dtype) for w in weights)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x [M, in] grouped by `counts` [E] (group e: the next counts[e] rows) times their
    group's weight[e]^T (weight [E, out, in]) -> [M, out]."""
    if _grouped_mm_fits(x, weight):
        offsets = counts.cumsum(0).to(torch.int32)
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    # One batched matmul over the experts, each group padded to the largest.
    experts, width = weight.shape[0], int(counts.max()) if counts.numel() else 0
    starts = counts.cumsum(0) - counts
    slot = torch.arange(x.shape[0], device=x.device) - torch.repeat_interleave(starts, counts)
    group = torch.repeat_interleave(torch.arange(experts, device=x.device), counts)
    padded = x.new_zeros(experts, width, x.shape[1])
    padded[group, slot] = x
    return torch.bmm(padded, weight.transpose(1, 2))[group, slot]


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped_mm runs these: a CPU, or CUDA bf16 on sm90+; rows 16-byte aligned."""
    if not hasattr(F, "grouped_mm") or x.dtype != weight.dtype:
        return False
    aligned = all(n * x.element_size() % 16 == 0 for n in (x.shape[1], weight.shape[1]))
    if x.device.type == "cpu":
        return aligned
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] >= 9
        and aligned
    )


class GptOssExperts(Experts):
    """gpt-oss's stacked expert weights and biases (module doc) and their grouped, clamped SwiGLU."""

    stacked = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    transposed = True

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        assert cfg.swiglu_alpha is not None and cfg.swiglu_limit is not None  # the config checks
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))

    def compute(self, x: torch.Tensor, counts: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        x, (gate_up_proj, gate_up_bias, down_proj, down_bias) = _in_autocast_dtype(x, *weights)
        with torch.autocast(x.device.type, enabled=False):
            gate_up = grouped_matmul(x, gate_up_proj.transpose(1, 2), counts)
            gate_up = gate_up + torch.repeat_interleave(gate_up_bias, counts, dim=0)
            gate = gate_up[:, ::2].clamp(max=self.limit)
            up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
            hidden = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            out = grouped_matmul(hidden, down_proj.transpose(1, 2), counts)
            return out + torch.repeat_interleave(down_bias, counts, dim=0)


class MixtureOfExperts(nn.Module):
    """A routed MLP: `router_logits_of` x, `route` them, run each token's chosen experts as one
    grouped computation and sum their outputs by weight. `SparseMoE` and `GptOssMoE` say how."""

    experts: nn.Module

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        # The trainer's load-balancing loss (LossConfig.router_aux_coef) reads the last forward's
        # router logits [N, E] (with grad) when this is set.
        self.keep_router_logits = False
        self.router_logits: torch.Tensor | None = None
        # Routing replay: with `keep_routes` the last forward's chosen experts [N, k] stay in
        # `routes` (the engine records them: agents/engine/routes.py); `replay` [N, k] (long, set
        # by the trainer for one forward and its backward) names each row's experts instead of
        # its top k, -1 where a row has none recorded. The router's logits still weigh the
        # named experts, so the router trains.
        self.keep_routes = False
        self.routes: torch.Tensor | None = None
        self.replay: torch.Tensor | None = None

    def router_logits_of(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> the router's logits [N, E]."""
        raise NotImplementedError

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [N, E] -> (the chosen experts' weights [N, k] in the logits' dtype, their
        indices [N, k])."""
        raise NotImplementedError

    def weigh(self, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The weights [N, k] (the logits' dtype) that `route` gives experts `chosen` [N, k]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router_logits_of(x)
        if self.keep_router_logits:
            self.router_logits = logits
        weights, chosen = self.route(logits)
        if self.replay is not None:
            if self.replay.shape != chosen.shape:
                raise ValueError(
                    f"replayed routes {tuple(self.replay.shape)} for {tuple(chosen.shape)} routed rows"
                )
            chosen = torch.where(self.replay >= 0, self.replay, chosen)
            weights = self.weigh(logits, chosen)
        if self.keep_routes:
            self.routes = chosen
        # The (token, expert) pairs sorted by expert: one contiguous group of rows per expert.
        experts = chosen.flatten()
        order = torch.argsort(experts, stable=True)
        tokens = torch.div(order, self.top_k, rounding_mode="floor")
        counts = torch.bincount(experts, minlength=self.num_experts)
        out = self.experts(x[tokens], counts)
        out = out * weights.flatten()[order, None].to(out.dtype)
        return torch.zeros_like(x, dtype=out.dtype).index_add_(0, tokens, out).to(x.dtype).reshape(shape)


class SparseMoE(MixtureOfExperts):
    """HF's `Qwen3MoeSparseMoeBlock`: the router `gate` and the `experts` (module doc)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)  # (the engine may swap `gate` for a packed linear)
        self.experts = Experts(cfg)  # before the router: transformers' order of the tensors
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)

    def router_logits_of(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's top-k of the float32 softmax, renormalised with norm_topk_prob."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        return self._normed(weights, logits.dtype), chosen

    def weigh(self, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        return self._normed(probs.gather(-1, chosen), logits.dtype)

    def _normed(self, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(dtype)


class GptOssMoE(MixtureOfExperts):
    """HF's `GptOssMLP`: the `router` (with a bias) and the `experts` (module doc)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssExperts(cfg)

    def router_logits_of(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's softmax over each token's top-k logits, in the logits' dtype."""
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), chosen

    def weigh(self, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        top = logits.gather(-1, chosen)
        return torch.softmax(top, dim=-1, dtype=top.dtype)


def moe_blocks(model: nn.Module) -> list[MixtureOfExperts]:
    """The model's MoE blocks in layer order (the trainer's routers; a recorded route's layer axis)."""
    return [m for m in model.modules() if isinstance(m, MixtureOfExperts)]


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor], top_k: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss over the MoE layers' router logits (each
    [N, E], the same N positions; `mask` [N] weighs them, e.g. 0 on padding): E x sum_e f_e P_e,
    f_e the share of (position, top-k slot) assignments that went to expert e (per position, so it
    sums to top_k) and P_e its mean router probability; transformers' `load_balancing_loss_func`.
    It is 1 x top_k when routing is uniform and grows as it concentrates."""
    experts = router_logits[0].shape[-1]
    weight = None if mask is None else mask.reshape(-1).float()
    assigned = torch.zeros(experts, dtype=torch.float32, device=router_logits[0].device)
    probability = torch.zeros_like(assigned)
    rows = torch.zeros((), dtype=torch.float32, device=assigned.device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        if weight is None:
            assigned = assigned + torch.bincount(chosen, minlength=experts).float()
            probability = probability + probs.sum(0)
            rows = rows + probs.shape[0]
        else:
            assigned = assigned + torch.zeros_like(assigned).scatter_add_(
                0, chosen, weight.repeat_interleave(top_k)
            )
            probability = probability + (probs * weight[:, None]).sum(0)
            rows = rows + weight.sum()
    return experts * torch.sum((assigned / rows) * (probability / rows))


def fuse_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's per-expert tensors stacked as `Experts` holds them; other tensors as they are.
    ValueError for a layer whose experts are not all there (0..E-1, each with all three)."""
    out: dict[str, torch.Tensor] = {}
    found: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        found.setdefault(match["prefix"], {}).setdefault(match["proj"], {})[int(match["expert"])] = tensor
    for prefix, projections in found.items():
        counts = {proj: len(by_expert) for proj, by_expert in projections.items()}
        num = max(counts.values())
        if set(projections) != {"gate_proj", "up_proj", "down_proj"} or any(
            sorted(by_expert) != list(range(num)) for by_expert in projections.values()
        ):
            raise ValueError(f"{prefix}: the checkpoint does not hold gate/up/down of experts 0..{num - 1}")
        gate, up, down = (projections[p] for p in ("gate_proj", "up_proj", "down_proj"))
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([gate[e], up[e]]) for e in range(num)])
        out[f"{prefix}.down_proj"] = torch.stack([down[e] for e in range(num)])
    return out


def split_experts(
    state: Mapping[str, torch.Tensor], style: MoeStyle = "qwen3_moe"
) -> dict[str, torch.Tensor]:
    """The inverse of `fuse_experts`: stacked experts as Hugging Face's per-expert tensors (gpt-oss's,
    `style` "gpt_oss", stay stacked: its checkpoints hold them so)."""
    if style == "gpt_oss":
        return dict(state)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for e, rows in enumerate(tensor):
                gate, up = rows.chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()  # own storage: safetensors
                out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e, rows in enumerate(tensor):
                out[f"{prefix}.{e}.down_proj.weight"] = rows.clone()
        else:
            out[name] = tensor
    return out


__all__ = [
    "Experts",
    "GptOssExperts",
    "GptOssMoE",
    "MixtureOfExperts",
    "SparseMoE",
    "fuse_experts",
    "grouped_matmul",
    "load_balancing_loss",
    "moe_blocks",
    "split_experts",
]
