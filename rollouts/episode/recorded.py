"""A recorded episode played again through the episode loop: `replay_episode`; the seats of a
recorded match, together against one game: `replay_match`.

The actor (`RecordedActor`) gives the env the recorded actions, verbatim, one per turn, and no
more: where the recording ends without the env ending it, the runner's limits ended it (a token
or context budget, the turn limit, a generation failure or the wall clock), which the recording
alone cannot recompute (it keeps neither the limits nor a tokenizer), so the actor ends the
episode there with the recorded stop reason, as the runner did, keeping the env's last reply as
the final observation where the recording kept one. A turn cut by a token limit is given to the
env where the recording says the runner gave it (`cut_turn_stepped`). Everything else (stepping
through the runner's checks, errors, how the env's end maps to a stop reason, settling an episode
a limit ended, the reward landing on the last turn) is the episode loop's own rules, run once more:
`replay --verify` (rollouts/recording/replay.py) compares what comes back with the recording.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import gymnasium

from ...envs.core.info import ABANDON_ERROR
from ...envs.core.seats import Match
from ..types import CUT_TURN_STEPPED, StopReason, Trajectory, Transition
from .loop import EpisodeState, play_episode
from .match import seated_game


class RecordedActor:
    """Acts `trajectory`'s recorded actions (see the module doc)."""

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory
        self.reset: tuple[str, str] | None = None  # (observation, system prompt): the env's reset
        self.stop_reason = _before_settling(trajectory)
        self.turn = 0  # the turn last acted

    def begin(self, env: gymnasium.Env) -> None:
        pass

    def start(self, state: EpisodeState, env: gymnasium.Env, observation: str, info: dict[str, Any]) -> None:
        self.reset = (observation, state.system_prompt)

    async def act(self, state: EpisodeState, turn: int, observation: str) -> Transition | None:
        recorded = self.trajectory.transitions
        if turn < len(recorded):
            self.turn = turn
            return Transition(observation, list(recorded[turn].observation_tokens), recorded[turn].action)
        if turn > 0 and self.trajectory.final_observation:
            state.final_observation = observation
        state.end(self.stop_reason)
        return None

    def cut(self, transition: Transition) -> StopReason | None:
        # stepped where the runner stepped it (the recorded turn's info says so)
        return None if CUT_TURN_STEPPED in self.trajectory.transitions[self.turn].info else self.stop_reason

    def observe(self, transition: Transition, observation: str, info: dict[str, Any]) -> None:
        pass


def _before_settling(trajectory: Trajectory) -> StopReason:
    """The stop reason the runner ended the episode with: the recorded one, unless settling it
    failed (ENV_ERROR, `abandon_error` on the last turn), when it was one of the runner's limits
    (which one the recording no longer says; all settle alike)."""
    t = trajectory
    if t.stop_reason == StopReason.ENV_ERROR and t.transitions and ABANDON_ERROR in t.transitions[-1].info:
        return StopReason.MAX_TURNS
    return t.stop_reason


def replay_episode(trajectory: Trajectory) -> tuple[EpisodeState, RecordedActor]:
    """Play `trajectory`'s env (its id and kwargs, reset with its task seed) through the episode
    loop with its recorded actions; returns the new episode's state and the actor (its `reset`
    is None when the env could not be made or reset). Makes the env whatever its id: check the
    id first (`envs.registry.check_env_id`)."""
    state, actor = EpisodeState(), RecordedActor(trajectory)
    t = trajectory
    # one turn more than recorded: the actor, not the loop's turn limit, ends where the recording does
    asyncio.run(play_episode(state, actor, t.env_id, t.env_kwargs, t.task_seed, len(t.transitions) + 1, None))
    return state, actor


def replay_match(trajectories: Sequence[Trajectory]) -> list[tuple[EpisodeState, RecordedActor]]:
    """The seats of one recorded match (every seat of the game once: same env, task seed and
    sample index) played again together, each seat's episode through the episode loop with its
    recorded actions against one fresh game, as the match runner played them; one (state, actor)
    per trajectory, in order. ValueError when the trajectories are not every seat of one game.
    Makes the env whatever its id: check the id first (`envs.registry.check_env_id`)."""
    first = trajectories[0]
    seats = [t.seat for t in trajectories]
    if any((t.env_id, t.env_kwargs, t.task_seed, t.sample_index) != (first.env_id, first.env_kwargs,
           first.task_seed, first.sample_index) for t in trajectories):  # fmt: skip
        raise ValueError("the trajectories are not one match (env, task seed and sample index differ)")
    game = seated_game(first.env_id, first.env_kwargs)
    if sorted(seats) != sorted(game.seats):
        raise ValueError(f"seats {seats} recorded, the game's are {list(game.seats)}")
    match = Match(game, first.task_seed)

    async def seat(t: Trajectory) -> tuple[EpisodeState, RecordedActor]:
        state, actor = EpisodeState(), RecordedActor(t)
        try:
            await play_episode(
                state, actor, t.env_id, t.env_kwargs, t.task_seed, len(t.transitions) + 1, None,
                make_env=lambda: match.env(t.seat),
            )  # fmt: skip
        finally:
            await match.notify()  # the seat has left: wake the others, as the match runner does
        return state, actor

    async def play() -> list[tuple[EpisodeState, RecordedActor]]:
        return list(await asyncio.gather(*(seat(t) for t in trajectories)))

    return asyncio.run(play())
