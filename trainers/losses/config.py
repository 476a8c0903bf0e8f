"""LossConfig: which registered loss, its knobs, the corrections, KL and entropy.

The names it accepts and the defaults it fills in come from the registry (registry.py): a field
left None takes the chosen loss's default (`Objective.defaults`), and `Objective.check_eps_low`
says which eps_low the loss can use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, cast

import msgspec

from .aggregation import AGGREGATIONS, Aggregation
from .objectives import SHIPPED_LOSSES  # noqa: F401 (the shipped losses are registered before LossName is read)
from .registry import LOSSES, loss_names

SeqMask = Literal["off", "sequence", "geometric"]
KLEstimator = Literal["k1", "k3"]

SEQ_MASKS: tuple[str, ...] = ("off", "sequence", "geometric")
# seq_mask -> default (low, high) bounds on the sequence ratio (starting values; tune per run)
SEQ_MASK_DEFAULTS: dict[str, tuple[float, float]] = {"sequence": (0.5, 2.0), "geometric": (0.99, 1.01)}

# The names a config may give: the losses registered when this module loads (every shipped one),
# as a Literal, so the config schema lists them (configs/load.py reads them from this type).
if TYPE_CHECKING:
    LossName = str
else:
    LossName = Literal[loss_names()]


class LossConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Which policy loss to use and its knobs. Fields left as None take the loss's default.

    name: a registered loss (registry.py; the shipped ones: objectives.py).
    eps_low, eps_high: the ratio is clipped to [1 - eps_low, 1 + eps_high].
    dual_clip: c > 1 bounds the loss of negative-advantage tokens at -c * A (dual-clip PPO).
    log_ratio_clamp: log-ratios are clamped to +-this before exp (no overflow).
    aggregation: how per-token values become the loss (aggregation.py).
    constant_normaliser: the Dr. GRPO constant (needed by seq-mean-token-sum-norm).
    kl_coef, kl_estimator: KL penalty to reference logprobs (k1: log p - log ref; k3: the
        low-variance non-negative estimator exp(ref - p) - (ref - p) - 1).
    entropy_coef: entropy bonus (the loss subtracts coef x the aggregated entropy).
    tis_cap: truncated importance sampling cap C (None: off; terms.py).
    seq_mask: sequence-level IS masking ("off", "sequence" or "geometric"; terms.py), with
        the bounds seq_mask_low < 1 < seq_mask_high on the ratio (None: SEQ_MASK_DEFAULTS).
    router_aux_coef: a mixture of experts' load-balancing loss (agents/model/moe.py
        `load_balancing_loss`, transformers' router aux loss) times this, added to each
        micro-batch's loss weighted by its share of the step's sampled tokens; 0 = off, as the
        reference configs train (the metric `router_aux` is logged for MoE models either way).
    """

    name: LossName = "grpo"
    eps_low: float | None = None
    eps_high: float | None = None
    dual_clip: float | None = None
    log_ratio_clamp: float = 20.0
    aggregation: Aggregation | None = None
    constant_normaliser: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    seq_mask: SeqMask = "off"
    seq_mask_low: float | None = None
    seq_mask_high: float | None = None
    router_aux_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"LossConfig.name must be one of {loss_names()}, got {self.name!r}")
        loss = LOSSES[self.name]
        for field, value in loss.defaults.items():
            if getattr(self, field) is None:
                setattr(self, field, value)
        eps_low, eps_high = cast(float, self.eps_low), cast(float, self.eps_high)
        loss.check_eps_low(eps_low)
        if eps_high < 0.0:
            raise ValueError(f"LossConfig.eps_high must be >= 0, got {eps_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"LossConfig.dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.log_ratio_clamp <= 0.0:
            raise ValueError(f"LossConfig.log_ratio_clamp must be > 0, got {self.log_ratio_clamp}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"LossConfig.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}"
            )
        if self.aggregation == "seq-mean-token-sum-norm" and not (self.constant_normaliser or 0) > 0:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs constant_normaliser > 0")
        if self.kl_coef < 0 or self.entropy_coef < 0 or not self.router_aux_coef >= 0:
            raise ValueError("LossConfig.kl_coef, entropy_coef and router_aux_coef must be >= 0")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"LossConfig.kl_estimator must be 'k1' or 'k3', got {self.kl_estimator!r}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"LossConfig.tis_cap must be > 0 (or None), got {self.tis_cap}")
        if self.seq_mask not in SEQ_MASKS:
            raise ValueError(f"LossConfig.seq_mask must be one of {SEQ_MASKS}, got {self.seq_mask!r}")
        if self.seq_mask != "off":
            low, high = SEQ_MASK_DEFAULTS[self.seq_mask]
            if self.seq_mask_low is None:
                self.seq_mask_low = low
            if self.seq_mask_high is None:
                self.seq_mask_high = high
            if not 0.0 <= self.seq_mask_low < 1.0 < self.seq_mask_high:
                raise ValueError(
                    "LossConfig.seq_mask_low and seq_mask_high must satisfy 0 <= low < 1 < high, got "
                    f"{self.seq_mask_low}, {self.seq_mask_high}"
                )
