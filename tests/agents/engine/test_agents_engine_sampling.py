"""The sampler: inverse-CDF draws follow the (filtered) distribution, filters match a per-row
reference, and the counter-based uniforms depend on exactly (seed, sample index, step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from toolgym.agents.engine.sampling import filter_top_k_top_p, sample_tokens, seed_to_u64, uniform_draws


def draws(rows: int, seed: int = 0) -> torch.Tensor:
    seeds = np.full(rows, seed_to_u64(seed), np.uint64)
    return torch.from_numpy(uniform_draws(seeds, np.arange(rows, dtype=np.uint64), np.zeros(rows, np.uint64)))


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    n = logits.shape[0]
    t = torch.full((n,), temperature)
    k, p = torch.full((n,), top_k), torch.full((n,), top_p)
    flags = dict(any_filter=top_k > 0 or top_p < 1, any_greedy=temperature == 0, all_greedy=temperature == 0)
    return sample_tokens(logits, t, k, p, draws(n, seed), **flags)


def test_uniform_draws_are_a_pure_function_of_the_counters() -> None:
    seeds = np.array([1, 1, 1, 2, 2**64 - 1], np.uint64)
    index = np.array([0, 1, 0, 0, 3], np.uint64)
    step = np.array([0, 0, 1, 0, 7], np.uint64)
    u = uniform_draws(seeds, index, step)
    assert np.array_equal(u, uniform_draws(seeds, index, step))
    assert len(set(u.tolist())) == 5 and ((u > 0) & (u < 1)).all()
    assert (
        uniform_draws(seeds[::-1].copy(), index[::-1].copy(), step[::-1].copy())[::-1].tolist() == u.tolist()
    )
    big = uniform_draws(
        np.arange(200_000, dtype=np.uint64), np.zeros(200_000, np.uint64), np.zeros(200_000, np.uint64)
    )
    assert abs(big.mean() - 0.5) < 0.005 and abs(big.var() - 1 / 12) < 0.002
    assert seed_to_u64(-1) == 2**64 - 1 and seed_to_u64(2**70 + 5) == 5


def test_samples_follow_the_distribution() -> None:
    rows, vocab = 40_000, 12
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 2
    for temperature, top_k, top_p in [
        (1.0, 0, 1.0),
        (0.6, 0, 1.0),
        (1.0, 5, 1.0),
        (1.3, 0, 0.7),
        (1.0, 4, 0.8),
    ]:
        tokens, logprobs = sample(
            logits.expand(rows, vocab), temperature, top_k, top_p, seed=temperature * 10 + top_k
        )
        expected = torch.softmax(
            filter_top_k_top_p((logits / temperature)[None], torch.tensor([top_k]), torch.tensor([top_p]))[0],
            -1,
        )
        freq = torch.bincount(tokens, minlength=vocab).double() / rows
        assert (freq - expected).abs().max() < 4 * (0.25 / rows) ** 0.5  # 4 sigma of the worst case
        assert (freq[expected == 0] == 0).all()
        assert torch.allclose(logprobs, expected.log()[tokens].float(), atol=1e-5)


def test_the_token_is_the_first_whose_cumulative_probability_passes_u() -> None:
    # The inverse CDF, row by row in Python floats, including a draw exactly on a boundary.
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(2))
    logits[1, 5:] = float("-inf")  # a row with most tokens impossible
    probs = (logits - torch.logsumexp(logits, -1, keepdim=True)).exp().double()  # as the sampler does
    cdf = probs.cumsum(-1)
    u = draws(8)
    u[2] = cdf[2, 6] / cdf[2, -1]  # exactly token 6's cumulative: token 7 (the CDF must exceed it)
    tokens, _ = sample_tokens(
        logits,
        torch.ones(8),
        torch.zeros(8),
        torch.ones(8),
        u,
        any_filter=False,
        any_greedy=False,
        all_greedy=False,
    )
    for row in range(8):
        threshold, running = float(u[row]) * float(cdf[row, -1]), 0.0
        cumulative = [running := running + p for p in probs[row].tolist()]
        assert tokens[row].item() == next(i for i, c in enumerate(cumulative) if c > threshold)
    assert tokens[2].item() == 7 and tokens[1].item() < 5


@pytest.mark.parametrize("vocab", [1024 * 3, 1024 * 5 + 321])
def test_large_vocabularies_search_by_block_for_the_same_token(vocab: int) -> None:
    # Past 1,024 tokens the inverse CDF first picks the block of tokens holding the threshold,
    # then scans that block alone: the same token as one scan of the whole row. Rows with whole
    # blocks of impossible tokens (filtered), mass in the last partial block, and draws near 0
    # and 1, which land in the first and last blocks with mass.
    rows = 64
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:8, 1024:] = float("-inf")  # all the mass in the first block
    logits[8:16, : vocab - 200] = float("-inf")  # all of it at the end
    logits[16:24, 500:2500] = float("-inf")  # a gap spanning a whole block
    logits[24:32] = float("-inf")
    logits[24:32, 2000] = 0.0  # one possible token
    u = draws(rows)
    u[32:40], u[40:48] = 1e-12, 1 - 1e-12
    ones, zeros = torch.ones(rows), torch.zeros(rows)
    flags = dict(any_filter=False, any_greedy=False, all_greedy=False, any_scaled=False)
    tokens, logprobs = sample_tokens(logits, ones, zeros, ones, u, **flags)
    log_probs = torch.log_softmax(logits.double(), -1)
    cdf = log_probs.exp().cumsum(-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    assert torch.equal(tokens, expected)
    assert (log_probs.gather(1, tokens[:, None]) > float("-inf")).all()
    assert torch.allclose(logprobs.double(), log_probs.gather(1, tokens[:, None]).squeeze(1), atol=1e-5)
    assert (tokens[:8] < 1024).all() and (tokens[8:16] >= vocab - 200).all()
    assert ((tokens[16:24] < 500) | (tokens[16:24] >= 2500)).all() and (tokens[24:32] == 2000).all()


def test_the_unit_temperature_shortcut_changes_nothing() -> None:
    # any_scaled=False (every temperature 0 or 1) skips the division, not a single result.
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    temperature = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    args = (logits, temperature, torch.zeros(6, dtype=torch.long), torch.ones(6), draws(6))
    flags = dict(any_filter=False, any_greedy=True, all_greedy=False)
    scaled, shortcut = sample_tokens(*args, **flags), sample_tokens(*args, **flags, any_scaled=False)
    assert torch.equal(scaled[0], shortcut[0]) and torch.equal(scaled[1], shortcut[1])


def test_greedy_rows_take_argmax_with_unscaled_logprob() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.0, 2.0])
    top_k = torch.tensor([3, 0, 0, 2, 1, 0])
    top_p = torch.tensor([0.5, 1.0, 0.9, 1.0, 1.0, 0.3])
    tokens, logprobs = sample_tokens(
        logits, temperature, top_k, top_p, draws(6), any_filter=True, any_greedy=True, all_greedy=False
    )
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    assert torch.allclose(logprobs[greedy], torch.log_softmax(logits[greedy], -1).max(-1).values)
    all_greedy = sample_tokens(
        logits, torch.zeros(6), top_k, top_p, draws(6), any_filter=True, any_greedy=True, all_greedy=True
    )
    assert torch.equal(all_greedy[0], logits.argmax(-1))


def reference_filter(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    order = row.argsort(descending=True).tolist()
    keep = order[:k] if k else order
    probs = torch.softmax(row[keep], -1).tolist()
    kept, mass = [], 0.0
    for token, prob in zip(keep, probs, strict=True):
        if p < 1.0 and mass >= p:
            break
        kept.append(token)
        mass += prob
    out = torch.full_like(row, float("-inf"))
    out[kept] = row[kept]
    return out


def test_filter_matches_per_row_reference() -> None:
    g = torch.Generator().manual_seed(2)
    z = torch.randn(8, 30, generator=g) * 3
    top_k = torch.tensor([0, 1, 5, 30, 0, 7, 2, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.9, 0.6, 0.99, 0.05])
    got = filter_top_k_top_p(z, top_k, top_p)
    for i in range(8):
        assert torch.equal(got[i], reference_filter(z[i], int(top_k[i]), float(top_p[i])))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sampling_picks_what_cpu_sampling_picks() -> None:
    # On a GPU the blocks' masses come from a torch.compile'd kernel reading bf16 logits directly.
    rows, vocab = 48, 151936
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    temperature = torch.tensor([1.0, 0.0, 0.7] * (rows // 3))
    u = draws(rows)
    args = (temperature, torch.zeros(rows, dtype=torch.long), torch.ones(rows), u)
    for any_scaled in (False, True):
        if not any_scaled:
            args = (torch.where(temperature == 0.7, 1.0, temperature), *args[1:])
        flags = dict(any_filter=False, any_greedy=True, all_greedy=False, any_scaled=any_scaled)
        cpu_tokens, cpu_logprobs = sample_tokens(logits, *args, **flags)
        cuda_tokens, cuda_logprobs = sample_tokens(logits.cuda(), *(a.cuda() for a in args), **flags)
        assert torch.equal(cuda_tokens.cpu(), cpu_tokens)
        assert torch.allclose(cuda_logprobs.cpu(), cpu_logprobs, atol=1e-4)
