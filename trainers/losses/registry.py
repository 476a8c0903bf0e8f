"""The registry of policy losses: each loss one small `Objective`, registered by name.

An Objective is a name, its defaults (the LossConfig fields it sets when the config leaves them
None), its per-token term, and the metrics that term reports (name -> what it means). `LossConfig`
accepts exactly the registered names, fills its defaults from here, and the docs' table of
losses is `loss_table()`. A new loss is one entry, its term a subclass's `per_token`:

    class Doubled(Objective):
        def per_token(self, x: TokenInputs) -> ObjectiveTerm:
            ...

    register_loss(Doubled("doubled", "-2 A * logp", {"eps_low": 0.0, "eps_high": 0.0,
                                                      "aggregation": "token-mean"}))

The corrections (token TIS, sequence masking), the KL and the entropy terms apply around any
objective (terms.py; composed in policy.py).

A loss registered after `trainers.losses` is imported is valid for `LossConfig(name=...)` built
in code; a TOML config names the losses registered at import (every shipped one), which is the
schema's list (configs/load.py reads it from LossConfig's type).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from torch import Tensor

# The LossConfig fields every loss must give a default for (LossConfig leaves them None).
REQUIRED_DEFAULTS: tuple[str, ...] = ("eps_low", "eps_high", "aggregation")

# What the composition reports from every objective's ratio and clip masks (policy.py).
RATIO_METRICS: Mapping[str, str] = {
    "clip_frac_low": "share of sampled tokens whose ratio the clip holds at 1 - eps_low",
    "clip_frac_high": "share of sampled tokens whose ratio the clip holds at 1 + eps_high",
    "ratio_mean": "mean importance ratio (trainer / ratio denominator) over sampled tokens",
    "ratio_min": "smallest importance ratio over sampled tokens",
    "ratio_max": "largest importance ratio over sampled tokens",
}


class TokenInputs(NamedTuple):
    """What an objective and the terms around it read, for one (micro-)batch. Every tensor is
    [B, T] with masked positions already 0 (never nan or inf), in the dtype of the trainer's
    logprobs; only `logp` carries a gradient."""

    logp: Tensor  # the trainer's logprobs (with grad)
    old_logp: Tensor  # the ratio's denominator (module doc of policy.py)
    sampler_logp: Tensor  # the sampler's logprobs
    adv: Tensor  # per-token advantages
    mask: Tensor  # bool: the sampled tokens
    num_tokens: Tensor  # 0-dim long: mask.sum()
    eps_low: float
    eps_high: float
    log_ratio_clamp: float
    dual_clip: float | None


class ObjectiveTerm(NamedTuple):
    """An objective's per-token loss [B, T] (with grad), its importance ratio [B, T] and the bool
    masks of tokens its clip held low / high (the composition reports them as RATIO_METRICS),
    and metrics of its own (0-dim tensors, documented in `Objective.metrics`)."""

    per_token: Tensor
    ratio: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    metrics: dict[str, Tensor]


class Objective:
    """One policy loss: subclasses give `per_token` (and may narrow `check_eps_low`), instances
    the data.

    name: what `LossConfig.name` says. summary: one line for the docs' table. defaults: the
    LossConfig fields it sets when left None (at least REQUIRED_DEFAULTS). metrics: every metric
    it reports -> what it means (RATIO_METRICS' keys and its own `ObjectiveTerm.metrics`).
    """

    def __init__(
        self,
        name: str,
        summary: str,
        defaults: Mapping[str, Any],
        metrics: Mapping[str, str] = RATIO_METRICS,
    ) -> None:
        self.name, self.summary, self.defaults, self.metrics = name, summary, defaults, metrics

    def check_eps_low(self, eps_low: float) -> None:
        """Raise ValueError for an eps_low this loss cannot use (the ratio's clip: [0, 1))."""
        if not 0.0 <= eps_low < 1.0:
            raise ValueError(f"LossConfig.eps_low must be in [0, 1), got {eps_low}")

    def per_token(self, x: TokenInputs) -> ObjectiveTerm:
        raise NotImplementedError


LOSSES: dict[str, Objective] = {}


def register_loss(loss: Objective) -> Objective:
    """Add `loss` to the registry under `loss.name` (a name may be registered once); returns it."""
    if loss.name in LOSSES:
        raise ValueError(f"a loss named {loss.name!r} is registered already")
    missing = [f for f in REQUIRED_DEFAULTS if f not in loss.defaults]
    if missing:
        raise ValueError(f"loss {loss.name!r} gives no default for {missing}")
    undocumented = [m for m in RATIO_METRICS if m not in loss.metrics]
    if undocumented:
        raise ValueError(f"loss {loss.name!r} does not document the metrics {undocumented}")
    LOSSES[loss.name] = loss
    return loss


def get_loss(name: str) -> Objective:
    """The registered loss `name` (ValueError naming the registered ones otherwise)."""
    if name not in LOSSES:
        raise ValueError(f"no loss named {name!r}; registered: {loss_names()}")
    return LOSSES[name]


def loss_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(LOSSES)


def loss_table() -> str:
    """The docs' table of the registered losses (docs/training.md holds it; a test checks)."""
    rows = ["| loss | per-token term | defaults |", "|---|---|---|"]
    for loss in LOSSES.values():
        defaults = ", ".join(f"{k} = {json.dumps(v)}" for k, v in loss.defaults.items())
        rows.append(f"| `{loss.name}` | {loss.summary} | {defaults} |")
    return "\n".join(rows)
