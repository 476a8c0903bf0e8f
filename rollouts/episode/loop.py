"""The episode loop: the one place that holds an episode's rules (turns, settling, stop reasons,
fault isolation), for the runner and for replay alike.

One episode (`play_episode`): `gymnasium.make(env_id, **env_kwargs)` (one env instance per
episode), reset with the task seed, then turn after turn: the actor's next action, `env.step`
with its text, until the env terminates/truncates, the turn limit is reached, or the actor ends
the episode. The actor (`Actor`) is the side that acts: the rollout runner's policy with its
renderer and token limits (rollouts/episode/runner.py), or a recording's actions
(rollouts/episode/recorded.py, what `replay --verify` runs). Everything else is here, once.

Stop reasons:
- the env ends the episode: its `info["end_reason"]` (answered, no_tool_call, max_turns,
  parse_error) becomes the StopReason (`env_io.env_stop_reason`); the runner's info keys are one
  contract, envs/core/info.py.
- max_turns: MAX_TURNS after the last allowed step (its reply is kept as the final observation,
  never shown to the model).
- the actor ends the episode before a turn (a token or context budget spent: MAX_TOKENS,
  CONTEXT_OVERFLOW; a generation error: TIMEOUT or CONTEXT_OVERFLOW), or says whether a turn cut
  by a token limit (finish_reason "length") ends it (`Actor.cut`). A cut turn is recorded (its
  tokens were sampled); it is given to the env only where the actor says so (the runner's
  `cut_turn = "step"`), and then its info gets `cut_turn_stepped`. An aborted turn ("abort") ends
  the episode with TIMEOUT.
- episode_timeout_s (asyncio.wait_for around the episode): TIMEOUT.

Settling the episodes the runner's limits end (`env_io.SETTLED_STOP_REASONS`: MAX_TOKENS,
CONTEXT_OVERFLOW, and MAX_TURNS when the env had not ended the episode itself): the env's
`abandon()` hook (envs/core/text_env.py; a ToolEnv settles it as its own limits would, e.g. with
an unanswered-episode penalty) gives a reward, added to the LAST transition's reward (so
total_reward is still the sum of transition rewards), and an info, merged into that transition's
info, whose reward_components become the episode's. So an unanswered episode scores the same
whichever limit, the env's or the runner's, ends it. An episode with no transition (its prompt
alone did not fit) has no step to carry it and is not settled; TIMEOUT and ENV_ERROR never are
(infrastructure failures, not trained on). A failing `abandon()` ends the episode with ENV_ERROR
(the last transition's info gets `abandon_error`).

Fault isolation: an env that raises in make/reset/step, or returns what the runner cannot use,
ends that episode with ENV_ERROR, as does an actor that cannot start or take the env's reply
(e.g. text the renderer cannot encode). `reset_env`/`step_env` (rollouts/env_io.py) check the
env's outputs. The episode keeps what it had, its error is "ExceptionType: message" (`describe`;
EnvOutputError for an unusable env output), and the other episodes go on. A step that raised or
returned an unusable output is recorded with reward 0 and info `{"error": ...}`.

Concurrency: every episode is an asyncio task, so the policy's generate calls arrive together
and the engine micro-batches them. Env steps run inline, except for an env whose `step_waits`
hook is true: its `env.step` runs in a worker thread (rollouts/episode/step_pool.py), so a slow
tool call does not hold up the other episodes' turns. An async env (`reset_async` and
`step_async` coroutines: one seat of a game, envs/core/seats.py) is awaited instead, so a seat
waits for the others' moves without holding a thread. A timeout that ends such an episode
mid-step keeps what it had; the env is closed once that step returns (the tool's own limits
bound it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import gymnasium

from ... import envs  # noqa: F401 (registers the toolgym/* envs with gymnasium)
from ...envs.core.info import ABANDON_ERROR, ERROR, REWARD_COMPONENTS
from ...envs.core.text_env import env_hooks
from ..env_io import (
    abandon_env,
    async_env,
    checked_reset,
    checked_step,
    env_stop_reason,
    reset_env,
    settles,
    step_env,
)
from ..types import CUT_TURN_STEPPED, RolloutSettings, StopReason, Trajectory, Transition
from .step_pool import env_step_pool


def describe(exc: BaseException) -> str:
    """An error as an episode records it: "ExceptionType: message"."""
    return f"{type(exc).__name__}: {exc}"


class EpisodeState:
    """What an episode has so far; a timeout cancels the play loop but keeps this."""

    def __init__(self) -> None:
        self.transitions: list[Transition] = []
        self.stop_reason: StopReason | None = None
        self.error: str | None = None
        self.system_prompt = ""
        self.final_observation = ""
        self.reward_components: dict[str, float] = {}
        self.reset_info: dict[str, Any] = {}  # what a tools-rendering renderer was given
        self.sampled_tokens = 0
        self.generate_s = 0.0  # awaiting the policy
        self.env_s = 0.0  # env reset/step and chat rendering: the runner's own work
        self.env: gymnasium.Env | None = None
        self.step_waits = False  # step the env in a worker thread (module doc)
        self.pending_step: concurrent.futures.Future[Any] | None = None  # that thread's step, in flight
        self.abandoned = False  # the env was asked to settle the episode (`abandon()`)
        self.settled = False  # ... and its settlement landed on the last transition

    def end(self, reason: StopReason, error: str | None = None) -> None:
        """End the episode with `reason` (the first reason given wins)."""
        if self.stop_reason is None:
            self.stop_reason, self.error = reason, error


class Actor(Protocol):
    """The side of an episode that acts (module doc). A method that raises ends the episode as an
    env error, except `act`, which ends it itself (`state.end`) when it has no action to give."""

    def begin(self, env: gymnasium.Env) -> None:
        """The env is made, not yet reset (the runner: which context policy applies)."""
        ...

    def start(self, state: EpisodeState, env: gymnasium.Env, observation: str, info: dict[str, Any]) -> None:
        """The env is reset (`state.system_prompt` set): take the first observation."""
        ...

    async def act(self, state: EpisodeState, turn: int, observation: str) -> Transition | None:
        """Turn `turn`'s action, as the transition that records it (what was shown before it,
        the Completion), or None when the episode ends before it (after `state.end`)."""
        ...

    def cut(self, transition: Transition) -> StopReason | None:
        """Why `transition`'s action, cut by a token limit (finish_reason "length"), ends the
        episode, or None when it goes to the env like any other action."""
        ...

    def observe(self, transition: Transition, observation: str, info: dict[str, Any]) -> None:
        """The env's reply to `transition`'s action, in an episode that goes on."""
        ...


async def play_episode(
    state: EpisodeState,
    actor: Actor,
    env_id: str,
    env_kwargs: dict[str, Any],
    task_seed: int,
    max_turns: int,
    timeout_s: float | None,
    make_env: Callable[[], gymnasium.Env] | None = None,
) -> None:
    """Play one episode into `state` (module doc): make and reset the env, the turns, the
    settling, and the env's close. Returns when the episode has ended; never raises for the
    env's or the actor's faults (they end the episode). `make_env` (default
    `gymnasium.make(env_id, **env_kwargs)`) makes the env: the match runner's seat of a game."""
    make = make_env or (lambda: gymnasium.make(env_id, **env_kwargs))
    try:
        await asyncio.wait_for(_play(state, actor, make, task_seed, max_turns), timeout_s)
        _settle(state)
    except TimeoutError:
        state.end(StopReason.TIMEOUT, f"TimeoutError: episode exceeded the {timeout_s}s wall-clock limit")
    finally:
        if state.pending_step is not None and not state.pending_step.done():
            env = state.env  # cut off mid-step: close it when the step returns, in that thread
            state.pending_step.add_done_callback(lambda _: _close_quietly(env))
        elif state.env is not None:
            try:
                state.env.close()
            except Exception as exc:
                state.end(StopReason.ENV_ERROR, describe(exc))


