"""Policy-gradient losses as pure functions of per-token tensors.

Every tensor is [B, T]: one row per sequence, already shifted so that position t holds the
quantities of the token the model predicts there (see trainers/batching.py). `loss_mask` is 1 on
the tokens the policy sampled; everything else is ignored exactly (masked values never reach the
loss or the gradient, even if they are inf or nan).

Losses (LossConfig.name) and their defaults:

| name      | ratio                          | clip (eps_low, eps_high) | aggregation          |
|-----------|--------------------------------|--------------------------|----------------------|
| reinforce | none: -A * logp                | -                        | token-mean           |
| grpo      | per token, PPO clipped         | 0.2, 0.2                 | seq-mean-token-mean  |
| dapo      | per token, clip-higher         | 0.2, 0.28                | token-mean           |
| gspo      | per sequence (geometric mean)  | 3e-4, 4e-4               | seq-mean-token-mean  |
| cispo     | per token, clipped IS weight   | 1.0, 0.28                | token-mean           |

CISPO (MiniMax-M1): the per-token loss is -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * logp:
the clipped ratio is a stop-gradient weight on the REINFORCE term, so every token keeps a gradient
(PPO's clip zeroes it outside the range). eps_low = 1.0 is no lower bound, as in the paper.

Aggregation modes, each divided by step-wide counts (a `LossNormaliser`) so that summing the
losses of micro-batches and data-parallel ranks gives exactly the loss of the whole batch:
- token-mean: sum over all valid tokens / number of valid tokens in the step (DAPO).
- seq-mean-token-mean: each sequence's token mean, summed, / number of sequences (GRPO paper).
- seq-mean-token-sum: each sequence's token sum, summed, / number of sequences.
- seq-mean-token-sum-norm: token sum / (number of sequences x a constant), the Dr. GRPO
  normaliser (the constant is usually the episode token budget).
"Number of sequences" counts sequences with at least one valid token.

The PPO ratio is exp(logp - logp_old). With one update per batch logp_old is the sampler's
logprob by default (the ratio then corrects the sampler/trainer mismatch and any policy lag).
With truncated importance sampling on (tis_cap), logp_old is the trainer's own detached logprob,
so the ratio is 1, and each token is weighted by min(exp(logp_old - logp_sampler), tis_cap).

Sequence-level IS masking (`seq_mask`, the "MIS" / rejection family): a sequence whose
importance ratio between the trainer's (detached) logprobs and the sampler's falls outside
[seq_mask_low, seq_mask_high] gives no policy-gradient term at all (its KL and entropy terms
stay; the step's normaliser still counts it). "sequence": the ratio is the product over the
sequence's sampled tokens, exp(sum(logp - logp_sampler)); "geometric": its per-token geometric
mean, exp(mean(logp - logp_sampler)), which does not grow with length. A token-level
mismatch (a stale or numerically different sampler) that a token TIS cap would only truncate
rejects the whole sequence here. Counted: seq_masked_frac.

Staleness: `staleness` [B, T] (the trainer's version minus the version that sampled each token)
splits the sampler/trainer logprob gap by age: logprob_gap_mean_s0 .. _s{N-1}plus, and
staleness_tokens_s* (token counts) for the histogram; `finish_metrics` turns the summed parts into
means after `combine_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Literal, NamedTuple, cast

import msgspec
import torch
from torch import Tensor

LossName = Literal["reinforce", "grpo", "dapo", "gspo", "cispo"]
SeqMask = Literal["off", "sequence", "geometric"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k3"]

LOSS_NAMES: tuple[str, ...] = ("reinforce", "grpo", "dapo", "gspo", "cispo")
SEQ_MASKS: tuple[str, ...] = ("off", "sequence", "geometric")
# seq_mask -> default (low, high) bounds on the sequence ratio (starting values; tune per run)
SEQ_MASK_DEFAULTS: dict[str, tuple[float, float]] = {"sequence": (0.5, 2.0), "geometric": (0.99, 1.01)}
# staleness buckets of the logprob-gap metrics: 0, 1, ..., STALENESS_BUCKETS - 1 and more
STALENESS_BUCKETS = 4
AGGREGATIONS: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
# name -> (eps_low, eps_high, aggregation)
LOSS_DEFAULTS: dict[str, tuple[float, float, Aggregation]] = {
    "reinforce": (0.0, 0.0, "token-mean"),
    "grpo": (0.2, 0.2, "seq-mean-token-mean"),
    "dapo": (0.2, 0.28, "token-mean"),
    "gspo": (3e-4, 4e-4, "seq-mean-token-mean"),
    "cispo": (1.0, 0.28, "token-mean"),
}


class LossConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Which policy loss to use and its knobs. Fields left as None take the loss's default.

    eps_low, eps_high: the ratio is clipped to [1 - eps_low, 1 + eps_high].
    dual_clip: c > 1 bounds the loss of negative-advantage tokens at -c * A (dual-clip PPO).
    log_ratio_clamp: log-ratios are clamped to +-this before exp (no overflow).
    constant_normaliser: the Dr. GRPO constant (needed by seq-mean-token-sum-norm).
    kl_coef, kl_estimator: KL penalty to reference logprobs (k1: log p - log ref; k3: the
        low-variance non-negative estimator exp(ref - p) - (ref - p) - 1).
    entropy_coef: entropy bonus (the loss subtracts coef x the aggregated entropy).
    tis_cap: truncated importance sampling cap C (None: off).
    seq_mask: sequence-level IS masking ("off", "sequence" or "geometric"; module doc), with
        the bounds seq_mask_low < 1 < seq_mask_high on the ratio (None: SEQ_MASK_DEFAULTS).
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

    def __post_init__(self) -> None:
        if self.name not in LOSS_DEFAULTS:
            raise ValueError(f"LossConfig.name must be one of {LOSS_NAMES}, got {self.name!r}")
        eps_low, eps_high, aggregation = LOSS_DEFAULTS[self.name]
        if self.eps_low is None:
            self.eps_low = eps_low
        if self.eps_high is None:
            self.eps_high = eps_high
        if self.aggregation is None:
            self.aggregation = aggregation
        if self.name == "cispo":  # a weight, not a clip of the objective: 1.0 is "no lower bound"
            if not 0.0 <= self.eps_low <= 1.0:
                raise ValueError(f"LossConfig.eps_low must be in [0, 1] for cispo, got {self.eps_low}")
        elif not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"LossConfig.eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"LossConfig.eps_high must be >= 0, got {self.eps_high}")
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
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("LossConfig.kl_coef and entropy_coef must be >= 0")
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


class LossNormaliser(NamedTuple):
    """Step-wide counts that the aggregation divides by (all micro-batches, all ranks)."""

    num_tokens: float
    num_sequences: float

    @classmethod
    def from_mask(cls, loss_mask: Tensor) -> LossNormaliser:
        """The counts of this one batch (use when the batch is the whole step)."""
        mask = loss_mask.bool()
        return cls(float(mask.sum()), float(mask.any(dim=-1).sum()))


def aggregate(
    values: Tensor,
    loss_mask: Tensor,
    aggregation: str,
    normaliser: LossNormaliser,
    constant_normaliser: float | None = None,
) -> Tensor:
    """Reduce per-token values [B, T] to a scalar according to `aggregation` (module doc)."""
    mask = loss_mask.bool()
    values = torch.where(mask, values, torch.zeros_like(values))
    num_sequences = max(normaliser.num_sequences, 1.0)
    if aggregation == "token-mean":
        return values.sum() / max(normaliser.num_tokens, 1.0)
    per_sequence_sum = values.sum(dim=-1)
    if aggregation == "seq-mean-token-mean":
        tokens_per_sequence = mask.sum(dim=-1).clamp(min=1).to(values.dtype)
        return (per_sequence_sum / tokens_per_sequence).sum() / num_sequences
    if aggregation == "seq-mean-token-sum":
        return per_sequence_sum.sum() / num_sequences
    if aggregation == "seq-mean-token-sum-norm":
        if not constant_normaliser:
            raise ValueError("seq-mean-token-sum-norm needs a constant_normaliser")
        return per_sequence_sum.sum() / (num_sequences * constant_normaliser)
    raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


def _masked_mean(values: Tensor, mask: Tensor, count: Tensor) -> Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum() / count.clamp(min=1)


def _masked_extreme(values: Tensor, mask: Tensor, largest: bool) -> Tensor:
    """Max (min) over masked entries; 0 when there are none. No host sync (GPU-friendly)."""
    fill = -math.inf if largest else math.inf
    masked = torch.where(mask, values, torch.full_like(values, fill))
    extreme = masked.max() if largest else masked.min()
    return torch.where(mask.any(), extreme, torch.zeros_like(extreme))


def policy_loss(
    config: LossConfig,
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    normaliser: LossNormaliser | None = None,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    staleness: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of one (micro-)batch and its metrics.

    logprobs: trainer logprobs [B, T] (with grad). sampler_logprobs, advantages, loss_mask: [B, T].
    normaliser: step-wide counts (default: this batch's own, i.e. the batch is the whole step).
    old_logprobs: the PPO ratio's denominator; default see the module doc.
    ref_logprobs: reference-policy logprobs (needed when kl_coef > 0).
    entropy: per-token entropy [B, T] (needed when entropy_coef > 0, with grad; else a metric).
    staleness: per-token policy-version lag [B, T] (integers >= 0): the gap metrics per bucket.
    Returns (loss, metrics); metrics are detached 0-dim tensors, local to this batch; combine
    them over micro-batches and ranks with `combine_metrics`.
    """
    shape = logprobs.shape
    for name, tensor in (
        ("sampler_logprobs", sampler_logprobs),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
    ):
        if tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs has {tuple(shape)}")
    if logprobs.dim() != 2:
        raise ValueError(f"policy_loss expects [B, T] tensors, got shape {tuple(shape)}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")

    mask = loss_mask.bool()
    if normaliser is None:
        normaliser = LossNormaliser.from_mask(mask)
    zeros = torch.zeros_like(logprobs)

    def clean(t: Tensor) -> Tensor:  # masked values must not leak (even nan/inf): select, never multiply
        return torch.where(mask, t.to(logprobs.dtype), zeros)

    logp = clean(logprobs)
    sampler_logp = clean(sampler_logprobs).detach()
    adv = clean(advantages).detach()
    if old_logprobs is not None:
        old_logp = clean(old_logprobs).detach()
    elif config.tis_cap is not None:
        old_logp = logp.detach()
    else:
        old_logp = sampler_logp
    clamp = config.log_ratio_clamp
    # LossConfig.__post_init__ filled in every None from the loss's defaults.
    eps_low, eps_high = cast(float, config.eps_low), cast(float, config.eps_high)
    aggregation = cast(Aggregation, config.aggregation)
    num_tokens = mask.sum()
    metrics: dict[str, Tensor] = {}

    if config.name == "reinforce":
        ratio = torch.ones_like(logp)
        per_token = -adv * logp
        clipped_low = clipped_high = torch.zeros_like(mask)
    elif config.name == "cispo":
        ratio = torch.exp((logp.detach() - old_logp).clamp(-clamp, clamp))
        weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        per_token = -weight * adv * logp
        clipped_low = mask & (ratio < 1.0 - eps_low)
        clipped_high = mask & (ratio > 1.0 + eps_high)
    else:
        if config.name == "gspo":
            # GSPO-token form: the value is the sequence ratio, the gradient flows per token.
            tokens_per_seq = mask.sum(dim=-1, keepdim=True).clamp(min=1)
            seq_log_ratio = ((logp - old_logp).sum(dim=-1, keepdim=True) / tokens_per_seq).detach()
            log_ratio = seq_log_ratio.clamp(-clamp, clamp) + logp - logp.detach()
        else:
            log_ratio = (logp - old_logp).clamp(-clamp, clamp)
        ratio = torch.exp(log_ratio)
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        per_token = torch.maximum(unclipped, clipped)
        clipped_low = mask & (adv < 0) & (ratio < 1.0 - eps_low)
        clipped_high = mask & (adv > 0) & (ratio > 1.0 + eps_high)
        if config.dual_clip is not None:
            bound = -adv * config.dual_clip
            dual = mask & (adv < 0) & (per_token > bound)
            per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
            metrics["dual_clip_frac"] = dual.sum() / num_tokens.clamp(min=1)

    if config.tis_cap is not None:
        log_weight = (old_logp - sampler_logp).clamp(-clamp, math.log(config.tis_cap))
        tis_weight = torch.exp(log_weight).detach()
        per_token = per_token * tis_weight
        metrics["tis_weight_mean"] = _masked_mean(tis_weight, mask, num_tokens)
        truncated = mask & (old_logp - sampler_logp > math.log(config.tis_cap))
        metrics["tis_truncated_frac"] = truncated.sum() / num_tokens.clamp(min=1)

    if config.seq_mask != "off":
        keep, seq_log_ratio, has_tokens = _sequence_mask(config, logp.detach() - sampler_logp, mask)
        per_token = torch.where(keep[:, None], per_token, torch.zeros_like(per_token))
        metrics["seq_masked_sum"] = (has_tokens & ~keep).sum().to(torch.float32)
        seq_ratio = torch.exp(seq_log_ratio.clamp(-clamp, clamp))
        metrics["seq_ratio_max"] = _masked_extreme(seq_ratio, has_tokens, largest=True)
        metrics["seq_ratio_min"] = _masked_extreme(seq_ratio, has_tokens, largest=False)

    if config.kl_coef > 0:
        assert ref_logprobs is not None
        ref_logp = clean(ref_logprobs).detach()
        if config.kl_estimator == "k1":
            kl = logp - ref_logp
        else:
            delta = (ref_logp - logp).clamp(-clamp, clamp)
            kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + config.kl_coef * kl
        metrics["kl_ref"] = _masked_mean(kl.detach(), mask, num_tokens)

    loss = aggregate(per_token, mask, aggregation, normaliser, config.constant_normaliser)
    if entropy is not None:
        ent = clean(entropy)
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * aggregate(
                ent, mask, aggregation, normaliser, config.constant_normaliser
            )
        metrics["entropy"] = _masked_mean(ent.detach(), mask, num_tokens)

    with torch.no_grad():
        ratio = ratio.detach()
        gap = logp.detach() - sampler_logp  # log(trainer / sampler) on the sampled tokens
        count = num_tokens.clamp(min=1)
        adv_mean = _masked_mean(adv, mask, num_tokens)
        metrics.update(
            loss=loss.detach(),
            clip_frac_low=clipped_low.sum() / count,
            clip_frac_high=clipped_high.sum() / count,
            ratio_mean=_masked_mean(ratio, mask, num_tokens),
            ratio_min=_masked_extreme(ratio, mask, largest=False),
            ratio_max=_masked_extreme(ratio, mask, largest=True),
            sampler_kl_k1=_masked_mean(-gap, mask, num_tokens),
            sampler_kl_k3=_masked_mean(torch.exp(gap.clamp(max=clamp)) - gap - 1.0, mask, num_tokens),
            logprob_gap_max=_masked_extreme(gap.abs(), mask, largest=True),
            logprob_gap_mean=_masked_mean(gap.abs(), mask, num_tokens),
            advantage_mean=adv_mean,
            advantage_std=_masked_mean((adv - adv_mean) ** 2, mask, num_tokens).sqrt(),
            num_tokens=num_tokens.to(torch.float32),
            num_sequences=mask.any(dim=-1).sum().to(torch.float32),
        )
        if staleness is not None:
            if staleness.shape != shape:
                raise ValueError(f"staleness has shape {tuple(staleness.shape)}, logprobs has {tuple(shape)}")
            bucket = staleness.clamp(0, STALENESS_BUCKETS - 1)
            for k in range(STALENESS_BUCKETS):
                in_bucket = mask & (bucket == k)
                name = _bucket_name(k)
                metrics[f"staleness_tokens_{name}_sum"] = in_bucket.sum().to(torch.float32)
                metrics[f"logprob_gap_abs_{name}_sum"] = torch.where(in_bucket, gap.abs(), zeros).sum()
    return loss, metrics


