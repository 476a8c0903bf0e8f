"""The terms applied around any objective: the corrections, the KL penalty, the entropy bonus.

Each is a small object built from the config (policy.py `token_terms`) with the metrics it
reports (name -> what it means). The per-token ones (`TokenTerm`) take the objective's per-token
loss and return it changed, in this order: token TIS, sequence masking, KL. The entropy bonus
changes the aggregated loss.

Truncated importance sampling (`TokenTIS`, `LossConfig.tis_cap`): each token weighted by
min(exp(logp_old - logp_sampler), tis_cap), a stop-gradient; with it on (and no explicit
old_logprobs) logp_old is the trainer's own detached logprob, so the objective's ratio is 1.

Sequence-level IS masking (`SequenceMask`, `LossConfig.seq_mask`, the "MIS" / rejection
family): a sequence whose importance ratio between the trainer's (detached) logprobs and the
sampler's falls outside [seq_mask_low, seq_mask_high] gives no policy-gradient term at all (its KL
and entropy terms stay; the step's normaliser still counts it). "sequence": the ratio is the
product over the sequence's sampled tokens, exp(sum(logp - logp_sampler)); "geometric": its
per-token geometric mean, exp(mean(logp - logp_sampler)), which does not grow with length. A
token-level mismatch (a stale or numerically different sampler) that a token TIS cap would only
truncate rejects the whole sequence here. Counted: seq_masked_frac.

KL (`KLPenalty`, `LossConfig.kl_coef`): kl_coef x the per-token KL to reference logprobs (k1:
log p - log ref; k3: the low-variance non-negative estimator exp(ref - p) - (ref - p) - 1).

Top-k forward KL (`TopKForwardKL`, on-policy distillation's `distill.top_k`; the trainer adds it
when the batch carries the teacher's top-k): weight x sum over the teacher's top-k tokens j at each
sampled position of p_T(j) (log p_T(j) - log p_S(j)), p_T the teacher's full-vocabulary
probability (not renormalised over the k) and log p_S the trainer's logprob of j (with grad).

Entropy (`EntropyBonus`): the loss minus entropy_coef x the aggregated entropy (coef 0: the
entropy is a metric only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
from torch import Tensor

from .metrics import masked_extreme, masked_mean
from .registry import TokenInputs


class TokenTerm:
    """A change to the per-token loss [B, T]; its metrics (0-dim tensors) go into `metrics`."""

    metrics: ClassVar[Mapping[str, str]]

    def apply(self, per_token: Tensor, x: TokenInputs, metrics: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError


class TokenTIS(TokenTerm):
    metrics: ClassVar[Mapping[str, str]] = {
        "tis_weight_mean": "mean TIS weight over sampled tokens",
        "tis_truncated_frac": "share of sampled tokens whose weight the cap truncates",
    }

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def apply(self, per_token: Tensor, x: TokenInputs, metrics: dict[str, Tensor]) -> Tensor:
        mask, num_tokens = x.mask, x.num_tokens
        log_weight = (x.old_logp - x.sampler_logp).clamp(-x.log_ratio_clamp, math.log(self.cap))
        tis_weight = torch.exp(log_weight).detach()
        per_token = per_token * tis_weight
        metrics["tis_weight_mean"] = masked_mean(tis_weight, mask, num_tokens)
        truncated = mask & (x.old_logp - x.sampler_logp > math.log(self.cap))
        metrics["tis_truncated_frac"] = truncated.sum() / num_tokens.clamp(min=1)
        return per_token


class SequenceMask(TokenTerm):
    metrics: ClassVar[Mapping[str, str]] = {
        "seq_masked_sum": "sequences the mask rejected (summed over the step)",
        "seq_masked_frac": "share of the step's sequences the mask rejected",
        "seq_ratio_max": "largest sequence ratio (trainer / sampler)",
        "seq_ratio_min": "smallest sequence ratio (trainer / sampler)",
    }

    def __init__(self, kind: str, low: float, high: float) -> None:
        self.kind, self.low, self.high = kind, low, high

    def apply(self, per_token: Tensor, x: TokenInputs, metrics: dict[str, Tensor]) -> Tensor:
        keep, seq_log_ratio, has_tokens = self.keep(x.logp.detach() - x.sampler_logp, x.mask)
        per_token = torch.where(keep[:, None], per_token, torch.zeros_like(per_token))
        metrics["seq_masked_sum"] = (has_tokens & ~keep).sum().to(torch.float32)
        seq_ratio = torch.exp(seq_log_ratio.clamp(-x.log_ratio_clamp, x.log_ratio_clamp))
        metrics["seq_ratio_max"] = masked_extreme(seq_ratio, has_tokens, largest=True)
        metrics["seq_ratio_min"] = masked_extreme(seq_ratio, has_tokens, largest=False)
        return per_token

    def keep(self, log_ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(rows kept [B], each row's log sequence ratio [B], rows with a sampled token [B]);
        `log_ratio` is 0 where masked."""
        tokens = mask.sum(dim=-1)
        seq_log_ratio = log_ratio.sum(dim=-1)
        if self.kind == "geometric":
            seq_log_ratio = seq_log_ratio / tokens.clamp(min=1).to(log_ratio.dtype)
        log_low = math.log(self.low) if self.low > 0 else -math.inf
        keep = (seq_log_ratio >= log_low) & (seq_log_ratio <= math.log(self.high))
        return keep, seq_log_ratio, tokens > 0


