"""The match runner: every seat of a game its own episode, all played at once.

    task seed ─> G matches ─> each: one game (envs/core/seats.py Match), one episode per seat
        seat "first":  the episode loop, PolicyActor(policy)    ─> Trajectory(seat="first")
        seat "second": the episode loop, PolicyActor(opponent)  ─> Trajectory(seat="second")
    learning seats' Trajectories, grouped per (task seed, seat): group id = id * seats + seat

Each seat is an ordinary episode of the episode loop (rollouts/episode/loop.py) over its
`SeatEnv`, so everything an episode has (rendering in the seat's own conversation, token limits,
stop reasons, settling, context policies, recording) holds per seat; the seats' episodes run as
concurrent asyncio tasks and wait on each other through the game. A seat that stops before the
game ends forfeits it, and the seats waiting on it wake to the result (envs/core/seats.py).

Who plays: `learn="all"` (mirror self-play): the policy on every seat, every seat's episode
trained. `learn="one"`: match k's learning seat is `seats[k % len(seats)]` (so a group's matches
cover every seat), the `opponent` on the others: a Policy (another model, or a snapshot, sampled
by its own engine) or the name of one of the game's bots (`BotPolicy`). Groups are per (task
seed, seat): a seat's baseline compares its episodes with others of the same seat and task, so a
first-mover's advantage is not counted as skill (rollouts/scoring/). With `record_opponents`, the
other seats' episodes (`trained=False`) are kept for the recording: `take_opponent_episodes()`
hands them over (the sources add them to what a step records), so a recorded match has every seat.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Final

import gymnasium
import msgspec
import torch

from ...agents.chat import Renderer
from ...agents.policy import Policy
from ...agents.types import Completion, SamplingParams
from ...envs.core.seats import Match, SeatedGame, SeatEnv, SeatError
from ..scripted import ScriptedEpisodePolicy
from ..types import Trajectory
from .loop import run_grouped
from .opponents import SAMPLING, OpponentPool

if TYPE_CHECKING:
    from .runner import RolloutRunner

LEARN: Final = ("all", "one")


class SelfPlayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[selfplay]`: play a game of seats (envs/core/seats.py) as matches (module doc).
    enabled: on; learn: "all" (mirror self-play) or "one"; opponent (learn "one"): the name of
    one of the game's bots, "self" (the policy, its episodes on that seat not trained), or "pool"
    (each match's opponent drawn from the pool: rollouts/episode/opponents.py); eval_opponents:
    bots the eval plays against too."""

    enabled: bool = False
    learn: str = "all"
    opponent: str = "self"
    # bots the held-out eval also plays the policy's seat against (the env's `opponent` knob set
    # to each): metrics eval/vs_<bot>/<name> beside eval/<name> (the env's own opponent)
    eval_opponents: tuple[str, ...] = ()
    # opponent "pool": a snapshot of the policy every pool_every steps (from step 0), the newest
    # pool_size kept (LoRA: the adapters alone), the game's bots pool_bots and the checkpoints
    # pool_checkpoints beside them; each match's
    # opponent drawn "uniform", "latest" (the newest snapshot) or "prioritised" (by the policy's
    # loss rate against each); Elo with elo_k per game for the policy and every member
    pool_every: int = 10
    pool_size: int = 4
    pool_bots: tuple[str, ...] = ()
    # other checkpoints in the pool (HF directories of this model and tokenizer, not with LoRA)
    pool_checkpoints: tuple[str, ...] = ()
    pool_sampling: str = "uniform"
    elo_k: float = 32.0

    def __post_init__(self) -> None:
        if self.learn not in LEARN:
            raise ValueError(f"selfplay.learn must be one of {LEARN}, got {self.learn!r}")
        if not self.opponent:
            raise ValueError("selfplay.opponent must name a bot of the game, 'self' or 'pool'")
        if self.opponent == "pool":
            if self.learn != "one":
                raise ValueError("selfplay.opponent = 'pool' plays the policy on one seat: set learn = 'one'")
            if self.pool_size < 0 or self.pool_every < 1:
                raise ValueError("selfplay.pool_size must be >= 0 and pool_every >= 1")
            if not self.pool_size and not self.pool_bots and not self.pool_checkpoints:
                raise ValueError("selfplay: an empty pool (pool_size 0, no pool_bots, no pool_checkpoints)")
        if self.pool_sampling not in SAMPLING:
            raise ValueError(f"selfplay.pool_sampling must be one of {SAMPLING}, got {self.pool_sampling!r}")
        if self.elo_k <= 0:
            raise ValueError(f"selfplay.elo_k must be > 0, got {self.elo_k}")


