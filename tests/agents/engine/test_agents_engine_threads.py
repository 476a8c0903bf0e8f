"""Where the TorchEngine computes. On CPU (the default) it starts no thread: the thread that
drives it computes, an async caller's event loop runs the callers' own work between decode
steps, and every way in (async, sync, load_weights, from several threads, across event loops)
is served. With `worker_thread=True` its own thread computes (the CUDA default)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from agents_testlib import backend_for, make_model

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.checkpoint import hf_named_tensors
from toolgym.agents.model.transformer import causal_lm_logprobs
from toolgym.agents.types import SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return make_model()


def record_compute_threads(engine: TorchEngine) -> list[str]:
    """Names of the threads that run the engine's decode forwards, in order."""
    names: list[str] = []
    forward = engine._decoder.forward

    def recorded(*args):
        names.append(threading.current_thread().name)
        return forward(*args)

    engine._decoder.forward = recorded
    return names


def test_on_cpu_the_driving_thread_computes_and_no_thread_is_started(model) -> None:
    before = set(threading.enumerate())
    with TorchEngine(model, max_batch_size=4, max_seq_len=64) as engine:
        assert engine.worker_thread is False
        names = record_compute_threads(engine)
        (a,) = asyncio.run(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=6, seed=0)))
        (b,) = engine.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=6, seed=0))
        other = threading.Thread(
            target=lambda: engine.generate_sync([[4, 5]], SamplingParams(max_tokens=4, seed=0)),
            name="some-caller",
        )
        other.start()
        other.join()
        assert set(threading.enumerate()) == before
    assert a.tokens == b.tokens
    main = threading.current_thread().name
    assert names == [main] * 5 + [main] * 5 + ["some-caller"] * 3


def test_with_a_worker_thread_the_worker_computes(model) -> None:
    with TorchEngine(
        model, max_batch_size=4, max_seq_len=64, backend=backend_for(model, worker_thread=True)
    ) as engine:
        names = record_compute_threads(engine)
        engine.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=4, seed=0))
    assert names == ["TorchEngine"] * 3


def test_callers_run_between_decode_steps(model) -> None:
    # The env steps of other episodes must not wait for a long generation to end.
    with TorchEngine(model, max_batch_size=4, max_seq_len=128) as engine:
        seen: list[int] = []

        async def ticker(done: asyncio.Event):
            while not done.is_set():
                seen.append(engine.stats.decode_steps)
                await asyncio.sleep(0)

        async def scenario():
            done = asyncio.Event()
            tick = asyncio.ensure_future(ticker(done))
            out = await engine.generate([[1, 2, 3]], SamplingParams(max_tokens=60, seed=0))
            done.set()
            await tick
            return out

        (completion,) = asyncio.run(scenario())
    assert len(completion.tokens) == 60
    assert len(set(seen)) >= 50  # the ticker ran between (nearly) every pair of decode steps


def test_a_new_event_loop_is_served_after_the_last_one_closed_mid_generation(model) -> None:
    with TorchEngine(model, max_batch_size=1, max_seq_len=512) as engine:

        async def abandon():  # returns while its request runs: asyncio.run cancels it and the driver
            running = asyncio.ensure_future(engine.generate([[1, 2]], SamplingParams(max_tokens=500, seed=0)))
            while engine.stats.decode_steps < 3:
                await asyncio.sleep(0)
            return running

        asyncio.run(abandon())
        steps = engine.stats.decode_steps
        # One slot: the abandoned sample must be dropped for this one to run at all.
        (c,) = asyncio.run(asyncio.wait_for(engine.generate([[3]], SamplingParams(max_tokens=4, seed=0)), 30))
    assert len(c.tokens) == 4 and engine.stats.decode_steps - steps == 3


