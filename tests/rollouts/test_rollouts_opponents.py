"""Opponent pools and ratings (rollouts/episode/opponents.py) and the match runner drawing each
match's opponent from one, its snapshots served by the learner's own policy (agents/weight_sets.py)."""

import asyncio
import random
import re

import pytest
import torch

from toolgym.agents.types import Completion, SamplingParams
from toolgym.agents.weight_sets import LIVE, WeightSets
from toolgym.rollouts.batches import BatchConfig, TaskSeedStream, collect_batch
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.match import MatchRunner, SelfPlayConfig
from toolgym.rollouts.episode.opponents import OpponentPool, PoolError, elo_expected
from toolgym.rollouts.episode.runner import RolloutRunner


class MovePolicy:
    """A policy whose one weight is the number of stones it takes: Nim moves from weight sets."""

    max_seq_len = None

    def __init__(self, renderer, move: int):
        self.renderer, self.move, self.policy_version = renderer, move, 0

    async def generate(self, prompts, params: SamplingParams):
        tokens = [*self.renderer.encode(str(self.move)), self.renderer.im_end_id]
        text = str(self.move)
        return [
            Completion(tokens=tokens, logprobs=[0.0] * len(tokens), text=text, finish_reason="stop")
        ] * len(prompts)

    def load_weights(self, named_tensors, version):
        ((name, tensor),) = list(named_tensors)
        assert name == "move"
        self.move, self.policy_version = int(tensor), version

    def close(self):
        pass


def weights(move: int) -> dict:
    return {"move": torch.tensor(move)}


def test_elo_moves_the_two_ratings_by_the_surprise_and_keeps_their_sum():
    pool = OpponentPool(["random", "expert"], size=0, elo_k=32)
    pool.record("expert", 1.0)  # an upset between equals: 16 points each way
    assert pool.learner_rating == pytest.approx(1016) and pool.members["expert"].rating == pytest.approx(984)
    expected = elo_expected(1016, 984)
    pool.record("expert", 0.0)
    assert pool.learner_rating == pytest.approx(1016 - 32 * expected)
    assert pool.learner_rating + pool.members["expert"].rating == pytest.approx(2000)
    assert elo_expected(1000, 1400) == pytest.approx(1 / 11) == pytest.approx(1 - elo_expected(1400, 1000))
    metrics = pool.metrics()
    assert metrics["selfplay/games/expert"] == 2 and metrics["selfplay/learner_score"] == 0.5
    assert metrics["selfplay/elo/random"] == 1000 and "selfplay/games/expert" not in pool.metrics()


def test_sampling_uniform_latest_and_prioritised(renderer):
    sets = WeightSets(MovePolicy(renderer, 1), weights(1), 0)
    pool = OpponentPool(["random", "expert"], weights=sets, every=5, size=2, sampling="latest")
    rng = random.Random(0)
    assert pool.sample(rng) in ("random", "expert")  # no snapshot yet: any member
    assert pool.due(0) and not pool.due(3)
    pool.add_snapshot(0)
    assert not pool.due(0)  # taken already
    sets.load_live(weights(2).items(), 5)
    pool.add_snapshot(5)
    assert pool.sample(rng) == "step_5"
    pool.sampling = "uniform"
    drawn = [pool.sample(rng) for _ in range(4000)]
    assert {name: drawn.count(name) / 4000 for name in pool.members} == pytest.approx(
        dict.fromkeys(pool.members, 0.25), abs=0.03
    )
    pool.sampling = "prioritised"  # the learner beats random 9 times in 9, loses to expert 9 in 9
    for _ in range(9):
        pool.record("random", 1.0)
        pool.record("expert", 0.0)
    drawn = [pool.sample(rng) for _ in range(4000)]
    share = {name: drawn.count(name) / 4000 for name in pool.members}
    weight = {"random": 1 / 11, "expert": 10 / 11, "step_0": 0.5, "step_5": 0.5}
    assert share == pytest.approx({n: w / sum(weight.values()) for n, w in weight.items()}, abs=0.03)


