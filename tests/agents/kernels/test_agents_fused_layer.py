"""FusedDecoderLayer (agents/kernels/fused_layer.py): the layer's results from fused GEMMs and kernels."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from agents_testlib import backend_for, layer_inputs, make_model

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.kernels.fused_layer import FusedDecoderLayer, fuse_model
from toolgym.agents.model.transformer import causal_lm_logprobs
from toolgym.agents.types import SamplingParams

torch.set_num_threads(1)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _perturbed(name: str):
    """Non-unit norm weights and non-zero biases, so a norm or bias the fused layer drops shows."""
    model = make_model(name)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _check_logprobs_before_and_after_load(engine, model, other, atol: float) -> None:
    """Samples (two prompts sharing a prefix, 3 samples each) carry the teacher-forced logprobs of
    `model`, then of `other` after load_weights, and the version they were sampled with."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 8]]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3, n=3)
    for version, weights in enumerate([model, other]):
        if version:
            engine.load_weights(weights.state_dict().items(), version=version)
        completions = asyncio.run(engine.generate(prompts, params))
        for i, completion in enumerate(completions):
            prompt = prompts[i // 3]
            with torch.no_grad():
                tokens = torch.tensor([prompt + completion.tokens])
                expected = causal_lm_logprobs(weights, tokens)[0, len(prompt) - 1 :]
            got = torch.tensor(completion.logprobs)
            assert torch.allclose(got, expected, atol=atol), (got - expected).abs().max()
            assert completion.policy_version == version


@pytest.mark.parametrize("name", ["test", "test-qwen3"])
def test_fused_decoder_layer_computes_the_layer(name: str) -> None:
    # Then again after every Parameter is overwritten in place, as load_weights does: the fused
    # GEMMs read the Parameters' own storage, so nothing needs repacking.
    model = _perturbed(name)
    x, cos, sin = layer_inputs(model)
    layer = model.model.layers[1]
    fused = FusedDecoderLayer(copy.deepcopy(layer), compiled=False)
    for _ in range(2):
        with torch.no_grad():
            for source, target in zip(layer.parameters(), fused.parameters(), strict=True):
                source.add_(torch.randn_like(source) * 0.1)
                target.copy_(source)
            expected, got = layer(x, cos, sin), fused(x, cos, sin)
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def test_fused_parameters_are_views_of_the_fused_weights() -> None:
    model = _perturbed("test")
    fused = copy.deepcopy(model)
    fuse_model(fused, compiled=False)
    assert list(fused.state_dict()) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key
    layer = fused.model.layers[0]
    attention = layer.self_attn
    with torch.no_grad():
        attention.k_proj.weight.fill_(3.0)
        layer.mlp.up_proj.weight.fill_(5.0)
    q_rows, k_rows = attention.q_proj.weight.shape[0], attention.k_proj.weight.shape[0]
    assert (layer.qkv_weight[q_rows : q_rows + k_rows] == 3.0).all()
    assert (layer.qkv_weight[:q_rows] != 3.0).any()
    assert (layer.gate_up_weight[layer.mlp.gate_proj.weight.shape[0] :] == 5.0).all()


@pytest.mark.parametrize("name", ["test", "test-qwen3"])
def test_engine_with_fused_layers_samples_the_models_distribution(name: str) -> None:
    # Eager on CPU: the prefill (shared prefix, kept-query last layer) and decode paths through
    # the fused layers give the model's teacher-forced logprobs, before and after load_weights.
    model = _perturbed(name)
    with TorchEngine(
        model, max_batch_size=8, max_seq_len=64, backend=backend_for(model, fused_layers=True)
    ) as engine:
        assert engine.fused and not engine.packed
        _check_logprobs_before_and_after_load(engine, model, make_model(name, seed=5), atol=1e-5)


def test_fused_and_packed_layers_are_exclusive() -> None:
    with pytest.raises(ValueError, match="choose one"):
        TorchEngine(
            make_model(),
            max_batch_size=2,
            max_seq_len=32,
            backend=backend_for(make_model(), fused_layers=True, pack_weights=True),
        )


@needs_cuda
@pytest.mark.parametrize("name", ["test", "test-qwen3"])
def test_compiled_fused_layers_on_cuda(name: str) -> None:
    # The CUDA default: compiled kernels inside the CUDA-graph decode, float32 so the check is tight.
    model = _perturbed(name)
    with TorchEngine(model, max_batch_size=8, max_seq_len=64, device="cuda") as engine:
        assert engine.fused and engine.cuda_graphs
        _check_logprobs_before_and_after_load(engine, model, make_model(name, seed=5), atol=1e-4)