def test_a_loop_that_cancelled_the_driver_and_stays_open_is_served_again(model) -> None:
    loop = asyncio.new_event_loop()
    try:
        with TorchEngine(model, max_batch_size=1, max_seq_len=512) as engine:
            long = loop.create_task(engine.generate([[1, 2]], SamplingParams(max_tokens=500, seed=0)))
            while engine.stats.decode_steps < 3:
                loop.run_until_complete(asyncio.sleep(0))
            pending = asyncio.all_tasks(loop)  # the long request and the engine's driver
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            assert long.cancelled()
            short = engine.generate([[3]], SamplingParams(max_tokens=4, seed=0))
            (c,) = loop.run_until_complete(asyncio.wait_for(short, 30))
        assert len(c.tokens) == 4
    finally:
        loop.close()


def test_load_weights_called_on_the_driving_loop_finishes_running_samples_first(model) -> None:
    other = make_model(seed=2)
    prompt = [5, 6, 7, 8]
    with TorchEngine(model, max_batch_size=4, max_seq_len=256) as engine:

        async def scenario():
            running = asyncio.ensure_future(engine.generate([prompt], SamplingParams(max_tokens=120, seed=1)))
            while engine.stats.decode_steps < 3:
                await asyncio.sleep(0)
            engine.load_weights(hf_named_tensors(other), version=1)  # blocking, on the loop's thread
            assert running.done() or (await asyncio.wait_for(running, 5))  # finished inside the call
            return await running, await engine.generate([prompt], SamplingParams(max_tokens=5, seed=1))

        (old,), (new,) = asyncio.run(scenario())
    assert old.policy_version == 0 and len(old.tokens) == 120 and new.policy_version == 1
    with torch.no_grad():
        reference = causal_lm_logprobs(model, torch.tensor([prompt + old.tokens]))[0, len(prompt) - 1 :]
    assert (torch.tensor(old.logprobs) - reference).abs().max() <= 1e-5


def test_generate_sync_from_two_threads_at_once(model) -> None:
    prompts = {"a": [1, 2, 3, 4], "b": [9, 8, 7]}
    params = {"a": SamplingParams(max_tokens=40, seed=1), "b": SamplingParams(max_tokens=25, seed=2)}
    with TorchEngine(model, max_batch_size=4, max_seq_len=128) as engine:
        alone = {k: engine.generate_sync([prompts[k]], params[k])[0].tokens for k in prompts}
        together: dict[str, list[int]] = {}
        start = threading.Barrier(2)

        def call(k: str) -> None:
            start.wait()
            together[k] = engine.generate_sync([prompts[k]], params[k])[0].tokens

        threads = [threading.Thread(target=call, args=(k,)) for k in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert together == alone


def test_a_second_open_loop_is_served_while_the_first_one_is_paused_mid_generation(model) -> None:
    # The first loop stops (left open, not closed) while its driver still has a running request:
    # a call from another loop must not wait for the first loop to run again.
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        with TorchEngine(model, max_batch_size=2, max_seq_len=512) as engine:
            long = first.create_task(engine.generate([[1, 2]], SamplingParams(max_tokens=400, seed=0)))
            while engine.stats.decode_steps < 3:
                first.run_until_complete(asyncio.sleep(0))
            short = engine.generate([[3]], SamplingParams(max_tokens=4, seed=0))
            (c,) = second.run_until_complete(asyncio.wait_for(short, 30))
            assert len(c.tokens) == 4
            (rest,) = first.run_until_complete(asyncio.wait_for(long, 30))  # the first loop resumes
        assert len(rest.tokens) == 400
    finally:
        first.close()
        second.close()


def test_a_request_from_another_loop_does_not_wait_for_a_stopped_loops_flush(model) -> None:
    # Loop one queues a request and stops before its flush runs; loop two's own request must go.
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        with TorchEngine(model, max_batch_size=2, max_seq_len=64) as engine:
            queued = first.create_task(engine.generate([[1, 2]], SamplingParams(max_tokens=3, seed=0)))
            first.call_soon(first.stop)  # after the task has queued its request, before the flush
            first.run_forever()
            (c,) = second.run_until_complete(
                asyncio.wait_for(engine.generate([[3]], SamplingParams(max_tokens=4, seed=0)), 30)
            )
            assert len(c.tokens) == 4
            (a,) = first.run_until_complete(asyncio.wait_for(queued, 30))
        assert len(a.tokens) == 3
    finally:
        first.close()
        second.close()
