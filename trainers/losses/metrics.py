"""The metrics every policy loss reports, and their combination over micro-batches and ranks.

`batch_metrics` gives, after the terms' own metrics: the loss, the objective's ratio and clip
metrics (registry.RATIO_METRICS), the sampler/trainer gap, the advantages' mean and std, the
counts. All are detached 0-dim tensors local to one batch; `combine_metrics` combines them over
micro-batches and ranks, and `finish_metrics` turns summed counts into what they count for.

Staleness: `staleness` [B, T] (the trainer's version minus the version that sampled each token)
splits the sampler/trainer logprob gap by age: logprob_gap_mean_s0 .. _s{N-1}plus, and
staleness_tokens_s* (token counts) for the histogram; `finish_metrics` turns the summed parts into
means after `combine_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from .registry import ObjectiveTerm, TokenInputs

# staleness buckets of the logprob-gap metrics: 0, 1, ..., STALENESS_BUCKETS - 1 and more
STALENESS_BUCKETS = 4


def bucket_name(k: int) -> str:
    return f"s{k}plus" if k == STALENESS_BUCKETS - 1 else f"s{k}"


# Every loss's metrics besides its objective's and its terms' (name -> what it means); the step's
# metrics after `finish_metrics` included.
BATCH_METRICS: dict[str, str] = {
    "loss": "the loss (summed over micro-batches and ranks: the whole batch's)",
    "sampler_kl_k1": "mean of log p_sampler - log p_trainer over sampled tokens",
    "sampler_kl_k3": "mean of the k3 estimate of KL(sampler || trainer) over sampled tokens",
    "logprob_gap_max": "largest |trainer - sampler| logprob over sampled tokens",
    "logprob_gap_mean": "mean |trainer - sampler| logprob over sampled tokens",
    "advantage_mean": "mean advantage over sampled tokens",
    "advantage_std": "standard deviation of the advantages over sampled tokens",
    "num_tokens": "sampled (trained) tokens",
    "num_sequences": "sequences with at least one sampled token",
    **{
        f"staleness_tokens_{bucket_name(k)}_sum": f"sampled tokens at staleness {bucket_name(k)[1:]}"
        for k in range(STALENESS_BUCKETS)
    },
    **{
        f"logprob_gap_mean_{bucket_name(k)}": f"mean |trainer - sampler| logprob at staleness {bucket_name(k)[1:]}"
        for k in range(STALENESS_BUCKETS)
    },
}


def masked_mean(values: Tensor, mask: Tensor, count: Tensor) -> Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum() / count.clamp(min=1)


def masked_extreme(values: Tensor, mask: Tensor, largest: bool) -> Tensor:
    """Max (min) over masked entries; 0 when there are none. No host sync (GPU-friendly)."""
    fill = -math.inf if largest else math.inf
    masked = torch.where(mask, values, torch.full_like(values, fill))
    extreme = masked.max() if largest else masked.min()
    return torch.where(mask.any(), extreme, torch.zeros_like(extreme))


@torch.no_grad()
def batch_metrics(
    loss: Tensor, term: ObjectiveTerm, x: TokenInputs, staleness: Tensor | None
) -> dict[str, Tensor]:
    """The loss, the objective's ratio and clip metrics and BATCH_METRICS of one batch (the
    staleness ones when `staleness` [B, T] is given)."""
    mask, adv, num_tokens, clamp = x.mask, x.adv, x.num_tokens, x.log_ratio_clamp
    ratio = term.ratio.detach()
    gap = x.logp.detach() - x.sampler_logp  # log(trainer / sampler) on the sampled tokens
    count = num_tokens.clamp(min=1)
    adv_mean = masked_mean(adv, mask, num_tokens)
    metrics = dict(
        loss=loss.detach(),
        clip_frac_low=term.clipped_low.sum() / count,
        clip_frac_high=term.clipped_high.sum() / count,
        ratio_mean=masked_mean(ratio, mask, num_tokens),
        ratio_min=masked_extreme(ratio, mask, largest=False),
        ratio_max=masked_extreme(ratio, mask, largest=True),
        sampler_kl_k1=masked_mean(-gap, mask, num_tokens),
        sampler_kl_k3=masked_mean(torch.exp(gap.clamp(max=clamp)) - gap - 1.0, mask, num_tokens),
        logprob_gap_max=masked_extreme(gap.abs(), mask, largest=True),
        logprob_gap_mean=masked_mean(gap.abs(), mask, num_tokens),
        advantage_mean=adv_mean,
        advantage_std=masked_mean((adv - adv_mean) ** 2, mask, num_tokens).sqrt(),
        num_tokens=num_tokens.to(torch.float32),
        num_sequences=mask.any(dim=-1).sum().to(torch.float32),
    )
    if staleness is not None:
        if staleness.shape != mask.shape:
            raise ValueError(
                f"staleness has shape {tuple(staleness.shape)}, logprobs has {tuple(mask.shape)}"
            )
        zeros = torch.zeros_like(gap)
        bucket = staleness.clamp(0, STALENESS_BUCKETS - 1)
        for k in range(STALENESS_BUCKETS):
            in_bucket = mask & (bucket == k)
            name = bucket_name(k)
            metrics[f"staleness_tokens_{name}_sum"] = in_bucket.sum().to(torch.float32)
            metrics[f"logprob_gap_abs_{name}_sum"] = torch.where(in_bucket, gap.abs(), zeros).sum()
    return metrics


def finish_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The step's metrics after `combine_metrics`: the counts summed over parts become what they
    count for (seq_masked_frac over the step's sequences; logprob_gap_mean_s* as the mean |gap|
    of the tokens in each staleness bucket, 0.0 for an empty bucket). The counts themselves stay
    (seq_masked_sum; staleness_tokens_s*_sum, the histogram's data)."""
    out = dict(metrics)
    if "seq_masked_sum" in out:
        out["seq_masked_frac"] = out["seq_masked_sum"] / max(out.get("num_sequences", 0.0), 1.0)
    for k in range(STALENESS_BUCKETS):
        name = bucket_name(k)
        gap = out.pop(f"logprob_gap_abs_{name}_sum", None)
        if gap is not None:
            count = out.get(f"staleness_tokens_{name}_sum", 0.0)
            out[f"logprob_gap_mean_{name}"] = gap / count if count > 0 else 0.0
    return out