class KLPenalty(TokenTerm):
    metrics: ClassVar[Mapping[str, str]] = {"kl_ref": "mean KL estimate to the reference over sampled tokens"}

    def __init__(self, coef: float, estimator: str, ref_logp: Tensor) -> None:
        """ref_logp: the reference's logprobs [B, T], masked like TokenInputs and detached."""
        self.coef, self.estimator, self.ref_logp = coef, estimator, ref_logp

    def apply(self, per_token: Tensor, x: TokenInputs, metrics: dict[str, Tensor]) -> Tensor:
        logp, ref_logp, clamp = x.logp, self.ref_logp, x.log_ratio_clamp
        if self.estimator == "k1":
            kl = logp - ref_logp
        else:
            delta = (ref_logp - logp).clamp(-clamp, clamp)
            kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + self.coef * kl
        metrics["kl_ref"] = masked_mean(kl.detach(), x.mask, x.num_tokens)
        return per_token


class TopKForwardKL(TokenTerm):
    metrics: ClassVar[Mapping[str, str]] = {
        "forward_kl_topk": "mean top-k forward KL to the teacher over sampled tokens (distill.top_k)",
        "teacher_topk_mass": "mean teacher probability mass in its top-k over sampled tokens",
    }

    def __init__(self, weight: float, student_logp: Tensor, teacher_logp: Tensor) -> None:
        """student_logp: the trainer's logprobs of the teacher's top-k tokens [B, T, K] (with
        grad); teacher_logp: the teacher's [B, T, K], -inf where it gave none (K may be 0)."""
        self.weight, self.student_logp, self.teacher_logp = weight, student_logp, teacher_logp

    def apply(self, per_token: Tensor, x: TokenInputs, metrics: dict[str, Tensor]) -> Tensor:
        teacher = self.teacher_logp.to(per_token.dtype).detach()
        given = torch.isfinite(teacher) & x.mask[..., None]
        teacher = torch.where(given, teacher, torch.zeros_like(teacher))
        student = torch.where(given, self.student_logp.to(per_token.dtype), torch.zeros_like(teacher))
        p_teacher = torch.where(given, teacher.exp(), torch.zeros_like(teacher))
        kl = (p_teacher * (teacher - student)).sum(-1)
        per_token = per_token + self.weight * kl
        metrics["forward_kl_topk"] = masked_mean(kl.detach(), x.mask, x.num_tokens)
        metrics["teacher_topk_mass"] = masked_mean(p_teacher.sum(-1), x.mask, x.num_tokens)
        return per_token


class EntropyBonus:
    """The loss minus coef x the aggregated entropy (coef 0: only the metric)."""

    metrics: ClassVar[Mapping[str, str]] = {"entropy": "mean per-token entropy over sampled tokens"}

    def __init__(self, coef: float, entropy: Tensor) -> None:
        """entropy: per-token [B, T], masked like TokenInputs (with grad when coef > 0)."""
        self.coef, self.entropy = coef, entropy

    def apply(
        self, loss: Tensor, x: TokenInputs, reduce: Callable[[Tensor], Tensor], metrics: dict[str, Tensor]
    ) -> Tensor:
        """`reduce`: the loss's aggregation of per-token values [B, T] to a scalar."""
        if self.coef > 0:
            loss = loss - self.coef * reduce(self.entropy)
        metrics["entropy"] = masked_mean(self.entropy.detach(), x.mask, x.num_tokens)
        return loss