def _close_quietly(env: gymnasium.Env | None) -> None:
    """Close an env whose episode already ended (nothing is left to record an error in)."""
    if env is not None:
        with contextlib.suppress(Exception):
            env.close()


async def _play(
    state: EpisodeState, actor: Actor, make_env: Callable[[], gymnasium.Env], task_seed: int, max_turns: int
) -> None:
    tick = time.perf_counter()
    try:
        env = state.env = make_env()
        state.step_waits = bool(env_hooks(env).step_waits)
        actor.begin(env)
        if (seat := async_env(env)) is not None:
            observation, info, state.system_prompt = checked_reset(await seat.reset_async(task_seed))
        else:
            observation, info, state.system_prompt = reset_env(env, task_seed)
        actor.start(state, env, observation, info)
    except Exception as exc:
        return state.end(StopReason.ENV_ERROR, describe(exc))
    state.env_s += time.perf_counter() - tick

    for turn in range(max_turns):
        transition = await actor.act(state, turn, observation)
        if transition is None:
            return
        tick = time.perf_counter()
        try:
            reply = await _step(state, env, actor, transition, turn + 1 == max_turns)
        finally:
            state.env_s += time.perf_counter() - tick
        if reply is None:
            return
        observation = reply
    return state.end(StopReason.MAX_TURNS)  # unreachable unless max_turns == 0