def seated_game(env_id: str, env_kwargs: dict) -> SeatedGame:
    """A new game of the seated env `env_id` (its unwrapped env's `game`, a SeatedGame);
    ValueError naming the env when it has none."""
    env = gymnasium.make(env_id, **env_kwargs)
    game = getattr(env.unwrapped, "game", None)
    if not isinstance(game, SeatedGame):
        env.close()
        raise ValueError(
            f"env {env_id!r} is not a game of seats (its env has no SeatedGame `game`, envs/core/seats.py)"
        )
    return game


class BotPolicy:
    """The game's scripted player `bot` on a seat, as a Policy: `for_episode(env, seed)` (the
    runner's EpisodePolicyFactory hook) binds it to the seat's env; each generate call returns
    the bot's move for the game as it stands, encoded as a completion (logprob 0 per token)."""

    policy_version = 0
    max_seq_len = None

    def __init__(self, renderer: Renderer, bot: str):
        self.renderer, self.bot = renderer, bot

    @property
    def policy_id(self) -> str:
        return f"bot:{self.bot}"

    def for_episode(self, env: gymnasium.Env, seed: int) -> _BotSeat:
        seat = env.unwrapped
        if not isinstance(seat, SeatEnv):
            raise TypeError(f"BotPolicy plays a seat of a game, got {type(seat).__name__}")
        if self.bot not in seat.game.bots:
            raise SeatError(f"unknown bot {self.bot!r}: the game's bots are {list(seat.game.bots)}")
        return _BotSeat(self.renderer, seat, self.bot)

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        raise TypeError("BotPolicy plays through for_episode (the runner binds it to a seat)")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """A bot has no weights."""

    def close(self) -> None:
        """Nothing to release."""


class _BotSeat(ScriptedEpisodePolicy):
    """A bot bound to one seat's env (BotPolicy.for_episode): its move for the game as it stands."""

    def __init__(self, renderer: Renderer, seat: SeatEnv, bot: str):
        super().__init__(renderer, [bot])
        self.seat, self.bot = seat, bot

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return [self.completion(self.seat.bot_action(self.bot), params) for _ in prompts]


