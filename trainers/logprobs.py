"""Per-token log-probabilities and entropies from logits, in float32, a chunk of rows at a time.

The vocabulary can be large (152k for Qwen2.5), so [positions x vocab] float32 tensors are the
trainer's biggest. `token_logprobs` is a custom autograd function that keeps only the logits
themselves for backward (plus one float per position) and recomputes the softmax in backward,
row-chunk by row-chunk, writing straight into the logits' gradient; no log-softmax, softmax or
float32 copy of the whole micro-batch is kept. The entropy metric (no grad) can come from the same
pass (`token_logprobs_and_entropy`). Only an entropy *bonus* (entropy with grad) uses plain
autograd and its softmax copy.

`head_token_scores` goes one step further (`TrainerConfig.fused_head`): from the final hidden
states and the output layer's weight, a chunk of rows at a time, so the logits of a micro-batch
never exist whole, and only the rows asked for (the trained tokens) pass the vocabulary at all.
Its backward recomputes each chunk's logits (one extra [rows x hidden] x [hidden x vocab] matmul)
instead of keeping them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

CHUNK_ELEMENTS = 1 << 26  # 64M float32 (256 MiB) of temporaries per chunk of rows
# The fused head's chunks: each one adds a [vocab x hidden] product to the weight's gradient, so
# fewer, larger chunks (512 MiB of float32 logits each) than above.
HEAD_CHUNK_ELEMENTS = 1 << 27


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


def _score_chunk(
    z: Tensor, targets: Tensor, rows: slice, out: Tensor, log_normaliser: Tensor, entropy: Tensor
) -> None:
    """Write rows' target logits (out [N, C]), log-normaliser and (when `entropy` is not empty)
    entropy from z [rows, V] (float32, already / temperature); targets [rows, C]."""
    lse = torch.logsumexp(z, dim=-1)
    log_normaliser[rows] = lse
    out[rows] = z.gather(1, targets)
    if entropy.numel():
        entropy[rows] = _chunk_entropy(z, lse)


def _chunk_grad(z: Tensor, lse: Tensor, g: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """d(sum_c g_c * logp[target_c]) / d logits = (sum_c g_c onehot(target_c) - sum_c g_c
    softmax(z)) / temperature, for z = logits / temperature [rows, V], lse [rows], g and targets
    [rows, C]."""
    weight = g if g.shape[1] == 1 else g.sum(1, keepdim=True)
    grad = torch.sub(z, lse[:, None]).exp_().mul_(-weight)  # z may view the logits: not in place
    grad.scatter_add_(1, targets, g)
    return grad.div_(temperature) if temperature != 1.0 else grad


class _TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        columns = targets.shape[-1] if targets.dim() == logits.dim() else 1  # C targets a position
        flat_targets = targets.reshape(flat.shape[0], columns).long()
        dtype = _compute_dtype(logits)
        out = torch.empty(flat_targets.shape, dtype=dtype, device=logits.device)
        log_normaliser = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
        # The entropy (a metric, no grad) reuses the chunk's float32 copy and log-normaliser.
        entropy = torch.empty_like(log_normaliser) if with_entropy else out.new_empty(0)
        for lo, z in _scaled_chunks(flat, temperature, dtype):
            rows = slice(lo, lo + z.shape[0])
            _score_chunk(z, flat_targets[rows], rows, out, log_normaliser, entropy)
        out -= log_normaliser[:, None]
        ctx.save_for_backward(logits, flat_targets, log_normaliser)
        ctx.temperature = temperature
        entropy = entropy.view(logits.shape[:-1]) if with_entropy else entropy
        ctx.mark_non_differentiable(entropy)
        return out.view(targets.shape), entropy

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_entropy: Tensor) -> tuple[Tensor, None, None, None]:
        logits, flat_targets, log_normaliser = ctx.saved_tensors
        temperature = ctx.temperature
        flat = logits.reshape(-1, logits.shape[-1])
        dtype = log_normaliser.dtype
        grad_flat = grad_out.reshape(flat_targets.shape).to(dtype)
        grad = torch.empty_like(flat)
        for lo, z in _scaled_chunks(flat, temperature, dtype):
            rows = slice(lo, lo + z.shape[0])
            grad[rows] = _chunk_grad(z, log_normaliser[rows], grad_flat[rows], flat_targets[rows], temperature)
        return grad.view_as(logits), None, None, None


def _token_logprobs(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for logprobs, got {temperature}")
    return _TokenLogprob.apply(logits, targets, float(temperature), with_entropy)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[target] in float32 (float64 for float64 logits): [..., V], [...] -> [...];
    targets [..., C] (C tokens a position) give [..., C]."""
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