async def _step(
    state: EpisodeState, env: gymnasium.Env, actor: Actor, transition: Transition, last_turn: bool
) -> str | None:
    """Record the turn, step the env with its action, give the reply to the actor. Returns the
    env's reply (the next turn's observation), or None when the episode ends here."""
    completion = transition.action
    state.transitions.append(transition)
    state.sampled_tokens += len(completion.tokens)
    if completion.finish_reason == "length":
        if (reason := actor.cut(transition)) is not None:
            state.end(reason)
            return None
        transition.info = {**transition.info, CUT_TURN_STEPPED: True}
    if completion.finish_reason == "abort":
        state.end(StopReason.TIMEOUT, "GenerationAborted: the engine aborted the request")
        return None
    # Nothing of the step is kept until all of it is usable: a bad output is an env error.
    try:
        observation, reward, terminated, truncated, info = await _step_env(state, env, completion.text)
        ended = terminated or truncated or last_turn
        if not ended:
            actor.observe(transition, observation, info)
    except Exception as exc:
        transition.info = {**transition.info, ERROR: describe(exc)}
        state.end(StopReason.ENV_ERROR, describe(exc))
        return None
    transition.reward = reward
    transition.terminated, transition.truncated = terminated, truncated
    transition.info = {**transition.info, **info} if transition.info else info
    if REWARD_COMPONENTS in info:
        state.reward_components = info[REWARD_COMPONENTS]
    if ended:
        state.final_observation = observation
        state.end(env_stop_reason(info, terminated) if terminated or truncated else StopReason.MAX_TURNS)
        return None
    return observation


async def _step_env(
    state: EpisodeState, env: gymnasium.Env, action: str
) -> tuple[str, float, bool, bool, dict[str, Any]]:
    """`step_env`, inline, awaited (an async env's `step_async`), or (`state.step_waits`) in a
    worker thread (module doc)."""
    if (seat := async_env(env)) is not None:
        return checked_step(await seat.step_async(action))
    if not state.step_waits:
        return step_env(env, action)
    state.pending_step = env_step_pool().submit(step_env, env, action)
    result = await asyncio.wrap_future(state.pending_step)
    state.pending_step = None
    return result


def _settle(state: EpisodeState) -> None:
    """Let the env settle an episode a runner limit ended (see the module doc)."""
    if state.env is None or not settles(state.stop_reason, state.transitions):
        return
    last = state.transitions[-1]
    tick = time.perf_counter()
    state.abandoned = True
    try:
        settled = abandon_env(state.env)
    except Exception as exc:
        last.info = {**last.info, ABANDON_ERROR: describe(exc)}
        state.stop_reason, state.error = StopReason.ENV_ERROR, describe(exc)
        return
    finally:
        state.env_s += time.perf_counter() - tick
    if settled is not None:
        reward, info = settled
        last.reward += reward
        last.info = {**last.info, **info}
        if REWARD_COMPONENTS in info:
            state.reward_components = info[REWARD_COMPONENTS]
        state.settled = True


async def run_grouped(
    config: RolloutSettings,
    run_episode: Callable[[int, int, int], Awaitable[Trajectory | list[Trajectory]]],
    task_seeds: Sequence[int],
    group_ids: Sequence[int] | None = None,
    on_episode: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """`config.group_size` calls of `run_episode(seed, group_id, sample)` per task seed, all
    concurrent (at most `config.max_concurrent_episodes` at a time), group-major; `on_episode` is
    called on each trajectory as its call finishes. A call returns its episode's Trajectory, or
    the list of those it played (a match: its learning seats'). The one group loop of the env
    runner, the agent runner and the match runner."""
    group_ids = range(len(task_seeds)) if group_ids is None else group_ids
    if len(group_ids) != len(task_seeds):
        raise ValueError(f"{len(task_seeds)} task seeds but {len(group_ids)} group ids")
    limit = config.max_concurrent_episodes
    semaphore = asyncio.Semaphore(limit) if limit else None

    async def one(seed: int, group_id: int, sample: int) -> list[Trajectory]:
        if semaphore is None:
            played = await run_episode(seed, group_id, sample)
        else:
            async with semaphore:
                played = await run_episode(seed, group_id, sample)
        played = played if isinstance(played, list) else [played]
        if on_episode is not None:
            for trajectory in played:
                on_episode(trajectory)
        return played

    jobs = [
        one(seed, group_id, s)
        for seed, group_id in zip(task_seeds, group_ids, strict=True)
        for s in range(config.group_size)
    ]
    return [t for played in await asyncio.gather(*jobs) for t in played]
