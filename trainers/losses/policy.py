"""`policy_loss`: the configured objective, the terms around it, the aggregation, the metrics.

Every tensor is [B, T]: one row per sequence, already shifted so that position t holds the
quantities of the token the model predicts there (see trainers/batching.py). `loss_mask` is 1 on
the tokens the policy sampled; everything else is ignored exactly (masked values never reach the
loss or the gradient, even if they are inf or nan).

The ratio's denominator logp_old: the given `old_logprobs`; else, with token TIS on (tis_cap),
the trainer's own detached logprob (the ratio is then 1 and TIS weights the sampler gap); else
the sampler's logprob (with one update per batch the ratio then corrects the sampler/trainer
mismatch and any policy lag).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from .aggregation import Aggregation, LossNormaliser, aggregate
from .config import LossConfig
from .metrics import batch_metrics
from .registry import TokenInputs, get_loss
from .terms import EntropyBonus, KLPenalty, SequenceMask, TokenTerm, TokenTIS


def token_terms(config: LossConfig, ref_logp: Tensor | None) -> list[TokenTerm]:
    """The per-token terms the config turns on, in the order they apply (terms.py).
    ref_logp: the reference's masked, detached logprobs (needed when kl_coef > 0)."""
    terms: list[TokenTerm] = []
    if config.tis_cap is not None:
        terms.append(TokenTIS(config.tis_cap))
    if config.seq_mask != "off":
        low, high = cast(float, config.seq_mask_low), cast(float, config.seq_mask_high)
        terms.append(SequenceMask(config.seq_mask, low, high))
    if config.kl_coef > 0:
        assert ref_logp is not None
        terms.append(KLPenalty(config.kl_coef, config.kl_estimator, ref_logp))
    return terms


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
    extra_terms: Sequence[TokenTerm] = (),
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of one (micro-)batch and its metrics.

    logprobs: trainer logprobs [B, T] (with grad). sampler_logprobs, advantages, loss_mask: [B, T].
    normaliser: step-wide counts (default: this batch's own, i.e. the batch is the whole step).
    old_logprobs: the ratio's denominator; default see the module doc.
    ref_logprobs: reference-policy logprobs (needed when kl_coef > 0).
    entropy: per-token entropy [B, T] (needed when entropy_coef > 0, with grad; else a metric).
    staleness: per-token policy-version lag [B, T] (integers >= 0): the gap metrics per bucket.
    extra_terms: per-token terms the caller adds after the config's (the trainer's top-k forward
    KL, terms.py `TopKForwardKL`).
    Returns (loss, metrics); metrics are detached 0-dim tensors, local to this batch; combine
    them over micro-batches and ranks with `combine_metrics`.
    """
    _check_inputs(config, logprobs, sampler_logprobs, advantages, loss_mask, ref_logprobs, entropy)
    objective = get_loss(config.name)
    mask = loss_mask.bool()
    if normaliser is None:
        normaliser = LossNormaliser.from_mask(mask)
    zeros = torch.zeros_like(logprobs)

    def clean(t: Tensor) -> Tensor:  # masked values must not leak (even nan/inf): select, never multiply
        return torch.where(mask, t.to(logprobs.dtype), zeros)

    logp = clean(logprobs)
    sampler_logp = clean(sampler_logprobs).detach()
    if old_logprobs is not None:
        old_logp = clean(old_logprobs).detach()
    elif config.tis_cap is not None:
        old_logp = logp.detach()
    else:
        old_logp = sampler_logp
    # LossConfig.__post_init__ filled in every None from the loss's defaults.
    x = TokenInputs(
        logp=logp,
        old_logp=old_logp,
        sampler_logp=sampler_logp,
        adv=clean(advantages).detach(),
        mask=mask,
        num_tokens=mask.sum(),
        eps_low=cast(float, config.eps_low),
        eps_high=cast(float, config.eps_high),
        log_ratio_clamp=config.log_ratio_clamp,
        dual_clip=config.dual_clip,
    )
    aggregation = cast(Aggregation, config.aggregation)

    def reduce(values: Tensor) -> Tensor:
        return aggregate(values, mask, aggregation, normaliser, config.constant_normaliser)

    term = objective.per_token(x)
    per_token, metrics = term.per_token, dict(term.metrics)
    ref_logp = clean(ref_logprobs).detach() if config.kl_coef > 0 and ref_logprobs is not None else None
    for token_term in [*token_terms(config, ref_logp), *extra_terms]:
        per_token = token_term.apply(per_token, x, metrics)
    loss = reduce(per_token)
    if entropy is not None:
        loss = EntropyBonus(config.entropy_coef, clean(entropy)).apply(loss, x, reduce, metrics)
    metrics.update(batch_metrics(loss, term, x, staleness))
    return loss, metrics


def _check_inputs(
    config: LossConfig,
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    ref_logprobs: Tensor | None,
    entropy: Tensor | None,
) -> None:
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
