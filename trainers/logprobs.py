"""Per-token log-probabilities and entropies from logits, in float32, a chunk of rows at a time.

The vocabulary can be large (152k for Qwen2.5), so [positions x vocab] float32 tensors are the
trainer's biggest. `token_logprobs` is a custom autograd function that keeps only the logits
themselves for backward (plus one float per position) and recomputes the softmax in backward,
row-chunk by row-chunk, writing straight into the logits' gradient; no log-softmax, softmax or
float32 copy of the whole micro-batch is kept. The entropy metric (no grad) can come from the same
pass (`token_logprobs_and_entropy`). Only an entropy *bonus* (entropy with grad) uses plain
autograd and its softmax copy.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 26  # 64M float32 (256 MiB) of temporaries per chunk of rows


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32  # float64 for gradcheck


def _scaled_chunks(flat: Tensor, temperature: float, dtype: torch.dtype):
    """(start row, z) per chunk of rows of flat [rows, V]: z = those rows in `dtype`, / temperature
    (z may view `flat` itself: never modify it in place)."""
    step = _rows_per_chunk(flat.shape[-1])
    for lo in range(0, flat.shape[0], step):
        z = flat[lo : lo + step].to(dtype)
        yield lo, (z / temperature if temperature != 1.0 else z)


def _chunk_entropy(z: Tensor, lse: Tensor) -> Tensor:
    """H = lse - sum(p * z) with p = exp(z - lse), per row of z [rows, V]; lse [rows]."""
    return lse - (torch.sub(z, lse[:, None]).exp_() * z).sum(-1)


class _TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
        vocab = logits.shape[-1]
        flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1, 1).long()
        dtype = _compute_dtype(logits)
        out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
        log_normaliser = torch.empty_like(out)
        # The entropy (a metric, no grad) reuses the chunk's float32 copy and log-normaliser.
        entropy = torch.empty_like(out) if with_entropy else out.new_empty(0)
        for lo, z in _scaled_chunks(flat, temperature, dtype):
            rows = slice(lo, lo + z.shape[0])
            lse = torch.logsumexp(z, dim=-1)
            log_normaliser[rows] = lse
            out[rows] = z.gather(1, flat_targets[rows]).squeeze(1)
            if with_entropy:
                entropy[rows] = _chunk_entropy(z, lse)
        out -= log_normaliser
        ctx.save_for_backward(logits, flat_targets, log_normaliser)
        ctx.temperature = temperature
        entropy = entropy.view(targets.shape) if with_entropy else entropy
        ctx.mark_non_differentiable(entropy)
        return out.view(targets.shape), entropy

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_entropy: Tensor) -> tuple[Tensor, None, None, None]:
        logits, flat_targets, log_normaliser = ctx.saved_tensors
        temperature = ctx.temperature
        flat = logits.reshape(-1, logits.shape[-1])
        dtype = log_normaliser.dtype
        grad_flat = grad_out.reshape(-1, 1).to(dtype)
        grad = torch.empty_like(flat)
        for lo, z in _scaled_chunks(flat, temperature, dtype):
            rows = slice(lo, lo + z.shape[0])
            g = grad_flat[rows]
            # d logp / d logits = (onehot(target) - softmax(z)) / temperature
            chunk = torch.sub(z, log_normaliser[rows, None]).exp_().mul_(-g)  # z may view logits
            chunk.scatter_add_(1, flat_targets[rows], g)
            if temperature != 1.0:
                chunk /= temperature
            grad[rows] = chunk
        return grad.view_as(logits), None, None, None


def _token_logprobs(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for logprobs, got {temperature}")
    return _TokenLogprob.apply(logits, targets, float(temperature), with_entropy)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[target] in float32 (float64 for float64 logits): [..., V], [...] -> [...]."""
    return _token_logprobs(logits, targets, temperature, False)[0]


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) per position, float32 ([..., V] -> [...]).

    Differentiable (plain autograd, keeps a softmax copy) when grad is enabled and the logits
    require it; otherwise computed a chunk of rows at a time.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = _compute_dtype(logits)
    if torch.is_grad_enabled() and logits.requires_grad:
        z = logits.to(dtype) / temperature
        return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
    flat = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
    for lo, z in _scaled_chunks(flat, temperature, dtype):
        out[lo : lo + z.shape[0]] = _chunk_entropy(z, torch.logsumexp(z, dim=-1))
    return out.view(logits.shape[:-1])


def token_logprobs_and_entropy(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` (with grad) and the entropy metric (no grad; None unless `with_entropy`)
    in one pass over the logits: one float32 copy and one log-normaliser per chunk serve both,
    faster than the two apart (bench/RESULTS.md, "bench/vs_trl.py"). An entropy *bonus* needs
    `entropy_from_logits` (with grad) instead."""
    logprobs, entropy = _token_logprobs(logits, targets, temperature, with_entropy)
    return logprobs, entropy if with_entropy else None
