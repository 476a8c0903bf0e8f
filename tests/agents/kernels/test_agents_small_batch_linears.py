"""SGLang's small-batch linears in the packed layer (agents/kernels/packed_linear.py `SmallBatchLinears`,
bf16/fp16 with `kernels="vllm"`): the kernels compute the matmul and the SwiGLU MLP, the layer's
decode-sized batches take them (and larger ones oneDNN's), its padded intermediate size changes
nothing, and a repack refreshes its copies."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
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
    """Patch the layer's small-batch linear and MLP to record (kernel, rows) of each call."""
    calls: list[tuple[str, int]] = []
    for name in ("small_batch_linear", "fused_mlp"):
        kernel = getattr(packed_linear, name)
        monkeypatch.setattr(
            packed_linear,
            name,
            lambda x, *args, name=name, kernel=kernel: calls.append((name, x.shape[0])) or kernel(x, *args),
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


def test_fused_mlp_is_the_swiglu_mlp() -> None:
    dtype = torch.bfloat16
    # Intermediate 80 padded to 96 with zero gate/up rows and zero down columns, as the layer packs it.
    generator = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(80, 64, generator=generator) / 8 for _ in range(2))
    down = torch.randn(64, 80, generator=generator) / 8
    pad = F.pad
    gate_up = vllm_cpu_kernels.pack_small_batch_weight(
        torch.cat([pad(w, (0, 0, 0, 16)) for w in (gate, up)]).to(dtype)
    )
    packed_down = vllm_cpu_kernels.pack_small_batch_weight(pad(down, (0, 16)).to(dtype))
    x = torch.randn(64, 64, generator=generator).to(dtype)
    out = vllm_cpu_kernels.fused_mlp(x, gate_up, packed_down)
    reference = [w.to(dtype).double() for w in (gate, up, down)]
    expected = (F.silu(x.double() @ reference[0].T) * (x.double() @ reference[1].T)) @ reference[2].T
    assert out.dtype == dtype and out.shape == (64, 64)
    # The intermediate and the output each rounded once to dtype (|output| <~ 2).
    torch.testing.assert_close(out.double(), expected, atol=0.02, rtol=0.01)
    # A row's result does not depend on the batch, and reused routing and output change nothing.
    for rows in (1, 5):
        routing = vllm_cpu_kernels.single_expert_routing(rows)
        written = torch.empty(rows, 64, dtype=dtype)
        alone = vllm_cpu_kernels.fused_mlp(x[:rows], gate_up, packed_down, routing, out=written)
        assert alone.data_ptr() == written.data_ptr() and torch.equal(alone, out[:rows])
    # The kernel has no fp16 and aborts the process on it: refused before the call.
    with pytest.raises(ValueError, match="bf16"):
        vllm_cpu_kernels.fused_mlp(x.half(), gate_up, packed_down)


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
        small_calls = [("small_batch_linear", rows)] * 2 + [("fused_mlp", rows)]  # q/k/v, o_proj; the MLP
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


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_with_the_kernels_is_the_norm_weighted_matmul(tied: bool) -> None:
    # lm_head with the final norm's weight folded in: SGLang's copy at every row count (a decode
    # step's rows, a prefill's prompts, past SMALL_BATCH_ROWS too); oneDNN's without the kernels.
    config = ModelConfig(**dict(NAMED_CONFIGS["test"], tie_word_embeddings=tied))
    model = make_model(config).to(torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    lm_head, norm = model.lm_head, model.model.norm
    small = packed_linear.PackedLinear(lm_head, batch_hint=8, norm=norm, kernels="vllm")
    onednn = packed_linear.PackedLinear(lm_head, batch_hint=8, norm=norm, kernels="torch")
    assert small.small_batch and not onednn.small_batch
    generator = torch.Generator().manual_seed(0)
    folded = (lm_head.weight * norm.weight).float()
    for rows in (1, 64, SMALL_BATCH_ROWS + 72):
        x = torch.randn(rows, config.hidden_size, generator=generator).to(torch.bfloat16)
        with torch.no_grad():
            out, reference = small(x), onednn(x)
        assert out.shape == (rows, config.vocab_size) and out.dtype == torch.bfloat16
        expected = x.float() @ folded.T
        # float32 accumulation rounded once, as oneDNN's (|logits| <~ 16: half an ulp is 1/32).
        torch.testing.assert_close(out.float(), expected, atol=0.07, rtol=2**-8)
        assert (out.float() - reference.float()).abs().max() <= 0.07
    assert small(x[None]).shape == (1, rows, config.vocab_size)  # leading dims kept


def test_lm_head_repack_refreshes_the_small_batch_copy() -> None:
    model = make_model("test").to(torch.bfloat16)
    head = packed_linear.PackedLinear(model.lm_head, batch_hint=8, norm=model.model.norm, kernels="vllm")
    x = torch.randn(4, model.config.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        before = head(x)
        model.lm_head.weight.mul_(-1)  # tied: the embedding's weight
        assert torch.equal(head(x), before)
        head.repack()
        assert torch.equal(head(x), -before)