def test_snapshots_are_bounded_saved_and_restored(renderer, tmp_path):
    sets = WeightSets(MovePolicy(renderer, 1), weights(1), 0)
    pool = OpponentPool(["random"], weights=sets, directory=tmp_path, every=2, size=2)
    for version in (0, 2, 4):
        sets.load_live(weights(version + 1).items(), version)
        pool.add_snapshot(version)
    assert [m.name for m in pool.snapshots()] == ["step_2", "step_4"]  # the oldest left
    assert sets.names() == ["step_2", "step_4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2.safetensors", "step_4.safetensors"]
    pool.record("step_4", 1.0)
    state = pool.state()

    fresh_sets = WeightSets(MovePolicy(renderer, 1), weights(9), 6)
    fresh = OpponentPool(["random", "expert"], weights=fresh_sets, directory=tmp_path, every=2, size=2)
    fresh.restore(state)
    assert fresh.learner_rating == pool.learner_rating and fresh.members["step_4"].games == 1
    assert int(fresh_sets.tensors("step_2")["move"]) == 3 and fresh_sets.version("step_4") == 4
    assert set(fresh.members) == {"random", "expert", "step_2", "step_4"}  # a bot the config adds joins

    (tmp_path / "step_2.safetensors").unlink()
    with pytest.raises(
        PoolError, match=r"member 'step_2': its weights file .*step_2\.safetensors is missing"
    ):
        OpponentPool(["random"], weights=WeightSets(MovePolicy(renderer, 1), weights(1), 0),
                     directory=tmp_path, size=2).restore(state)  # fmt: skip


def test_pool_config_is_checked():
    with pytest.raises(ValueError, match="set learn = 'one'"):
        SelfPlayConfig(enabled=True, opponent="pool")
    with pytest.raises(ValueError, match="an empty pool"):
        SelfPlayConfig(enabled=True, learn="one", opponent="pool", pool_size=0)
    with pytest.raises(ValueError, match="pool_sampling must be one of"):
        SelfPlayConfig(pool_sampling="best")


def opponent_moves(t) -> set[str]:
    seen = " ".join([*(tr.observation for tr in t.transitions), t.final_observation])
    return set(re.findall(r"Opponent took (\d+)", seen))


def test_matches_draw_opponents_from_the_pool_served_by_the_learners_own_policy(renderer, tmp_path):
    """Snapshots of a policy whose weight is its move: step_0 takes 3, step_1 takes 2, the live
    weights take 1; every game's opponent moves show which snapshot played them."""
    policy = MovePolicy(renderer, 3)
    sets = WeightSets(policy, weights(3), 0)
    pool = OpponentPool(weights=sets, directory=tmp_path, every=1, size=2)
    config = EnvRolloutConfig(env_id="toolgym/Nim-v0", group_size=8, max_turns=16, max_tokens_per_turn=8)
    runner = MatchRunner(RolloutRunner(sets.live, renderer, config), learn="one", opponent="pool", pool=pool)
    pool.add_snapshot(0)
    sets.live.load_weights(weights(2).items(), 1)  # the trainer's syncs
    pool.add_snapshot(1)
    sets.live.load_weights(weights(1).items(), 2)
    batch = asyncio.run(collect_batch(runner, TaskSeedStream(stream=3), BatchConfig(groups_per_batch=4)))
    played = batch.trajectories
    assert sets.loaded == LIVE and policy.move == 1  # the live weights back for the eval and the next sync
    assert "step_2" in pool.members  # the runner snapshots the live weights at version 2 (every 1)
    assert sum(m.games for m in pool.members.values()) == len(played) == 16
    for t in played:  # the learner's own moves are the live weights': 1 every turn
        assert {tr.action.text for tr in t.transitions} == {"1"}
    by_move = {"3": "step_0", "2": "step_1", "1": "step_2"}
    games = {name: 0 for name in by_move.values()}
    for t in played:
        # one opponent a game, its weights' one move every turn (the last cut to the stones left)
        games[by_move[max(opponent_moves(t))]] += 1
    # step_0 left the pool (size 2) when step_2 came in, before the matches began
    assert (
        "step_0" not in pool.members and pool.members["step_1"].games > 0 and pool.members["step_2"].games > 0
    )
    assert games == {
        "step_0": 0,
        "step_1": pool.members["step_1"].games,
        "step_2": pool.members["step_2"].games,
    }
    metrics = batch.metrics
    assert sum(v for k, v in metrics.items() if k.startswith("selfplay/games/")) == 16
    assert metrics["selfplay/elo"] == pool.learner_rating != 1000
