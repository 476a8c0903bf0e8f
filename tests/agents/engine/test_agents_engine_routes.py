"""Routing replay: the torch engine records a mixture of experts' chosen experts per position
(agents/engine/routes.py), Episodes carry them (rollouts/episodes.py), and the trainer's forward
replays them (TrainerConfig.replay_routes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.moe import moe_blocks
from toolgym.agents.model.transformer import build_model
from toolgym.agents.types import Completion, Routes, SamplingParams
from toolgym.rollouts.episodes import trajectory_to_episode
from toolgym.rollouts.types import Episode, StopReason, Trajectory, Transition
from toolgym.trainers.config import TrainerConfig
from toolgym.trainers.trainer import Trainer


def _own_routes(model, tokens: list[int]) -> np.ndarray:
    """[positions, MoE layers, top_k] that one plain forward of `tokens` routes."""
    blocks = moe_blocks(model)
    for block in blocks:
        block.keep_routes = True
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
        return np.stack([block.routes.numpy() for block in blocks], axis=1)  # type: ignore[union-attr]
    finally:
        for block in blocks:
            block.keep_routes, block.routes = False, None


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(0, 256, (12,), generator=g).tolist()  # a prefix the prefill shares
    return [common + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 7, 5)]


@pytest.mark.parametrize("name", ["test-qwen3-moe", "test-gpt-oss"])
def test_the_engine_records_the_experts_a_full_forward_chooses(name):
    model = build_model(name, seed=0)
    last_is_moe = model.model.layers[-1].mlp in moe_blocks(model)
    engine = TorchEngine(model, max_batch_size=8, max_seq_len=128, record_routes=True, seed=0)
    prompts = _prompts(1)
    first = engine.generate_sync(prompts, SamplingParams(max_tokens=10, n=2, seed=3))
    # The next turn of the first conversation continues its kept history.
    follow = prompts[0] + first[0].tokens + [5, 6, 7]
    second = engine.generate_sync([follow], SamplingParams(max_tokens=6, seed=4))
    assert engine.stats.shared_prefix_tokens > 0 and engine.stats.history_tokens > 0
    runs = [(prompts[i // 2], c) for i, c in enumerate(first)] + [(follow, second[0])]
    for prompt, completion in runs:
        sequence = prompt + completion.tokens
        assert completion.routes is not None
        recorded = completion.routes.array()
        assert recorded.shape[0] == len(sequence) - 1  # every position the model ran
        expected = _own_routes(model, sequence[:-1])
        known = (recorded >= 0).all(-1)
        assert np.array_equal(np.sort(recorded, -1)[known], np.sort(expected, -1)[known])
        # Only a last MoE layer's prompt positions before the last may be unrecorded (its MLP ran
        # there for no one but a kept prefix's end); the sampled tokens' positions have every layer.
        unknown = np.argwhere(~known)
        assert bool(len(unknown)) == last_is_moe
        assert all(
            layer == recorded.shape[1] - 1 and position < len(prompt) - 1 for position, layer in unknown
        )


def test_a_reused_slot_keeps_no_routes_of_the_sequence_before():
    model = build_model("test-gpt-oss", seed=0)
    engine = TorchEngine(model, max_batch_size=1, max_seq_len=64, record_routes=True, share_prefixes=False)
    for length in (20, 9):  # the second prompt is shorter: the slot held routes past its end
        prompt = list(range(3, 3 + length))
        (completion,) = engine.generate_sync([prompt], SamplingParams(max_tokens=4, seed=0))
        assert completion.routes is not None
        last_layer = completion.routes.array()[:, -1]
        assert (last_layer[: length - 1] < 0).all() and (last_layer[length - 1 :] >= 0).all()


def test_recording_routes_needs_experts_and_costs_nothing_when_off():
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        TorchEngine(build_model("test", seed=0), max_batch_size=1, max_seq_len=32, record_routes=True)
    engine = TorchEngine(build_model("test-qwen3-moe", seed=0), max_batch_size=1, max_seq_len=32)
    assert engine.cache.routes is None
    (completion,) = engine.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert completion.routes is None


def test_routes_refuse_a_torn_buffer():
    with pytest.raises(ValueError, match="no whole number of positions"):
        Routes(experts=b"\x00" * 6, layers=2, top_k=2)
    with pytest.raises(ValueError, match="routes for 4 positions"):
        Episode(tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], sampler_logprobs=[0.0] * 4, advantages=[0.0] * 4,
                routes=Routes(experts=b"\x00" * 16, layers=1, top_k=2))  # fmt: skip


def test_episodes_take_the_routes_of_their_last_kept_turn():
    routes = [Routes.of(np.full((n, 1, 2), n)) for n in (4, 8)]
    transitions = [
        Transition("a", [1, 2, 3], Completion([4, 5], [-1.0, -1.0], "stop", routes=routes[0])),
        Transition("b", [6, 7, 8], Completion([9], [-1.0], "stop", routes=routes[1])),
    ]
    trajectory = Trajectory("env", {}, 0, 0, transitions, StopReason.ANSWERED)
    episode = trajectory_to_episode(trajectory, 1.0)
    assert episode is not None and episode.routes == routes[1]  # covers tokens 0..7 of 9
    cut = trajectory_to_episode(trajectory, 1.0, max_seq_len=6)  # keeps the first turn only
    assert cut is not None and len(cut.tokens) == 5 and cut.routes == routes[0]
    transitions[1] = Transition("b", [6, 7, 8], Completion([9], [-1.0], "stop", routes=routes[0]))
    torn = trajectory_to_episode(Trajectory("env", {}, 0, 0, transitions, StopReason.ANSWERED), 1.0)
    assert torn is not None and torn.routes is None  # a turn's routes that do not cover it: none


def _engine_episodes(model, engine: TorchEngine) -> list[Episode]:
    prompts = _prompts(2)
    completions = engine.generate_sync(prompts, SamplingParams(max_tokens=12, n=2, seed=5))
    episodes = []
    for i, completion in enumerate(completions):
        prompt = prompts[i // 2]
        episodes.append(
            Episode(
                tokens=prompt + completion.tokens,
                loss_mask=[0] * len(prompt) + [1] * len(completion.tokens),
                sampler_logprobs=[0.0] * len(prompt) + completion.logprobs,
                advantages=[0.0] * len(prompt) + [1.0 if i % 2 else -1.0] * len(completion.tokens),
                routes=completion.routes,
            )
        )
    return episodes


@pytest.mark.parametrize("name", ["test-qwen3-moe", "test-gpt-oss"])
def test_the_trainer_replays_the_samplers_routes(name):
    model = build_model(name, seed=0)
    engine = TorchEngine(model, max_batch_size=8, max_seq_len=128, record_routes=True, seed=0)
    episodes = _engine_episodes(model, engine)
    trainer = Trainer(model, TrainerConfig(replay_routes=True, micro_batch_tokens=256))
    sampler = [np.array(e.sampler_logprobs) for e in episodes]
    replayed = trainer.compute_logprobs(episodes, temperature=1.0)
    for got, want, e in zip(replayed, sampler, episodes, strict=True):
        mask = np.array(e.loss_mask, bool)
        np.testing.assert_allclose(np.array(got)[mask], want[mask], atol=2e-5)
    # Other experts than the sampler's at every recorded position: other logprobs.
    swapped = []
    for e in episodes:
        assert e.routes is not None
        experts = e.routes.array().copy()
        moved = np.where(experts >= 0, (experts + 1) % moe_blocks(model)[0].num_experts, experts)
        routes = Routes.of(moved)
        swapped.append(Episode(e.tokens, e.loss_mask, e.sampler_logprobs, e.advantages, routes=routes))
    changed = trainer.compute_logprobs(swapped, temperature=1.0)
    assert (
        max(abs(a - b) for x, y in zip(changed, replayed, strict=True) for a, b in zip(x, y, strict=True))
        > 1e-3
    )
    # A training step replays every trained position and trains the routers through the weights.
    routers = {
        n: p
        for n, p in trainer.model.named_parameters()
        if n.endswith(("mlp.gate.weight", "mlp.router.weight"))
    }
    before = {n: p.detach().clone() for n, p in routers.items()}
    metrics = trainer.train_step(episodes)
    assert metrics["replayed_routes"] == 1.0
    assert routers and all(not torch.equal(p.detach(), before[n]) for n, p in routers.items())
    assert all(block.replay is None for block in moe_blocks(trainer.model))


def test_replay_with_the_models_own_routes_changes_nothing_and_trains_the_router():
    model = build_model("test-qwen3-moe", seed=0)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    blocks = moe_blocks(model)
    own = _own_routes(model, tokens[0].tolist())  # one row, then both rows below
    for block in blocks:
        block.keep_routes = True
    plain = model(tokens)
    routes = [block.routes for block in blocks]
    plain.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for block, chosen in zip(blocks, routes, strict=True):
        assert chosen is not None
        partial = chosen.clone()
        partial[::2] = -1  # every other row routes itself
        block.replay = partial
    replayed = model(tokens)
    replayed.sum().backward()
    torch.testing.assert_close(replayed, plain, rtol=0, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-6, atol=1e-7)
    assert own.shape == (9, len(blocks), blocks[0].top_k)
    blocks[0].replay = torch.zeros((3, blocks[0].top_k), dtype=torch.long)
    with pytest.raises(ValueError, match="replayed routes"):
        model(tokens)


def test_replay_needs_a_mixture_of_experts():
    with pytest.raises(ValueError, match="replay_routes needs a mixture-of-experts model"):
        Trainer(build_model("test", seed=0), TrainerConfig(replay_routes=True))
