"""VLLMPolicy when vLLM rejects a request (only that request fails) and when its engine fails
(in-flight requests fail with the cause, the engine is shut down, later calls are refused, close()
still returns). Its own module and engine: test_agents_vllm.py's engine is closed before this one
starts (one in-process engine at a time)."""

from __future__ import annotations

import asyncio

import pytest
import torch.distributed as dist
from agents_testlib import require_vllm

from toolgym.agents.model.checkpoint import save_hf_checkpoint
from toolgym.agents.model.transformer import build_model
from toolgym.agents.types import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture
def policy(tmp_path):
    require_vllm()
    from toolgym.agents.vllm.policy import VLLMConfig, VLLMPolicy

    model = build_model("test", seed=0)
    save_hf_checkpoint(model, model.config, tmp_path)
    config = VLLMConfig(dtype="float32", max_model_len=128, kv_cache_gib=1 / 32, enforce_eager=True)
    policy = VLLMPolicy(tmp_path, config)
    yield policy
    policy.close()


def test_an_engine_failure_fails_requests_and_shuts_the_engine_down(policy):
    group_before = policy._keep_default_group  # a caller's group existed before the engine
    (ok,) = policy.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=4, seed=0))
    assert len(ok.tokens) == 4 and ok.text == ""  # no tokenizer.json in the directory: no text

    # A request vLLM rejects fails alone (its admitted samples are aborted); the engine keeps serving.
    add_request, calls = policy._engine.add_request, []

    def reject_second_sample(request_id, prompt, params, **kwargs):  # kwargs: lora_request
        calls.append(request_id)
        if len(calls) == 2:
            raise ValueError("injected rejection")
        return add_request(request_id, prompt, params, **kwargs)

    policy._engine.add_request = reject_second_sample

    async def two_calls():
        return await asyncio.gather(
            policy.generate([[1, 2, 3]], SamplingParams(max_tokens=4, n=2)),
            policy.generate([[4, 5]], SamplingParams(max_tokens=4, n=2)),
            return_exceptions=True,
        )

    rejected, served = asyncio.run(two_calls())
    assert isinstance(rejected, ValueError) and "injected rejection" in str(rejected)
    assert len(served) == 2 and all(len(c.tokens) == 4 for c in served)
    del policy._engine.add_request
    assert len(policy.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=4, n=3))) == 3

    def failing_step():
        raise RuntimeError("injected engine failure")

    policy._engine.step = failing_step
    with pytest.raises(RuntimeError, match="injected engine failure"):
        policy.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=4, n=2))
    policy._driver.join(timeout=60)
    assert not policy._driver.is_alive()
    if not group_before:  # vLLM's shutdown ran: it took down the process group it had made
        assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="engine failed"):
        policy.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="engine failed"):
        policy.load_weights([], version=1)
    policy.close()


def test_what_vllm_cannot_serve_is_refused_before_an_engine_starts(tmp_path):
    """A gpt-oss checkpoint without YaRN (vLLM's gpt-oss runs YaRN only) and LoRA on experts:
    each refused in one line at construction."""
    require_vllm()
    from toolgym.agents.model.lora import LoraConfig
    from toolgym.agents.vllm.policy import VLLMConfig, VLLMPolicy

    config = VLLMConfig(dtype="float32", max_model_len=128, kv_cache_gib=1 / 32, enforce_eager=True)
    model = build_model("test-gpt-oss", seed=0)
    save_hf_checkpoint(model, model.config, tmp_path / "gpt-oss")
    with pytest.raises(ValueError, match=r"vLLM's gpt-oss runs YaRN RoPE only") as info:
        VLLMPolicy(tmp_path / "gpt-oss", config)
    assert "\n" not in str(info.value)
    model = build_model("test-qwen3-moe", seed=0)
    save_hf_checkpoint(model, model.config, tmp_path / "moe")
    experts = LoraConfig(rank=2, target_modules=["q_proj", "experts"])
    with pytest.raises(ValueError, match=r"must leave out 'experts' with backend 'vllm'"):
        VLLMPolicy(tmp_path / "moe", config, lora=experts)
