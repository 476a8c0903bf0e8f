"""The shipped policy losses, each one registered Objective (trainers/losses/registry.py).

Their names, summaries and defaults as a table: `loss_table()` (docs/training.md).

The PPO ratio is exp(logp - logp_old), its log clamped to +-log_ratio_clamp; `dual_clip` c > 1
bounds the loss of negative-advantage tokens at -c * A (dual-clip PPO; grpo, dapo, gspo).

CISPO (MiniMax-M1): the per-token loss is -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * logp:
the clipped ratio is a stop-gradient weight on the REINFORCE term, so every token keeps a gradient
(PPO's clip zeroes it outside the range). eps_low = 1.0 is no lower bound, as in the paper.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import RATIO_METRICS, Objective, ObjectiveTerm, TokenInputs, register_loss


class Reinforce(Objective):
    """-A * logp: no ratio (reported as 1), no clip (reported as 0)."""

    def per_token(self, x: TokenInputs) -> ObjectiveTerm:
        ratio = torch.ones_like(x.logp)
        clipped = torch.zeros_like(x.mask)
        return ObjectiveTerm(-x.adv * x.logp, ratio, clipped, clipped, {})


class PPOClip(Objective):
    """The PPO clipped surrogate max(-A * ratio, -A * clip(ratio)) over a per-token ratio, with
    the optional dual clip."""

    def log_ratio(self, x: TokenInputs) -> Tensor:
        """The clamped log-ratio per token (with grad through logp)."""
        clamp = x.log_ratio_clamp
        return (x.logp - x.old_logp).clamp(-clamp, clamp)

    def per_token(self, x: TokenInputs) -> ObjectiveTerm:
        adv, mask, eps_low, eps_high = x.adv, x.mask, x.eps_low, x.eps_high
        ratio = torch.exp(self.log_ratio(x))
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        per_token = torch.maximum(unclipped, clipped)
        clipped_low = mask & (adv < 0) & (ratio < 1.0 - eps_low)
        clipped_high = mask & (adv > 0) & (ratio > 1.0 + eps_high)
        metrics: dict[str, Tensor] = {}
        if x.dual_clip is not None:
            bound = -adv * x.dual_clip
            dual = mask & (adv < 0) & (per_token > bound)
            per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
            metrics["dual_clip_frac"] = dual.sum() / x.num_tokens.clamp(min=1)
        return ObjectiveTerm(per_token, ratio, clipped_low, clipped_high, metrics)


class SequencePPOClip(PPOClip):
    """GSPO-token form: the ratio's value is the sequence's (the geometric mean of its tokens'
    ratios), its gradient flows per token."""

    def log_ratio(self, x: TokenInputs) -> Tensor:
        logp, clamp = x.logp, x.log_ratio_clamp
        tokens_per_seq = x.mask.sum(dim=-1, keepdim=True).clamp(min=1)
        seq_log_ratio = ((logp - x.old_logp).sum(dim=-1, keepdim=True) / tokens_per_seq).detach()
        return seq_log_ratio.clamp(-clamp, clamp) + logp - logp.detach()


class ClippedISWeight(Objective):
    """CISPO: the clipped ratio as a stop-gradient weight on -A * logp."""

    def check_eps_low(self, eps_low: float) -> None:
        """A weight, not a clip of the objective: 1.0 is "no lower bound"."""
        if not 0.0 <= eps_low <= 1.0:
            raise ValueError(f"LossConfig.eps_low must be in [0, 1] for cispo, got {eps_low}")

    def per_token(self, x: TokenInputs) -> ObjectiveTerm:
        mask, eps_low, eps_high, clamp = x.mask, x.eps_low, x.eps_high, x.log_ratio_clamp
        ratio = torch.exp((x.logp.detach() - x.old_logp).clamp(-clamp, clamp))
        weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        per_token = -weight * x.adv * x.logp
        clipped_low = mask & (ratio < 1.0 - eps_low)
        clipped_high = mask & (ratio > 1.0 + eps_high)
        return ObjectiveTerm(per_token, ratio, clipped_low, clipped_high, {})


PPO_METRICS = {
    **RATIO_METRICS,
    "dual_clip_frac": "share of sampled tokens the dual clip bounds (only with dual_clip set)",
}

SHIPPED_LOSSES: tuple[Objective, ...] = tuple(
    register_loss(loss)
    for loss in (
        Reinforce(
            "reinforce",
            "-A * logp (no ratio, no clip)",
            {"eps_low": 0.0, "eps_high": 0.0, "aggregation": "token-mean"},
            {
                **{
                    k: f"{text} (always 1: no ratio)"
                    for k, text in RATIO_METRICS.items()
                    if k.startswith("ratio")
                },
                "clip_frac_low": "always 0: no clip",
                "clip_frac_high": "always 0: no clip",
            },
        ),
        PPOClip(
            "grpo",
            "PPO clipped surrogate, per-token ratio",
            {"eps_low": 0.2, "eps_high": 0.2, "aggregation": "seq-mean-token-mean"},
            PPO_METRICS,
        ),
        PPOClip(
            "dapo",
            "PPO clipped surrogate, per-token ratio, clip-higher",
            {"eps_low": 0.2, "eps_high": 0.28, "aggregation": "token-mean"},
            PPO_METRICS,
        ),
        SequencePPOClip(
            "gspo",
            "PPO clipped surrogate, per-sequence ratio (the geometric mean of its tokens'), gradient per token",
            {"eps_low": 3e-4, "eps_high": 4e-4, "aggregation": "seq-mean-token-mean"},
            PPO_METRICS,
        ),
        ClippedISWeight(
            "cispo",
            "-sg(clip(ratio)) * A * logp: the clipped ratio a stop-gradient weight (MiniMax-M1)",
            {"eps_low": 1.0, "eps_high": 0.28, "aggregation": "token-mean"},
            {
                **RATIO_METRICS,
                "clip_frac_low": "share of sampled tokens whose weight the clip holds at 1 - eps_low",
                "clip_frac_high": "share of sampled tokens whose weight the clip holds at 1 + eps_high",
            },
        ),
    )
)
