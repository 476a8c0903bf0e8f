"""SGLang's small-batch linears in the packed layer (agents/kernels/packed_linear.py `SmallBatchLinears`,
bf16/fp16 with `kernels="vllm"`): the kernel computes the matmul, the layer's
decode-sized batches take them (and larger ones oneDNN's), its padded intermediate size changes
nothing, and a repack refreshes its copies."""

from __future__ import annotations

import copy

import pytest
import torch
from agents_testlib import layer_inputs, make_model, require_vllm_cpu_kernels

import toolgym.agents.kernels.packed_linear as packed_linear
from toolgym.agents.kernels import vllm_ops as vllm_cpu_kernels
from toolgym.agents.kernels.packed_linear import SMALL_BATCH_ROWS, PackedDecoderLayer, packing_available
from toolgym.agents.model.config import NAMED_CONFIGS, ModelConfig
from toolgym.agents.model.transformer import build_model

# Qwen2 (q/k/v bias), Qwen3 (q/k norms, no bias), and an intermediate size the kernel cannot take
# unpadded (80: padded to 96).
CONFIGS = {
    "test": ModelConfig.named("test"),
    "test-qwen3": ModelConfig.named("test-qwen3"),
    "padded": ModelConfig(**dict(NAMED_CONFIGS["test"], intermediate_size=80)),
}


@pytest.fixture(autouse=True)
def kernels():
    require_vllm_cpu_kernels()
    if not packing_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("bf16 linears need AVX-512 BF16")


def counted_small_batch_calls(monkeypatch) -> list[tuple[str, int]]:
    """Patch the layer's small-batch linear to record (kernel, rows) of each call."""
    calls: list[tuple[str, int]] = []
    for name in ("small_batch_linear",):
        kernel = getattr(packed_linear, name)
        monkeypatch.setattr(
            packed_linear,
            name,
            lambda x, *args, name=name, kernel=kernel, **kwargs: (
                calls.append((name, x.shape[0])) or kernel(x, *args, **kwargs)
            ),
        )
    return calls


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_small_batch_linear_is_the_matmul(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 64, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=generator).to(torch.bfloat16)
    b = torch.randn(48, generator=generator) if bias else None
    out = vllm_cpu_kernels.small_batch_linear(x, vllm_cpu_kernels.pack_small_batch_weight(weight), 48, b)
    expected = x.float() @ weight.float().T + (b if bias else 0)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 48)
    # float32 accumulation rounded once to bf16 (|values| <~ 30: an ulp is 0.125 at most).
    torch.testing.assert_close(out.float(), expected, atol=0.125, rtol=2**-8)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_layer_runs_small_batches_with_the_kernel(name: str, monkeypatch) -> None:
    # The layer in float32 is the reference; bf16 with oneDNN's linears and with the small-batch
    # ones land equally near it. Rows up to SMALL_BATCH_ROWS take the kernel, more do not.
    torch.manual_seed(0)
    model = make_model(CONFIGS[name])
    layer = model.model.layers[1]
    packed = PackedDecoderLayer(copy.deepcopy(layer).to(torch.bfloat16), batch_hint=8, kernels="vllm")
    assert packed.small_batch is not None
    assert packed.small_batch.padded == -(-CONFIGS[name].intermediate_size // 32) * 32
    onednn = copy.copy(packed)
    onednn.small_batch = None
    calls = counted_small_batch_calls(monkeypatch)
    for length in (1, 6, SMALL_BATCH_ROWS // 3 + 1):  # 3, 18 and 129 rows
        x, cos, sin = layer_inputs(model, rows=3, length=length)
        before = len(calls)
        with torch.no_grad():
            expected = layer(x, cos, sin)
            bf16_x, cos, sin = (t.to(torch.bfloat16) for t in (x, cos, sin))
            small, large = packed(bf16_x, cos, sin), onednn(bf16_x, cos, sin)
        assert torch.equal(bf16_x, x.to(torch.bfloat16))  # the input is not written to
        rows = 3 * length
        small_calls = [("small_batch_linear", rows)] * 4  # q/k/v, o_proj, gate/up, down
        assert calls[before:] == (small_calls if rows <= SMALL_BATCH_ROWS else [])
        small_error = (small.float() - expected).abs().max()
        large_error = (large.float() - expected).abs().max()
        assert small_error <= 2 * large_error + 0.02, (small_error, large_error)


def test_repack_refreshes_the_small_batch_copies() -> None:
    model = make_model("test")
    layer = copy.deepcopy(model.model.layers[0]).to(torch.bfloat16)
    packed = PackedDecoderLayer(layer, batch_hint=8, kernels="vllm")
    x, cos, sin = (t.to(torch.bfloat16) for t in layer_inputs(model, rows=2, length=1))
    with torch.no_grad():
        before = packed(x, cos, sin)
        for linear in (layer.mlp.down_proj, layer.self_attn.o_proj, layer.self_attn.v_proj):
            linear.weight.mul_(-2)
        stale = packed(x, cos, sin)
        packed.repack()
        after = packed(x, cos, sin)
        fresh = PackedDecoderLayer(layer, batch_hint=8, kernels="vllm")(x, cos, sin)
    assert torch.equal(stale, before)
    assert not torch.allclose(after, before, atol=0.1)
    assert torch.equal(after, fresh)


def test_float32_and_unfit_shapes_keep_onednns_linears() -> None:
    layer = make_model("test").model.layers[0]
    assert PackedDecoderLayer(copy.deepcopy(layer), batch_hint=8, kernels="vllm").small_batch is None
    bf16 = copy.deepcopy(layer).to(torch.bfloat16)
    assert PackedDecoderLayer(bf16, batch_hint=8, kernels="torch").small_batch is None
    # A hidden size that is not a multiple of 32 (the kernel's K): oneDNN's linears.
    unfit = build_model(ModelConfig(**dict(NAMED_CONFIGS["test"], hidden_size=80)), seed=0)
    layer = unfit.model.layers[0].to(torch.bfloat16)
    assert PackedDecoderLayer(layer, batch_hint=8, kernels="vllm").small_batch is None


def test_lm_head_repack_refreshes_its_packed_copy() -> None:
    # lm_head stays on oneDNN's packed linear in bf16 too (SGLang's copy was not worth keeping).
    model = make_model("test").to(torch.bfloat16)
    head = packed_linear.PackedLinear(model.lm_head, batch_hint=8, norm=model.model.norm)
    x = torch.randn(4, model.config.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        before = head(x)
        model.lm_head.weight.mul_(-1)  # tied: the embedding's weight
        assert torch.equal(head(x), before)
        head.repack()
        assert torch.equal(head(x), -before)
