"""Nim, a two-seat game sized for the CPU self-play demo: `toolgym/Nim-v0`.

    gymnasium.make("toolgym/Nim-v0", opponent="expert")   # the policy's seat against a bot

One pile of `min_stones`..`max_stones` stones (drawn per game); seats `first` and `second`
take turns taking 1..`max_take` stones; whoever takes the last stone wins. An action is the
number alone ("2"); anything else is an invalid move (the seat is told why and moves again;
envs/core/seats.py counts and charges it). `take_rest` (default) lets a seat ask for more than
are left, taking the rest, so a legal move is the same text everywhere; `take_rest=False` makes
that an invalid move, so the legal moves depend on the position (fewer than max_take stones).
`move="leave"` makes an action the number of stones the seat leaves ("7" from 9 takes 2): every
legal move then names a number that depends on the pile, so a model trained on random legal
moves has to read it (with "take", random moves look the same at every pile). Observations are
one line ("Opponent took 2. Stones: 9."), so an episode is a few dozen tokens.

Bots: `random` (a legal move drawn uniformly) and `expert`, which plays the known optimal
strategy: leave a multiple of max_take + 1 stones when it can (else a random legal move). So
the seat to move wins against `expert` exactly when stones % (max_take + 1) != 0 and it then
always leaves a multiple: a position's value is known in closed form (`winning`), which the
tests of per-seat credit use.

The registered env is `SoloEnv` (one seat for the policy, bot `opponent` on the other); the
match runner (rollouts/episode/match.py) plays both seats of `NimGame` at once for self-play.
"""

from __future__ import annotations

import re
from typing import ClassVar, Final

import numpy as np

from ..core.seats import LOSS, WIN, SeatedGame, SoloEnv

_NUMBER: Final = re.compile(r"\s*(\d{1,3})\s*")


def winning(stones: int, max_take: int = 3) -> bool:
    """Whether the seat to move wins Nim with `stones` left under optimal play by both."""
    return stones % (max_take + 1) != 0


class NimGame(SeatedGame):
    """Nim's state and rules (module doc)."""

    seats: ClassVar[tuple[str, ...]] = ("first", "second")
    bots: ClassVar[tuple[str, ...]] = ("random", "expert")

    def __init__(
        self,
        *,
        min_stones: int = 5,
        max_stones: int = 15,
        max_take: int = 3,
        invalid_move_penalty: float = 0.1,
        max_invalid_moves: int = 2,
        take_rest: bool = True,
        move: str = "take",
    ):
        if move not in ("take", "leave"):
            raise ValueError(f"move must be 'take' or 'leave', got {move!r}")
        if not (
            isinstance(min_stones, int) and isinstance(max_stones, int) and 1 <= min_stones <= max_stones
        ):
            raise ValueError(f"need 1 <= min_stones <= max_stones, got {min_stones!r}, {max_stones!r}")
        if not isinstance(max_take, int) or not 1 <= max_take <= 9:
            raise ValueError(f"max_take must be an int in [1, 9], got {max_take!r}")
        self.min_stones, self.max_stones, self.max_take = min_stones, max_stones, max_take
        self.take_rest = bool(take_rest)
        self.leave = move == "leave"
        self.stones = min_stones
        self._turn = 0
        super().__init__(
            invalid_move_penalty=invalid_move_penalty,
            max_invalid_moves=max_invalid_moves,
            max_moves=max_stones + 1,
        )

    def system_prompt(self, seat: str) -> str:
        order = "first" if seat == "first" else "second"
        reply = "how many stones you leave" if self.leave else "the number"
        return (
            f"You play Nim against an opponent, moving {order}. There is one pile of stones. On your "
            f"turn take 1 to {self.max_take} stones: reply with {reply} only. Whoever takes the "
            "last stone wins."
        )

    def start(self) -> None:
        self.stones = int(self.rng.integers(self.min_stones, self.max_stones + 1))
        self._turn = 0
        self.tell("first", f"Stones: {self.stones}.")

    @property
    def to_move(self) -> str:
        return self.seats[self._turn % 2]

    def legal(self) -> tuple[int, int]:
        """The smallest and largest number an action may name in this position."""
        if self.leave:
            return max(0, self.stones - self.max_take), self.stones - 1
        return 1, self.max_take if self.take_rest else min(self.max_take, self.stones)

    def move(self, seat: str, action: str) -> str | None:
        match = _NUMBER.fullmatch(action)
        low, high = self.legal()
        if match is None or not low <= int(match.group(1)) <= high:
            return f"Invalid move: reply with a number from {low} to {high}. Stones: {self.stones}."
        number = int(match.group(1))
        taken = self.stones - number if self.leave else min(number, self.stones)
        self.stones -= taken
        self._turn += 1
        other = self.seats[self._turn % 2]
        self.tell(other, f"Opponent took {taken}. Stones: {self.stones}.")
        if self.stones == 0:
            self.finish({seat: WIN, other: LOSS}, f"{seat} took the last stone")
        return None

    def credit_state(self, seat: str) -> str | None:
        """The stones left: the whole position for the seat about to move (its seat is fixed)."""
        return str(self.stones)

    def bot_action(self, seat: str, bot: str, rng: np.random.Generator) -> str:
        most = min(self.max_take, self.stones)
        best = self.stones % (self.max_take + 1)
        taken = best if bot == "expert" and best != 0 else int(rng.integers(1, most + 1))
        return str(self.stones - taken if self.leave else taken)


class NimEnv(SoloEnv):
    """`gymnasium.make("toolgym/Nim-v0", ...)`: one seat of Nim against bot `opponent` ("random"
    or "expert"); `seat` None alternates seats over task seeds; `oracle` the bot whose moves make
    SFT demonstrations; the game's knobs as NimGame's."""

    def __init__(
        self,
        *,
        seat: str | None = None,
        opponent: str = "random",
        oracle: str = "random",
        min_stones: int = 5,
        max_stones: int = 15,
        max_take: int = 3,
        invalid_move_penalty: float = 0.1,
        max_invalid_moves: int = 2,
        take_rest: bool = True,
        move: str = "take",
        max_turns: int = 16,
        render_mode: str | None = None,
    ):
        if render_mode is not None:
            raise ValueError(f"NimEnv has no render modes, got render_mode={render_mode!r}")
        game = NimGame(
            min_stones=min_stones,
            max_stones=max_stones,
            max_take=max_take,
            invalid_move_penalty=invalid_move_penalty,
            max_invalid_moves=max_invalid_moves,
            take_rest=take_rest,
            move=move,
        )
        super().__init__(game, seat=seat, opponent=opponent, oracle=oracle, max_turns=max_turns)
