"""The engine's bookkeeping pieces on their own: running-sample slots and prefill chunking."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from toolgym.agents.engine.sampling import uniform_draws
from toolgym.agents.engine.slots import Request, Sample, Slots
from toolgym.agents.model.chunks import padded_chunks
from toolgym.agents.types import SamplingParams


def make_request(prompt_len: int, limit: int, stop: int = 99, seed: int = 7, **params) -> Request:
    return Request(
        prompt=list(range(prompt_len)),
        params=SamplingParams(max_tokens=limit, stop_token_ids=[stop], **params),
        seed=seed,
        future=concurrent.futures.Future(),
        stop_ids=frozenset([stop]),
        limit=limit,
    )


def test_slots_record_tokens_and_say_which_samples_are_done() -> None:
    slots = Slots(4)
    short, long = make_request(5, limit=2), make_request(9, limit=10, temperature=0.5, top_k=3)
    for request, index in ((short, 0), (long, 0), (long, 1)):
        slots.add(Sample(request, index, version=3), len(request.prompt))
    assert len(slots) == 3 and slots.free == 1
    assert list(slots.pos[:3]) == [5, 9, 9] and list(slots.sample_index[:3]) == [0, 0, 1]
    assert list(slots.temperature[:3]) == [1.0, 0.5, 0.5] and list(slots.top_k[:3]) == [0, 3, 3]

    assert slots.record(0, 3, [10, 11, 99], [-0.1, -0.2, -0.3]) == [(2, "stop")]
    assert slots.record(0, 2, [12, 13], [-0.4, -0.5]) == [(0, "length")]  # short's limit is 2
    assert slots.running[0].tokens == [10, 12] and slots.running[0].logprobs == [-0.1, -0.4]
    assert list(slots.next[:3]) == [12, 13, 99] and list(slots.step[:3]) == [2, 2, 1]


def test_removing_slots_moves_the_last_running_samples_into_the_holes() -> None:
    slots = Slots(5)
    requests = [make_request(3 + i, limit=8, seed=i) for i in range(5)]
    for request in requests:
        slots.add(Sample(request, 0, version=0), len(request.prompt))
    moves = []
    slots.remove([1, 3], lambda source, target, length: moves.append((source, target, length)))
    # Hole 3 takes the last (slot 4), then hole 1 takes the new last (that sample, now in slot 3),
    # its k/v included: positions 0..6 of a 7-token prompt.
    assert moves == [(4, 3, 7), (3, 1, 7)]
    assert [s.request for s in slots.running] == [requests[0], requests[4], requests[2]]
    assert list(slots.pos[:3]) == [3, 7, 5] and list(slots.seed[:3]) == [0, 4, 2]
    slots.remove([2], lambda *move: moves.append(move))  # the last one: nothing to move
    assert len(moves) == 2 and len(slots) == 2


def test_sampling_inputs_carry_each_slots_parameters_and_flags() -> None:
    slots = Slots(3)
    slots.add(Sample(make_request(4, limit=4, temperature=0.0), 0, version=0), 4)
    slots.add(Sample(make_request(4, limit=4, top_p=0.9), 0, version=0), 4)
    inputs = slots.sampling_inputs(0, 2, device="cpu")
    assert inputs["temperature"].tolist() == [0.0, 1.0] and inputs["top_p"].tolist()[1] == pytest.approx(0.9)
    assert inputs["any_greedy"] and not inputs["all_greedy"] and inputs["any_filter"]
    assert not inputs["any_scaled"]  # temperatures 0 and 1 need no division
    assert ((inputs["u"] > 0) & (inputs["u"] < 1)).all()
    slots.add(Sample(make_request(4, limit=4, temperature=0.7), 0, version=0), 4)
    assert slots.sampling_inputs(0, 3, device="cpu")["any_scaled"]


def test_draws_and_flags_follow_the_running_samples() -> None:
    slots = Slots(3)
    requests = [make_request(4, limit=4, seed=s, temperature=t) for s, t in ((5, 1.0), (6, 0.5), (7, 1.0))]
    for request in requests:
        slots.add(Sample(request, 2, version=0), 4)
    slots.record(0, 3, [1, 2, 3], [0.0, 0.0, 0.0])
    arrays = slots.sampling_arrays(0, 3)
    expected = uniform_draws(np.array([5, 6, 7], np.uint64), np.full(3, 2, np.uint64), np.ones(3, np.uint64))
    assert arrays["u"].tolist() == expected.tolist() and arrays["any_scaled"]
    assert slots.sampling_arrays(0, 2)["any_scaled"]  # flags are kept per range until slots change
    slots.remove([1], lambda *move: None)  # the only scaled temperature leaves
    arrays = slots.sampling_arrays(0, 2)
    assert not arrays["any_scaled"] and arrays["u"].tolist() == [expected[0], expected[2]]


def test_padded_chunks_sort_by_width_and_keep_each_chunk_within_the_budget() -> None:
    widths = [5, 1, 9, 3, 3, 20]
    chunks = padded_chunks(widths, lambda w: w, max_tokens=12)
    assert chunks == [[1, 3, 3], [5], [9], [20]]  # 3 rows x 3 wide; 5 x 2 rows > 12; 20 alone
    for chunk in chunks:
        assert len(chunk) == 1 or max(chunk) * len(chunk) <= 12
    assert padded_chunks([], len, max_tokens=8) == []
    assert padded_chunks([2, 2, 2, 2], lambda w: w, max_tokens=100) == [[2, 2, 2, 2]]


def test_padded_chunks_longest_first_keeps_equal_widths_in_their_order() -> None:
    lengths = [3, 50, 7, 7, 20, 1, 120, 8]
    chunks = padded_chunks(range(len(lengths)), lengths.__getitem__, 40, longest_first=True)
    # 120 and 50 alone; 20 with 8 (2 x 20 = 40); then 7, 7 (indices 2, 3 in order), 3 and 1.
    assert chunks == [[6], [1], [4, 7], [2, 3, 0, 5]]
