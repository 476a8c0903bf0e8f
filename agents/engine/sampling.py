"""Next-token sampling for a batch of rows with per-row parameters, reproducible per seed.

Each row (one sample of one request) has its own temperature, top-k, top-p and a uniform draw
`u`. The token is drawn by inverse CDF from the row's distribution
    p = softmax(filter(logits / T))     (top-k first, then top-p, as vLLM and HF order them)
i.e. the first token (in vocabulary order) whose cumulative probability exceeds `u`. The
cumulative sums are done in float64 so that no token with positive probability is skipped
(`_inverse_cdf`: over large vocabularies, first per block of tokens, then within one block).
Greedy rows (T == 0) take the argmax of the unscaled logits and report the unscaled log-softmax.

The draw `u` comes from a counter-based hash (`uniform_draws`) of (seed, sample index, step):
no generator state, so a row's samples do not depend on which other rows share the batch, on
their order, or on how many steps ran before it joined. What is and is not guaranteed: given the
same logits, the same (seed, sample index, step) picks the same token. The logits of a row can
differ in the last bits between batch compositions (BLAS picks kernels by batch shape), which
changes a token only if `u` lands within that rounding error of a CDF boundary (probability
~1e-7 per token in float32).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over a uint64 array (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def seed_to_u64(seed: int) -> int:
    """Any Python int (negative, huge) -> a uint64 seed."""
    return int(seed) & 0xFFFFFFFFFFFFFFFF


def draw_keys(seeds: np.ndarray, sample_index: np.ndarray) -> np.ndarray:
    """Each sample's key of `uniform_draws`, which only the step then changes (uint64): computed
    once when a sample starts, so a decode step hashes only its step."""
    with np.errstate(over="ignore"):
        return _splitmix64(_splitmix64(seeds.astype(np.uint64)) ^ sample_index.astype(np.uint64))


def draws_from_keys(keys: np.ndarray, step: np.ndarray) -> np.ndarray:
    """`uniform_draws` from `draw_keys`: u in (0, 1) per row, float64.

    40 random bits, centred in their bucket: u * total stays below the CDF's total in float64,
    so the inverse CDF never runs off the end.
    """
    with np.errstate(over="ignore"):
        h = _splitmix64(keys ^ step.astype(np.uint64))
    return ((h >> np.uint64(24)).astype(np.float64) + 0.5) * 2.0**-40


def uniform_draws(seeds: np.ndarray, sample_index: np.ndarray, step: np.ndarray) -> np.ndarray:
    """u in (0, 1) per row: a pure function of (seed, sample index, step), float64."""
    return draws_from_keys(draw_keys(seeds, sample_index), step)


def filter_top_k_top_p(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    z [n, V] (already divided by temperature); top_k [n] int (0 = off); top_p [n] float (1 = off).
    The nucleus is the smallest set of most likely tokens whose mass reaches top_p (computed on the
    top-k-renormalised distribution); the most likely token is always kept.
    """
    vocab = z.shape[-1]
    sorted_z, order = z.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=z.device)
    k = torch.where(top_k > 0, top_k, vocab)
    keep = rank[None, :] < k[:, None]
    sorted_z = sorted_z.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(sorted_z, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    mask = torch.empty_like(keep).scatter_(1, order, keep)
    return z.masked_fill(~mask, float("-inf"))


_BLOCK = 1024  # vocabulary entries per block of the two-level inverse CDF


def _row_mass(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-normaliser and its probability mass per block of _BLOCK tokens (float64; a
    last, shorter block holds the remainder): (lse [n] float32, mass [n, blocks] float64)."""
    z = z.float()
    n, vocab = z.shape
    lse = torch.logsumexp(z, dim=-1)
    probs = torch.exp(z - lse[:, None])
    full = vocab // _BLOCK
    mass = probs[:, : full * _BLOCK].view(n, full, _BLOCK).sum(-1, dtype=torch.float64)
    if vocab % _BLOCK:
        tail = probs[:, full * _BLOCK :].sum(-1, keepdim=True, dtype=torch.float64)
        mass = torch.cat([mass, tail], dim=1)
    return lse, mass


@functools.cache
def _compiled_row_mass():
    # On a GPU, one fused pass per reduction over the [n, vocab] logits instead of a float copy,
    # a log-softmax, an exp, a float64 copy and a float64 scan of them all (bench/RESULTS.md,
    # 'bench/generate.py' on CUDA).
    return torch.compile(_row_mass, dynamic=True)


def _inverse_cdf(z: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first token (in vocabulary order) whose cumulative probability under softmax(z)
    exceeds u * total, per row -> (tokens [n] int64, their logprobs [n] float32).

    Small vocabularies: one float64 scan. Larger: a two-level search (which block holds the
    threshold, from the blocks' masses; then a scan of that block alone), so no float64 copy of
    the whole distribution is made. Both pick the same tokens up to float64 rounding of the sums.
    """
    vocab = z.shape[1]
    if vocab <= _BLOCK:
        # One exp pass: the token's logprob is the log of its float32 probability (within ~1e-7 of
        # the log-softmax wherever a token can be drawn at all), not a second pass over the vocab.
        probs = torch.softmax(z, dim=-1, dtype=torch.float32)
        cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
        tokens = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(1)
        tokens = tokens.clamp_(max=vocab - 1)
        return tokens, probs.gather(1, tokens[:, None]).squeeze(1).log_()
    lse, mass = (_compiled_row_mass() if z.is_cuda else _row_mass)(z)
    block_cdf = torch.cumsum(mass, dim=1)
    threshold = u * block_cdf[:, -1]
    block = torch.searchsorted(block_cdf, threshold[:, None], right=True).squeeze(1)
    block = block.clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    columns = block[:, None] * _BLOCK + torch.arange(_BLOCK, device=z.device)
    probs = torch.exp(z.gather(1, columns.clamp(max=vocab - 1)).float() - lse[:, None])
    within = torch.cumsum(probs.masked_fill_(columns >= vocab, 0.0), dim=1, dtype=torch.float64)
    # The block's own scan can round a hair below its mass in block_cdf: keep the threshold inside
    # it, so the token found is one with positive probability.
    rest = torch.minimum((threshold - before).clamp(min=0.0), within[:, -1] * (1 - 2.0**-50))
    tokens = block * _BLOCK + torch.searchsorted(within, rest[:, None], right=True).squeeze(1)
    return tokens, z.gather(1, tokens[:, None]).squeeze(1).float() - lse


# sample_tokens' per-row tensor arguments; the rest are flags computed on the host.
SAMPLING_TENSORS = ("temperature", "top_k", "top_p", "u")


def sampling_tensors(arrays: dict, device: torch.device | str) -> dict:
    """`sample_tokens` keyword arguments from host-side ones (numpy arrays and flags, as
    agents/engine/slots.py's `sampling_arrays` gives them): the SAMPLING_TENSORS arrays moved to `device`."""
    return {**arrays, **{key: torch.from_numpy(arrays[key]).to(device) for key in SAMPLING_TENSORS}}


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    *,
    any_filter: bool,
    any_greedy: bool,
    all_greedy: bool,
    any_scaled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row -> (tokens [n] int64, logprobs [n] float32).

    logits [n, V]; temperature [n] (0 = greedy); top_k [n]; top_p [n]; u [n] float64 in (0, 1).
    The flags (computed by the caller from its host-side copy of the parameters) skip work that
    no row needs; they never change a result. any_scaled: some row's temperature is neither 0
    nor 1 (else the logits need no division). A token's logprob is log_softmax(z)[token] of the
    row's z = filter(logits / T) (greedy rows: the unscaled, unfiltered logits).
    """
    if all_greedy:
        tokens = logits.argmax(dim=-1)
        z = logits.float()
        return tokens, z.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1)
    greedy = temperature == 0
    z = logits
    if any_scaled:
        z = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    if any_filter:
        # Greedy rows are never filtered: their logprob is the unscaled, unfiltered one.
        z = filter_top_k_top_p(z.float(), torch.where(greedy, 0, top_k), torch.where(greedy, 1.0, top_p))
    tokens, logprobs = _inverse_cdf(z, u)
    if not any_greedy:
        return tokens, logprobs
    # Greedy rows' z is their unscaled, unfiltered logits: the logprob of their argmax under it.
    argmax = logits.argmax(dim=-1)
    argmax_logprobs = z.gather(1, argmax[:, None]).squeeze(1).float() - torch.logsumexp(z.float(), dim=-1)
    return torch.where(greedy, argmax, tokens), torch.where(greedy, argmax_logprobs, logprobs)


__all__ = [
    "SAMPLING_TENSORS",
    "draw_keys",
    "draws_from_keys",
    "filter_top_k_top_p",
    "sample_tokens",
    "sampling_tensors",
    "seed_to_u64",
    "uniform_draws",
]