def logits_token_scores(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool, with_argmax: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(logprobs with grad, entropy or None, argmax or None) of whole logits [..., V]: what
    `head_token_scores` gives, from logits that exist already."""
    logprobs, entropy = token_logprobs_and_entropy(logits, targets, temperature, with_entropy)
    return logprobs, entropy, logits.detach().argmax(dim=-1) if with_argmax else None


class TokenScores(NamedTuple):
    """What a training forward gives the losses, each [B, T] (float32; argmax long): the target's
    logprob (with grad), the entropy (a metric, no grad) and the argmax, the last two None unless
    asked for. Positions that were not selected hold 0."""

    logprobs: Tensor
    entropy: Tensor | None = None
    argmax: Tensor | None = None


class _HeadTokenLogprob(torch.autograd.Function):
    """hidden [N, H] @ weight [V, H]^T -> log softmax(. / temperature)[target], a chunk of rows at a
    time; inputs in the compute dtype (bf16 or float32), softmax statistics in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, with_argmax):
        rows = hidden.shape[0]
        step = max(1, HEAD_CHUNK_ELEMENTS // weight.shape[0])
        dtype = _compute_dtype(hidden)
        columns = targets.shape[1] if targets.dim() == 2 else 1  # C targets a row
        flat_targets = targets.reshape(rows, columns).long()
        out = torch.empty(flat_targets.shape, dtype=dtype, device=hidden.device)
        log_normaliser = torch.empty(rows, dtype=dtype, device=hidden.device)
        entropy = torch.empty_like(log_normaliser) if with_entropy else out.new_empty(0)
        argmax = torch.empty(rows if with_argmax else 0, dtype=torch.long, device=hidden.device)
        for lo in range(0, rows, step):
            part = slice(lo, lo + step)
            z = (hidden[part] @ weight.T).to(dtype)
            if with_argmax:
                argmax[part] = z.argmax(dim=-1)
            if temperature != 1.0:
                z /= temperature
            _score_chunk(z, flat_targets[part], part, out, log_normaliser, entropy)
        out -= log_normaliser[:, None]
        ctx.save_for_backward(hidden, weight, flat_targets, log_normaliser)
        ctx.temperature, ctx.step = temperature, step
        ctx.mark_non_differentiable(entropy, argmax)
        return out.view(targets.shape), entropy, argmax

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy, _grad_argmax):
        hidden, weight, flat_targets, log_normaliser = ctx.saved_tensors
        temperature, step = ctx.temperature, ctx.step
        dtype = log_normaliser.dtype
        grad_out = grad_out.reshape(flat_targets.shape).to(dtype)
        grad_hidden = torch.empty_like(hidden)
        # The weight's gradient sums every chunk's product: in float32 (or float64), cast at the end.
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        for lo in range(0, hidden.shape[0], step):
            part = slice(lo, lo + step)
            z = (hidden[part] @ weight.T).to(dtype)
            if temperature != 1.0:
                z /= temperature
            grad_z = _chunk_grad(z, log_normaliser[part], grad_out[part], flat_targets[part], temperature)
            grad_z = grad_z.to(hidden.dtype)
            grad_hidden[part] = grad_z @ weight
            product = grad_z.T @ hidden[part]
            grad_weight += product
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def head_token_scores(
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    with_argmax: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The output layer and `token_logprobs_and_entropy` in one: hidden [N, H] (the rows to score),
    head (the model's `lm_head`), targets [N] (or [N, C]: C tokens a row) -> (logprobs [N] (or
    [N, C]) with grad, entropy [N] or None, argmax [N] or None), equal to scoring `head(hidden)` up to float rounding. A bias-free
    nn.Linear head runs fused (module doc); any other head is called on the rows and scored.
    Under autocast the matmuls run in its dtype, as `head(hidden)` would."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for logprobs, got {temperature}")
    if type(head) is not nn.Linear or head.bias is not None:
        return logits_token_scores(head(hidden), targets, temperature, with_entropy, with_argmax)
    weight = head.weight
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    with torch.autocast(device, enabled=False):
        logprobs, entropy, argmax = _HeadTokenLogprob.apply(
            hidden, weight, targets, float(temperature), with_entropy, with_argmax
        )
    return logprobs, entropy if with_entropy else None, argmax if with_argmax else None
