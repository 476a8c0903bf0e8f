"""Games of several seats (players), each seat with its own conversation.

    SeatedGame ──┬── SoloEnv(game, seat, opponent): one seat for the policy, the other seats
                 │   played inside `step` by the game's scripted bots. A plain TextEnv:
                 │   registered, `check_env`-clean, trained and evaluated as any env.
                 └── Match(game) + one SeatEnv per seat: every seat its own episode, all played
                     at once by the match runner (rollouts/episode/match.py): the policy on the
                     learning seats, opponents (the policy itself, a bot) on the others; each
                     learning seat's sampled tokens become its own Episode.

A `SeatedGame` holds the game's state and, per seat, the text that seat has not been shown yet
(`tell`) and the reward it has earned since it last took them (`award`). A subclass writes:
`seats`, `bots` (its scripted players' names), `system_prompt(seat)`, `start()` (a new game drawn
from `self.rng`), `to_move` (the seat whose turn it is), `move(seat, action)` (apply the action,
or return the one-line error the seat is told, "" where the game told it itself, the turn
staying where it is; `finish` ends the game), `bot_action(seat, bot, rng)` and, optionally,
`credit_state(seat)`. The base counts each seat's invalid moves (each costs
`invalid_move_penalty`; one over `max_invalid_moves` forfeits the game), draws the game after
`max_moves` moves, and reports each seat's info: reward components `game` (win 1, draw 0, loss
-1) and `invalid_move`, metrics `success` (won), `draw`, `loss`, `invalid_moves`, `moves`.

A seat of a Match is stepped with `await reset_async(seed)` / `await step_async(action)`: each
returns when it is that seat's turn again or the game is over, with what happened meanwhile (the
episode loop awaits them, rollouts/episode/loop.py). A seat whose episode ends while the game
goes on (a token limit, a timeout, an env error) leaves the match (`close`): it forfeits, and the
seats waiting on it wake to the end of the game. A seat the game ends before it ever moved is an
env error for that seat's episode (`SeatError`); the other seats are unaffected.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, ClassVar, Final

import numpy as np

from .info import (
    CREDIT_STATE,
    END_REASON,
    FAILURE_MODE,
    METRICS,
    OBSERVATION_ROLE,
    REWARD_COMPONENTS,
    SYSTEM_PROMPT,
)
from .text_env import TextEnv

WIN: Final = 1.0
DRAW: Final = 0.0
LOSS: Final = -1.0


class SeatError(RuntimeError):
    """A seat the game cannot play (str: one line saying why): an env error for that episode."""


class SeatedGame:
    """A turn-based game of `seats` (module doc). Randomness only from `self.rng`."""

    seats: ClassVar[tuple[str, ...]] = ()
    bots: ClassVar[tuple[str, ...]] = ("random",)

    def __init__(self, *, invalid_move_penalty: float = 0.1, max_invalid_moves: int = 2, max_moves: int = 64):
        if not isinstance(invalid_move_penalty, int | float) or invalid_move_penalty < 0:
            raise ValueError(f"invalid_move_penalty is a magnitude >= 0, got {invalid_move_penalty!r}")
        if not isinstance(max_invalid_moves, int) or max_invalid_moves < 0:
            raise ValueError(f"max_invalid_moves must be an int >= 0, got {max_invalid_moves!r}")
        if not isinstance(max_moves, int) or max_moves < 1:
            raise ValueError(f"max_moves must be an int >= 1, got {max_moves!r}")
        self.invalid_move_penalty = float(invalid_move_penalty)
        self.max_invalid_moves = max_invalid_moves
        self.max_moves = max_moves
        self._clear(0)  # no game is started until `reset`

    # ---- what a game writes ---------------------------------------------------------------------

    def system_prompt(self, seat: str) -> str:
        raise NotImplementedError

    def start(self) -> None:
        """A new game from `self.rng`; `tell` each seat its opening."""
        raise NotImplementedError

    @property
    def to_move(self) -> str:
        raise NotImplementedError

    def move(self, seat: str, action: str) -> str | None:
        """Apply `seat`'s action: None, or the error (one line) when the game refuses it."""
        raise NotImplementedError

    def bot_action(self, seat: str, bot: str, rng: np.random.Generator) -> str:
        """The action scripted player `bot` (one of `bots`) takes for `seat`, drawing from `rng`."""
        raise NotImplementedError

    def credit_state(self, seat: str) -> str | None:
        """Where `seat` stands now, as a key for turn-level credit's state baseline (info
        `credit_state`, envs/core/info.py: `credit = "turn_state"`), or None (the default: the
        exact history is the key). A game whose position is a small state (Nim's stones) names it."""
        return None

    # ---- the base ---------------------------------------------------------------------------------

    def reset(self, seed: int) -> None:
        """A new game from `seed` (`start`), every seat's pending text and reward cleared."""
        self._clear(seed)
        self.start()

    def _clear(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        # each seat's bot draws from its own generator, so a bot plays the same moves whatever
        # the other seats' players drew (SoloEnv's oracle plays the game ahead on a copy)
        self.bot_rngs = {s: np.random.default_rng([seed, i]) for i, s in enumerate(self.seats)}
        self.results: dict[str, float] | None = None  # each seat's result once the game is over
        self.moves = 0
        self._news: dict[str, list[str]] = {s: [] for s in self.seats}
        self._reward = dict.fromkeys(self.seats, 0.0)
        self._components = {s: {"game": 0.0, "invalid_move": 0.0} for s in self.seats}
        self._invalid = dict.fromkeys(self.seats, 0)

    @property
    def over(self) -> bool:
        return self.results is not None

    @property
    def current(self) -> str | None:
        """The seat to move, None once the game is over; SeatError when the game names a seat it
        does not have (so the seat that asks ends its episode, instead of every seat waiting)."""
        if self.over:
            return None
        seat = self.to_move
        if seat not in self.seats:
            raise SeatError(
                f"the game names an unknown seat {seat!r} to move (its seats: {list(self.seats)})"
            )
        return seat

    def tell(self, seat: str, text: str) -> None:
        self._news[seat].append(text)

    def award(self, seat: str, reward: float, component: str) -> None:
        self._reward[seat] += reward
        self._components[seat][component] = self._components[seat].get(component, 0.0) + reward

    def finish(self, results: dict[str, float], why: str = "") -> None:
        """End the game: each seat's result (WIN, DRAW, LOSS) as its `game` reward."""
        if self.over:
            return
        self.results = {seat: float(results[seat]) for seat in self.seats}
        for seat, result in self.results.items():
            self.award(seat, result, "game")
            outcome = "You win." if result > 0 else "You lose." if result < 0 else "Draw."
            self.tell(seat, f"Game over{': ' + why if why else ''}. {outcome}")

    def forfeit(self, seat: str, why: str) -> None:
        """`seat` loses; every other seat wins."""
        self.finish({s: LOSS if s == seat else WIN for s in self.seats}, why)

    def play(self, action: str) -> None:
        """The seat to move takes `action` (module doc: invalid moves, forfeits, the move limit)."""
        seat = self.current
        if seat is None:
            raise RuntimeError(f"{type(self).__name__}: play() after the game is over")
        error = self.move(seat, action)
        if error is not None:
            self._invalid[seat] += 1
            self.award(seat, -self.invalid_move_penalty, "invalid_move")
            if error:  # "" when the game told the seat itself
                self.tell(seat, error)
            if self._invalid[seat] > self.max_invalid_moves:
                self.forfeit(seat, f"{seat} made {self._invalid[seat]} invalid moves")
            return
        self.moves += 1
        if not self.over and self.moves >= self.max_moves:
            self.finish(dict.fromkeys(self.seats, DRAW), f"{self.max_moves} moves played")

    def take(self, seat: str) -> tuple[str, float]:
        """What `seat` has not been shown yet, and the reward earned since it last took them."""
        text, reward = "\n".join(self._news[seat]), self._reward[seat]
        self._news[seat], self._reward[seat] = [], 0.0
        return text, reward

    def seat_info(self, seat: str) -> dict[str, Any]:
        """`seat`'s step info (envs/core/info.py): its reward components and metrics so far, and,
        once the game is over, its end reason and outcome."""
        result = None if self.results is None else self.results[seat]
        info: dict[str, Any] = {
            "seat": seat,
            OBSERVATION_ROLE: "user",  # the other seats' moves come from another party, not a tool
            REWARD_COMPONENTS: dict(self._components[seat]),
            METRICS: {
                "success": float(result is not None and result > 0),
                "draw": float(result == DRAW),
                "loss": float(result is not None and result < 0),
                "invalid_moves": float(self._invalid[seat]),
                "moves": float(self.moves),
            },
        }
        state = self.credit_state(seat)
        if state is not None:
            info[CREDIT_STATE] = state
        if result is not None:
            info[END_REASON] = "answered"
            info[FAILURE_MODE] = "success" if result > 0 else "draw" if result == DRAW else "lost"
        return info

    def opening(self, seat: str) -> tuple[str, dict[str, Any]]:
        """`seat`'s first observation and reset info, once the seats before it have moved;
        SeatError when the game ended before it moved."""
        if self.over:
            raise SeatError(f"the game ended before seat {seat!r} moved")
        observation, _ = self.take(seat)
        info = {
            SYSTEM_PROMPT: self.system_prompt(seat),
            "question": observation,
            "answer": None,
            "seat": seat,
        }
        return observation, info

    def resign(self, seat: str, why: str) -> tuple[float, dict[str, Any]]:
        """`seat` forfeits the game going on: the reward it gets for it, and its info (what an
        env's `abandon()` returns)."""
        self.forfeit(seat, why)
        _, reward = self.take(seat)
        return reward, self.seat_info(seat)

    def play_bots(self, bots: dict[str, str]) -> None:
        """Let the seats in `bots` ({seat: bot}) move until it is another seat's turn or over."""
        while (seat := self.current) is not None and seat in bots:
            self.play(self.bot_action(seat, bots[seat], self.bot_rngs[seat]))


class SoloEnv(TextEnv):
    """One seat of `game` for the policy; the others played by bot `opponent` (module doc).

    `seat`: the policy's seat, or None to take seat `seats[seed % len(seats)]` (both sides over a
    run's task seeds). `oracle` is the bot whose play `oracle_actions` returns (SFT
    demonstrations: "random" legal moves, or a stronger bot where the game has one)."""

    def __init__(
        self,
        game: SeatedGame,
        *,
        seat: str | None = None,
        opponent: str = "random",
        oracle: str = "random",
        max_turns: int = 32,
    ):
        super().__init__(max_action_chars=256, max_observation_chars=4096)
        for name, bot in (("opponent", opponent), ("oracle", oracle)):
            if bot not in game.bots:
                raise ValueError(f"{name} must be one of the game's bots {list(game.bots)}, got {bot!r}")
        if seat is not None and seat not in game.seats:
            raise ValueError(f"seat must be one of {list(game.seats)} or None, got {seat!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        self.game, self.fixed_seat, self.opponent, self.oracle = game, seat, opponent, oracle
        self.max_turns = max_turns
        self.seat = game.seats[0]
        self._turns = 0
        self._done = True
        self._question = ""

    def _bots(self) -> dict[str, str]:
        return {s: self.opponent for s in self.game.seats if s != self.seat}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if options:
            raise ValueError(f"{type(self).__name__}.reset takes no options, got {sorted(options)}")
        game_seed = int(self.np_random.integers(2**63)) if seed is None else seed
        seats = self.game.seats
        self.seat = self.fixed_seat or seats[game_seed % len(seats)]
        self.game.reset(game_seed)
        self.game.play_bots(self._bots())
        self._question, info = self.game.opening(self.seat)
        self._turns, self._done = 0, False
        return self._question, {**info, "opponent": self.opponent}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError(f"{type(self).__name__}: step() after the episode ended (or before reset())")
        if not isinstance(action, str):
            raise TypeError(f"action must be a str, got {type(action).__name__}")
        self._turns += 1
        self.game.play(action)
        self.game.play_bots(self._bots())
        observation, reward = self.game.take(self.seat)
        info = self.game.seat_info(self.seat)
        terminated = self.game.over
        truncated = not terminated and self._turns >= self.max_turns
        if truncated:
            info[END_REASON], info[FAILURE_MODE] = "max_turns", "no_answer"
        self._done = terminated or truncated
        return observation, reward, terminated, truncated, info

    # ---- the oracle: the `oracle` bot's play of this seat ------------------------------------------

    @property
    def system_prompt(self) -> str:
        return self.game.system_prompt(self.seat)

    @property
    def question(self) -> str:
        return self._question

    @property
    def answer(self) -> Any:
        return None  # a game has no answer to state: it is won by its moves

    def oracle_actions(self) -> list[str]:
        """The `oracle` bot's moves for this seat over the rest of the game, played on a copy
        (the game itself is untouched)."""
        game = copy.deepcopy(self.game)
        rng = np.random.default_rng([int(game.rng.integers(2**63)), 1])
        actions: list[str] = []
        while (seat := game.current) is not None and len(actions) < self.max_turns:
            if seat == self.seat:
                actions.append(game.bot_action(seat, self.oracle, rng))
                game.play(actions[-1])
            else:
                game.play(game.bot_action(seat, self.opponent, game.bot_rngs[seat]))
        return actions

    def answer_action(self, answer: Any, tagged: bool = True) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no answer to state: a game is won by its moves")

    def abandon(self) -> tuple[float, dict[str, Any]] | None:
        """The runner stopped the episode mid-game: the policy's seat forfeits."""
        if self._done:
            return None
        self._done = True
        return self.game.resign(self.seat, f"{self.seat} stopped playing")


class Match:
    """One game played by every seat's episode at once (module doc): the game, reset by the first
    seat to start, and an asyncio condition the seats wait on for their turn."""

    def __init__(self, game: SeatedGame, seed: int):
        self.game, self.seed = game, seed
        self.started = False
        self.changed = asyncio.Condition()

    async def wait_turn(self, seat: str) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.game.current in (seat, None))

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def env(self, seat: str) -> SeatEnv:
        return SeatEnv(self, seat)


class SeatEnv(TextEnv):
    """One seat of a Match, stepped asynchronously (module doc). Not registered: the match runner
    makes one per seat; `reset`/`step` (synchronous) refuse, a seat waits on the others."""

    def __init__(self, match: Match, seat: str):
        super().__init__(max_action_chars=256, max_observation_chars=4096)
        if seat not in match.game.seats:
            raise SeatError(f"unknown seat {seat!r}: the game's seats are {list(match.game.seats)}")
        self.match, self.seat = match, seat
        self._done = True

    @property
    def game(self) -> SeatedGame:
        return self.match.game

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        raise TypeError("a seat of a Match is played with reset_async/step_async (rollouts/episode/match.py)")

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        raise TypeError("a seat of a Match is played with reset_async/step_async (rollouts/episode/match.py)")

    async def reset_async(self, seed: int) -> tuple[str, dict[str, Any]]:
        match = self.match
        if not match.started:
            match.started = True
            match.game.reset(match.seed)
            await match.notify()
        await match.wait_turn(self.seat)
        opening = self.game.opening(self.seat)
        self._done = False
        return opening

    async def step_async(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("SeatEnv: step after the game ended (or before reset)")
        if self.game.current != self.seat:
            raise SeatError(f"seat {self.seat!r} moved out of turn")
        self.game.play(action)
        await self.match.notify()
        await self.match.wait_turn(self.seat)
        observation, reward = self.game.take(self.seat)
        self._done = self.game.over
        return observation, reward, self.game.over, False, self.game.seat_info(self.seat)

    def bot_action(self, bot: str) -> str:
        """Bot `bot`'s action for this seat now (a bot opponent's policy calls it on its turn)."""
        return self.game.bot_action(self.seat, bot, self.game.bot_rngs[self.seat])

    def abandon(self) -> tuple[float, dict[str, Any]] | None:
        """The runner stopped this seat's episode mid-game: it forfeits."""
        if self._done or self.game.over:
            return None
        self._done = True
        return self.game.resign(self.seat, f"{self.seat} stopped playing")

    def close(self) -> None:
        """Leave the match: a game still going is forfeited (the match runner then wakes the
        seats waiting on it, `Match.notify`)."""
        if self.match.started and not self.game.over:
            self.game.forfeit(self.seat, f"{self.seat} left the game")
        self._done = True
        super().close()
