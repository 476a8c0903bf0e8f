"""EngineReplicas: real worker processes, each a TorchEngine. Seeded samples are one engine's, in
prompt-major order; the work is dealt to every replica; weights reach every replica; prompt errors
are raised before dispatch; a dead replica fails its requests with a clear error; close ends the
workers."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
from agents_testlib import make_model

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.engine.replicas import EngineReplicas
from toolgym.agents.errors import ContextOverflowError
from toolgym.agents.model.transformer import causal_lm_logprobs
from toolgym.agents.types import SamplingParams

pytestmark = pytest.mark.slow  # each test spawns worker processes (~2 s each)


@pytest.fixture(scope="module")
def model():
    return make_model()


def prompts_of(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def test_seeded_samples_are_one_engines_in_prompt_major_order(model) -> None:
    prompts = prompts_of([5, 9, 3, 7, 4])
    params = SamplingParams(max_tokens=12, n=3, seed=11, temperature=1.0)
    with TorchEngine(model, max_batch_size=16, max_seq_len=64) as engine:
        expected = engine.generate_sync(prompts, params)
    with EngineReplicas(model, replicas=2, max_batch_size=9, max_seq_len=64) as replicas:
        got = replicas.generate_sync(prompts, params)
        assert asyncio.run(replicas.generate(prompts, params)) == got
        stats = replicas.stats
    assert [c.tokens for c in got] == [c.tokens for c in expected]
    for a, b in zip(got, expected, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5
    # Both replicas worked: 5 prompts dealt 3 + 2 (by samples in flight), twice.
    assert stats.requests == 10 and stats.generated_tokens == 2 * 5 * 3 * 12


def test_concurrent_callers_and_weight_loads_reach_every_replica(model) -> None:
    prompts = prompts_of([6, 6, 6, 6], seed=1)
    params = SamplingParams(max_tokens=8, n=2, seed=5)
    new = make_model(seed=1)
    with EngineReplicas(model, replicas=2, max_batch_size=8, max_seq_len=64) as replicas:

        async def together():
            return await asyncio.gather(*(replicas.generate([p], params) for p in prompts))

        before = asyncio.run(together())
        assert replicas.stats.requests == 4
        replicas.load_weights(new.named_parameters(), version=7)
        after = replicas.generate_sync(prompts, params)
        with pytest.raises(ValueError, match="has shape"):
            replicas.load_weights([("lm_head.weight", torch.zeros(3, 3))], version=8)
        with pytest.raises(KeyError, match="unknown parameter"):
            replicas.load_weights([("nope", torch.zeros(3))], version=8)
        assert replicas.policy_version == 7
    assert all(c.policy_version == 0 for group in before for c in group)
    assert all(c.policy_version == 7 for c in after)
    # The new weights sampled every completion, on both replicas: teacher-forced logprobs match.
    for i, c in enumerate(after):
        prompt = prompts[i // 2]
        with torch.no_grad():
            forced = causal_lm_logprobs(new, torch.tensor([prompt + c.tokens]))[0, len(prompt) - 1 :]
        assert (torch.tensor(c.logprobs) - forced).abs().max() <= 1e-5


def test_bad_prompts_fail_here_and_a_dead_replica_fails_its_requests(model) -> None:
    replicas = EngineReplicas(model, replicas=2, max_batch_size=4, max_seq_len=32)
    try:
        with pytest.raises(ContextOverflowError):
            replicas.generate_sync([[1] * 40], SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="outside"):
            replicas.generate_sync([[1, 999]], SamplingParams(max_tokens=4))
        os.kill(replicas._processes[1].pid, signal.SIGKILL)
        replicas._processes[1].join(10)
        with pytest.raises(RuntimeError, match="engine replica 1 exited"):
            # Two prompts: one goes to the dead replica.
            replicas.generate_sync([[1, 2], [3, 4]], SamplingParams(max_tokens=4, seed=0))
    finally:
        replicas.close()
    assert not any(p.is_alive() for p in replicas._processes)
    with pytest.raises(RuntimeError, match="closed"):
        replicas.generate_sync([[1, 2]], SamplingParams(max_tokens=2))


def test_a_replica_that_dies_as_a_request_is_sent_fails_it_with_the_same_error(model) -> None:
    # It passed the liveness check and its pipe broke on the send (a race CI met once): the caller
    # gets the "exited" error, not a BrokenPipeError, and nothing stays in flight.
    replicas = EngineReplicas(model, replicas=2, max_batch_size=4, max_seq_len=32)
    try:
        connection = replicas._connections[1]
        send = connection.send

        def broken_pipe(message) -> None:
            raise BrokenPipeError(32, "Broken pipe")

        connection.send = broken_pipe
        with pytest.raises(RuntimeError, match="engine replica 1 exited"):
            replicas.generate_sync([[1, 2], [3, 4]], SamplingParams(max_tokens=4, seed=0))
        assert replicas._pending[1] == {} and replicas._in_flight[1] == 0
        connection.send = send
        (completion,) = replicas.generate_sync([[1, 2]], SamplingParams(max_tokens=3, seed=0))
        assert len(completion.tokens) == 3
    finally:
        replicas.close()


def test_a_replica_that_cannot_start_says_why(model) -> None:
    with pytest.raises(RuntimeError, match="failed to start: ValueError: max_batch_size"):
        EngineReplicas(model, replicas=2, max_batch_size=0)