class MatchRunner:
    """Plays `runner`'s seated env as matches (module doc); a GroupRunner for collect_batch."""

    def __init__(
        self,
        runner: RolloutRunner,
        *,
        learn: str = "all",
        opponent: Policy | str | None = None,
        pool: OpponentPool | None = None,
        record_opponents: bool = False,
    ):
        """`opponent`: a Policy, a bot's name, None / "self" (the runner's policy), or "pool":
        each match's drawn from `pool`, whose snapshots are served by `pool.weights` (the
        runner's policy must be its live set's view). `record_opponents`: keep the untrained
        seats' episodes until `take_opponent_episodes` (only for a caller that takes them)."""
        if learn not in LEARN:
            raise ValueError(f"learn must be one of {LEARN}, got {learn!r}")
        config = runner.config
        self.runner, self.learn, self.pool = runner, learn, None
        game = seated_game(config.env_id, config.env_kwargs)
        self.seats = game.seats
        if opponent == "self":
            opponent = None
        if opponent == "pool":
            if pool is None or learn != "one":
                raise ValueError("opponent 'pool' needs a pool and learn='one'")
            unknown = [bot for bot in pool.members if pool.members[bot].kind == "bot" and bot not in game.bots]
            if unknown:
                raise ValueError(f"unknown bots {unknown}: {config.env_id}'s bots are {list(game.bots)}")
            self.pool, opponent = pool, None
        if isinstance(opponent, str):
            if opponent not in game.bots:
                raise ValueError(f"unknown bot {opponent!r}: {config.env_id}'s bots are {list(game.bots)}")
            opponent = BotPolicy(runner.renderer, opponent)
        self.opponent: Policy | None = opponent
        self.record_opponents = record_opponents and learn == "one"
        self._opponent_episodes: list[Trajectory] = []

    @property
    def groups_per_task(self) -> int:
        """The (task, seat) groups one task seed's G matches give: one per seat that learns in any."""
        if self.learn == "all":
            return len(self.seats)
        return min(self.runner.config.group_size, len(self.seats))

    def learning_seats(self, sample_index: int) -> list[str]:
        if self.learn == "all":
            return list(self.seats)
        return [self.seats[sample_index % len(self.seats)]]

    async def run_match(self, task_seed: int, group_id: int = 0, sample_index: int = 0) -> list[Trajectory]:
        """One match: every seat's episode at once; the learning seats' Trajectories, each with
        its (task, seat) group id (module doc)."""
        config, runner = self.runner.config, self.runner
        game = seated_game(config.env_id, config.env_kwargs)
        match = Match(game, task_seed)
        learning = self.learning_seats(sample_index)
        opponent, member = self.opponent, ""
        if self.pool is not None:  # the draw depends on the match alone, not on timing
            member = self.pool.sample(random.Random(f"{task_seed}/{sample_index}/{runner.policy.policy_version}"))
            opponent = self._member_policy(member)

        async def seat(index: int, name: str) -> Trajectory:
            policy = None if name in learning else opponent
            try:
                return await runner.run_episode(
                    task_seed,
                    group_id * len(self.seats) + index,
                    sample_index,
                    seat=(index, name),
                    make_env=lambda: match.env(name),
                    policy=policy,
                )
            finally:
                await match.notify()  # the seat has left (SeatEnv.close): wake the others

        trajectories = await asyncio.gather(*(seat(i, name) for i, name in enumerate(self.seats)))
        learned = [t for t in trajectories if t.seat in learning]
        if self.record_opponents:
            for t in trajectories:
                if t.seat not in learning:
                    t.trained = False
                    self._opponent_episodes.append(t)
        if self.pool is not None:
            for t in learned:
                result = t.reward_components.get("game")
                if t.error is None and result is not None:  # win 1, draw 0, loss -1
                    self.pool.record(member, (result + 1.0) / 2.0)
        return learned

    def take_opponent_episodes(self) -> list[Trajectory]:
        """The untrained seats' episodes played since the last call (`record_opponents`)."""
        taken, self._opponent_episodes = self._opponent_episodes, []
        return taken

    def _member_policy(self, member: str) -> Policy:
        assert self.pool is not None
        if self.pool.members[member].kind == "bot":
            return BotPolicy(self.runner.renderer, member)
        assert self.pool.weights is not None
        return self.pool.weights.view(member)

    def step_metrics(self) -> dict[str, float]:
        """The pool's ratings and this step's games (rollouts/episode/opponents.py); {} without one."""
        return self.pool.metrics() if self.pool is not None else {}

    async def run_groups(
        self,
        task_seeds: Sequence[int],
        group_ids: Sequence[int] | None = None,
        on_episode: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """G matches per task seed, all concurrently (at most `max_concurrent_episodes` matches at
        a time); the learning seats' Trajectories, group-major per (task, seat)."""
        pool = self.pool
        if pool is not None and pool.due(version := self.runner.policy.policy_version):
            pool.add_snapshot(version)
        try:
            played = await run_grouped(self.runner.config, self.run_match, task_seeds, group_ids, on_episode)
        finally:
            if pool is not None and pool.weights is not None:
                pool.weights.restore_live()  # the eval and the next sync find the policy's own weights
        return sorted(played, key=lambda t: (t.group_id, t.sample_index))  # group-major, stable