def combine_metrics(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Combine per-micro-batch (or per-rank) metrics into the step's metrics.

    loss, num_tokens, num_sequences: summed (each part's loss is already divided by step-wide
    counts). *_max / *_min: max / min over parts that had tokens. advantage_std: pooled exactly.
    Everything else: mean weighted by each part's num_tokens.
    """
    parts = [dict(p) for p in parts]
    if not parts:
        return {}
    weights = [float(p.get("num_tokens", 0.0)) for p in parts]
    total = sum(weights)
    live = [p for p, w in zip(parts, weights, strict=True) if w > 0] or parts
    out: dict[str, float] = {}
    keys = dict.fromkeys(k for p in parts for k in p)
    for key in keys:
        values = [float(p[key]) for p in parts if key in p]
        if key in ("loss", "num_tokens", "num_sequences") or key.endswith("_sum"):
            out[key] = sum(values)
        elif key.endswith("_max"):
            out[key] = max(float(p[key]) for p in live if key in p)
        elif key.endswith("_min"):
            out[key] = min(float(p[key]) for p in live if key in p)
        elif key == "advantage_std":
            continue
        else:
            pairs = [(float(p[key]), w) for p, w in zip(parts, weights, strict=True) if key in p]
            out[key] = (
                sum(v * w for v, w in pairs) / total if total > 0 else sum(v for v, _ in pairs) / len(pairs)
            )
    if "advantage_std" in keys and total > 0:
        mean = out.get("advantage_mean", 0.0)
        second = sum(
            w * (float(p["advantage_std"]) ** 2 + (float(p["advantage_mean"]) - mean) ** 2)
            for p, w in zip(parts, weights, strict=True)
            if "advantage_std" in p
        )
        out["advantage_std"] = math.sqrt(second / total)
    elif "advantage_std" in keys:
        out["advantage_std"] = 0.0
    return out