def _bucket_name(k: int) -> str:
    return f"s{k}plus" if k == STALENESS_BUCKETS - 1 else f"s{k}"


def _sequence_mask(config: LossConfig, log_ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(rows kept [B], each row's log sequence ratio [B], rows with a sampled token [B]) for
    `config.seq_mask` (the module doc). `log_ratio` is 0 where masked."""
    tokens = mask.sum(dim=-1)
    seq_log_ratio = log_ratio.sum(dim=-1)
    if config.seq_mask == "geometric":
        seq_log_ratio = seq_log_ratio / tokens.clamp(min=1).to(log_ratio.dtype)
    low, high = cast(float, config.seq_mask_low), cast(float, config.seq_mask_high)
    log_low = math.log(low) if low > 0 else -math.inf
    keep = (seq_log_ratio >= log_low) & (seq_log_ratio <= math.log(high))
    return keep, seq_log_ratio, tokens > 0


def finish_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The step's metrics after `combine_metrics`: the counts summed over parts become what they
    count for (seq_masked_frac over the step's sequences; logprob_gap_mean_s* as the mean |gap|
    of the tokens in each staleness bucket, 0.0 for an empty bucket). The counts themselves stay
    (seq_masked_sum; staleness_tokens_s*_sum, the histogram's data)."""
    out = dict(metrics)
    if "seq_masked_sum" in out:
        out["seq_masked_frac"] = out["seq_masked_sum"] / max(out.get("num_sequences", 0.0), 1.0)
    for k in range(STALENESS_BUCKETS):
        name = _bucket_name(k)
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
