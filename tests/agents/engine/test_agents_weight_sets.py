"""One engine serving several weight sets (agents/weight_sets.py): each request sampled by its
own set's weights and tagged with its version, whatever it was batched beside; swaps per phase,
not per request; the live set's syncs kept and restored."""

import asyncio

import pytest
import torch

from tests.agents.agents_testlib import make_model
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.types import SamplingParams
from toolgym.agents.weight_sets import LIVE, WeightSets

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPTS = [[3, 9, 4], [17, 2], [5, 5, 8, 1], [11]]


def greedy(model, prompts):
    with TorchEngine(model, max_batch_size=4, max_seq_len=32) as engine:
        return [c.tokens for c in engine.generate_sync(prompts, GREEDY)]


@pytest.fixture(scope="module")
def models():
    return make_model(seed=0), make_model(seed=1), make_model(seed=2)


def test_each_request_is_sampled_by_its_own_set(models):
    live, snap, other = models
    expected = {name: greedy(m, PROMPTS) for name, m in (("live", live), ("snap", snap), ("other", other))}
    assert expected["live"] != expected["snap"] != expected["other"]  # the sets differ where it shows
    with TorchEngine(make_model(seed=0), max_batch_size=4, max_seq_len=32) as engine:
        sets = WeightSets(engine, live.state_dict(), version=3)
        views = {"live": sets.live, "snap": sets.add("snap", snap.state_dict().items(), 7)}
        views["other"] = sets.add("other", other.state_dict().items(), 9)

        async def play():  # every set's requests at once, interleaved, one prompt a call
            calls = [(name, i) for i in range(len(PROMPTS)) for name in ("snap", "live", "other")]
            outs = await asyncio.gather(*(views[n].generate([PROMPTS[i]], GREEDY) for n, i in calls))
            return calls, outs

        calls, outs = asyncio.run(play())
        versions = {"live": 3, "snap": 7, "other": 9}
        for (name, i), (completion,) in zip(calls, outs, strict=True):
            assert completion.tokens == expected[name][i], (name, i)
            assert completion.policy_version == versions[name]
        # a phase per set, each serving all its waiting requests together: not a swap per request
        assert sets.swaps <= 4
        sets.restore_live()
        assert sets.loaded == LIVE
        assert [c.tokens for c in engine.generate_sync(PROMPTS, GREEDY)] == expected["live"]


def test_a_sync_of_the_live_set_is_kept_and_swapped_back_in(models):
    live, snap, other = models
    with TorchEngine(make_model(seed=0), max_batch_size=4, max_seq_len=32) as engine:
        sets = WeightSets(engine, live.state_dict(), version=0)
        view = sets.add("snap", snap.state_dict().items(), 1)
        asyncio.run(view.generate(PROMPTS, GREEDY))
        assert sets.loaded == "snap"
        sets.live.load_weights(other.state_dict().items(), 5)  # the trainer's sync: live is swapped back
        assert sets.loaded == LIVE and sets.live.policy_version == 5 == engine.policy_version
        assert [c.tokens for c in engine.generate_sync(PROMPTS, GREEDY)] == greedy(other, PROMPTS)
        # a partial sync (LoRA's adapters after the whole model) updates the kept set in place
        name, tensor = next(iter(live.state_dict().items()))
        sets.live.load_weights([(name, tensor)], 6)
        assert torch.equal(sets.tensors(LIVE)[name], tensor)
        assert torch.equal(sets.tensors(LIVE)["lm_head.weight"], other.state_dict()["lm_head.weight"])


def test_sets_are_checked(models):
    live, snap, _ = models
    with TorchEngine(make_model(seed=0), max_batch_size=4, max_seq_len=32) as engine:
        sets = WeightSets(engine, live.state_dict(), version=0)
        view = sets.add("snap", snap.state_dict().items(), 1)
        with pytest.raises(ValueError, match="exists already"):
            sets.add("snap", snap.state_dict().items(), 1)
        with pytest.raises(TypeError, match="fixed snapshot"):
            view.load_weights(live.state_dict().items(), 2)
        with pytest.raises(KeyError, match="no weight set 'gone'"):
            sets.view("gone")
        asyncio.run(view.generate(PROMPTS[:1], GREEDY))
        with pytest.raises(RuntimeError, match="in use"):
            sets.remove("snap")  # loaded
        sets.restore_live()
        sets.remove("snap")
        assert sets.names() == []
