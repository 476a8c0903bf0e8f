"""The rollout runner: many multi-turn episodes at once (asyncio), token in, token out.

Each episode is the episode loop (rollouts/episode/loop.py: make, reset, turns, settling, stop
reasons, fault isolation, the env-step threads) with the policy as its actor (`PolicyActor`):
it renders the system prompt (`info["system_prompt"]`) and the first observation (a user
message) into the turn-0 prompt, generates one turn at a time on the whole token history, and
renders only the observation delta of each env reply and appends it (rollouts/episode/rendering.py,
through the renderer's per-episode `EpisodeRendering`, agents/chat.py).

Where a chat template is not append-only, the history restarts from its full re-rendering: that
transition's info gets `sequence_start` (rollouts/types.py, SEQUENCE_START), its
observation_tokens are the whole new history, Episodes split there (rollouts/episodes.py), and
`Trajectory.metrics["sequence_restarts"]` counts restarts (template renderers only).

Context policies (rollouts/context.py) go through the episode's `EpisodeContext`
(rollouts/episode/context.py): a rewrite restarts the sequence exactly as a template restart
does, with `context_rewrite` beside `sequence_start` in the next transition's info;
`metrics["context_rewrites"]` counts rewrites, `sequence_restarts` counts both kinds of restart,
and `Trajectory.context_policy` records the policy's spec for replay.

The policy's limits, checked before every turn, each ending the episode with its StopReason:
- max_tokens_per_episode spent, or a turn cut by a token budget (finish_reason "length"):
  MAX_TOKENS; with `cut_turn = "step"` a cut turn goes to the env instead (the renderer closes
  it) and only the spent episode budget ends the episode.
- context_length (the config's, else the policy's `max_seq_len`): when the next prompt leaves no
  room for a single new token, or a turn is cut because the context room (not a token budget)
  ran out: CONTEXT_OVERFLOW. Each turn's max_tokens is min(per-turn budget, episode budget left,
  context room).
A generation error ends the episode with TIMEOUT (the engine's ContextOverflowError, if raised,
with CONTEXT_OVERFLOW), as does a generation that does not return one completion. A policy that
is an `EpisodePolicyFactory` (a scripted expert) gets the episode's env after its reset.

Guided samples (`guided_samples` = k > 0, training groups only): `run_groups` has the env's
oracle (rollouts/scripted.py) play each group's last k samples through the same path, marked
`Trajectory.guided`; the trainer scores their tokens with its own logprobs (rollouts/types.py).

Sampling seeds: each turn's SamplingParams.seed is derived from (config.seed, task seed, sample
index, turn) (rollouts/episode/config.py), so the G samples of a group differ and a rerun
reproduces them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import gymnasium

from ...agents.chat import ChatRenderer, Renderer
from ...agents.errors import ContextOverflowError
from ...agents.policy import Policy
from ...agents.types import Completion, SamplingParams
from ...envs.core.info import INSTRUCTIONS, TOOLS
from ...envs.core.text_env import env_hooks
from ..context import ContextPolicy, KeepAll, context_policy, keeps_all, policy_spec
from ..metrics import CONTEXT_REWRITES, SEQUENCE_RESTARTS, episode_metrics
from ..scripted import OraclePolicy
from ..types import CONTEXT_REWRITE, SEQUENCE_START, StopReason, Trajectory, Transition
from .config import EnvRolloutConfig, sampling_seed
from .context import EpisodeContext
from .loop import EpisodeState, describe, play_episode, run_grouped
from .rendering import env_replies, first_messages, rendered


@runtime_checkable
class EpisodePolicyFactory(Protocol):
    """A policy with privileged access to the episode's env (a scripted expert).

    The runner calls `for_episode(env, seed)` right after `env.reset` and sends that episode's
    generate calls to the Policy it returns; everything else (rendering, limits, env steps) is
    the same path a model takes.
    """

    def for_episode(self, env: gymnasium.Env, seed: int) -> Policy: ...


class PolicyActor:
    """The policy's side of one episode (the module doc): renders, keeps the token history,
    checks the limits, generates. One per episode."""

    def __init__(
        self, runner: RolloutRunner, task_seed: int, sample_index: int, policy: Policy | None = None, seat: int = 0
    ) -> None:
        self.config, self.renderer = runner.config, runner.renderer
        self.context_length = runner.context_length
        self.policy: Policy = runner.policy if policy is None else policy
        parts = (self.config.seed, task_seed, sample_index) + ((seat,) if seat else ())
        self.episode_seed = sampling_seed(*parts)
        self.context_policy: ContextPolicy = KeepAll()
        self.context: EpisodeContext | None = None
        self.history: list[int] = []  # the tokens the policy generates on
        # what the model sees before the next action: its tokens, and None or why they restart
        # the sequence ("template" or "rewrite")
        self.shown: tuple[list[int], str | None] = ([], None)
        self.context_bound = False  # the last turn's max_tokens was the context room's

    def begin(self, env: gymnasium.Env) -> None:
        declared = env_hooks(env).context_policy  # the env's, unless configured
        config = self.config
        self.context_policy = context_policy(config.context if config.context is not None else declared)

    def start(self, state: EpisodeState, env: gymnasium.Env, observation: str, info: dict[str, Any]) -> None:
        renderer = self.renderer
        messages, tools = first_messages(renderer, observation, info, state.system_prompt)
        if tools is not None:
            state.reset_info = {k: info[k] for k in (TOOLS, INSTRUCTIONS) if k in info}
        context = self.context = rendered(EpisodeContext, renderer, messages, tools, self.context_policy)
        self.shown = (context.prompt, None)
        self.history = list(context.prompt)
        if isinstance(self.policy, EpisodePolicyFactory):
            self.policy = self.policy.for_episode(env, self.episode_seed)

    async def act(self, state: EpisodeState, turn: int, observation: str) -> Transition | None:
        config, renderer = self.config, self.renderer
        episode_left = config.max_tokens_per_episode - state.sampled_tokens
        room = None if self.context_length is None else self.context_length - len(self.history)
        if episode_left <= 0 or (room is not None and room <= 0):
            if turn > 0:  # the env's reply to the last action, never shown to the model
                state.final_observation = observation
            state.end(StopReason.MAX_TOKENS if episode_left <= 0 else StopReason.CONTEXT_OVERFLOW)
            return None
        budget = min(config.max_tokens_per_turn, episode_left)
        max_tokens = budget if room is None else min(budget, room)
        self.context_bound = room is not None and room < budget
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=config.sampling.temperature,
            top_p=config.sampling.top_p,
            top_k=config.sampling.top_k,
            stop_token_ids=renderer.stop_token_ids,
            seed=sampling_seed(self.episode_seed, turn),
        )
        completion = await self._generate(state, params)
        if completion is None:
            return None
        if completion.tokens:  # what the env reads is the renderer's to say (harmony keeps its markup)
            completion.text = renderer.action_text(completion.tokens)
        tokens, restarted = self.shown
        transition = Transition(observation, tokens, completion)
        if restarted:
            transition.info = {SEQUENCE_START: True}
            if restarted == "rewrite":
                transition.info[CONTEXT_REWRITE] = True
        self.history += completion.tokens
        return transition

    def cut(self, transition: Transition) -> StopReason | None:
        if self.context_bound:
            return StopReason.CONTEXT_OVERFLOW
        return None if self.config.cut_turn == "step" else StopReason.MAX_TOKENS

    def observe(self, transition: Transition, observation: str, info: dict[str, Any]) -> None:
        """Render the env's reply: the delta appended to the history, or (a restarted rendering,
        a context rewrite) the whole new history in its place."""
        assert self.context is not None  # started
        completion = transition.action
        replies = env_replies(self.renderer, observation, info, self.config.observation_role)
        delta, rewritten = rendered(self.context.extend, completion.tokens, completion.text, replies, info)
        if delta.restarted:
            self.history[:] = delta.tokens
        else:
            self.history += delta.tokens
        self.shown = (delta.tokens, "rewrite" if rewritten else "template" if delta.restarted else None)

    async def _generate(self, state: EpisodeState, params: SamplingParams) -> Completion | None:
        started = time.perf_counter()
        try:
            completions = await self.policy.generate([list(self.history)], params)
        except ContextOverflowError as exc:
            state.end(StopReason.CONTEXT_OVERFLOW, describe(exc))
            return None
        except Exception as exc:
            state.end(StopReason.TIMEOUT, describe(exc))
            return None
        finally:
            state.generate_s += time.perf_counter() - started
        if len(completions) != 1:
            state.end(StopReason.TIMEOUT, f"PolicyError: expected 1 completion, got {len(completions)}")
            return None
        return completions[0]


class RolloutRunner:
    """Rolls out `policy` on `config.env_id`. Reusable across batches and policy versions."""

    def __init__(self, policy: Policy, renderer: Renderer, config: EnvRolloutConfig):
        self.policy = policy
        self.renderer = renderer
        self.config = config
        known = [int(n) for n in (config.context_length, policy.max_seq_len) if isinstance(n, int)]
        self.context_length = min(known) if known else None
        # A wrong env id or kwargs is a configuration error, not an episode failure: fail now.
        try:
            gymnasium.make(config.env_id, **config.env_kwargs).close()
        except Exception as exc:
            raise ValueError(f"cannot make env {config.env_id!r} with {config.env_kwargs}: {exc}") from exc

    async def run_episode(
        self,
        task_seed: int,
        group_id: int = 0,
        sample_index: int = 0,
        *,
        seat: tuple[int, str] | None = None,
        make_env: Callable[[], gymnasium.Env] | None = None,
        policy: Policy | None = None,
    ) -> Trajectory:
        """One episode (the episode loop with this runner's policy) as its Trajectory. The match
        runner (rollouts/episode/match.py) plays one seat of a game: `seat` (its index and name),
        `make_env` (that seat's env) and `policy` (the seat's player, default this runner's)."""
        seat_index, seat_name = seat or (0, "")
        state, actor = EpisodeState(), PolicyActor(self, task_seed, sample_index, policy, seat_index)
        started = time.perf_counter()
        config = self.config
        await play_episode(
            state,
            actor,
            config.env_id,
            config.env_kwargs,
            task_seed,
            config.max_turns,
            config.episode_timeout_s,
            make_env,
        )
        trajectory = Trajectory(
            env_id=config.env_id,
            env_kwargs=dict(config.env_kwargs),
            task_seed=task_seed,
            group_id=group_id,
            transitions=state.transitions,
            stop_reason=state.stop_reason or StopReason.MAX_TURNS,
            system_prompt=state.system_prompt,
            final_observation=state.final_observation,
            total_reward=float(sum(t.reward for t in state.transitions)),
            reward_components=state.reward_components,
            policy_version=min(
                (t.action.policy_version for t in state.transitions), default=self.policy.policy_version
            ),
            sample_index=sample_index,
            error=state.error,
            reset_info=state.reset_info,
            seat=seat_name,
        )
        trajectory.metrics = episode_metrics(
            trajectory, time.perf_counter() - started, state.generate_s, state.env_s
        )
        context, rewrites = actor.context, not keeps_all(actor.context_policy)
        if rewrites:
            trajectory.context_policy = policy_spec(actor.context_policy)
            trajectory.metrics[CONTEXT_REWRITES] = context.rewrites if context else 0
        if rewrites or not isinstance(self.renderer, ChatRenderer):  # plain ChatML alone never restarts
            restarts = context.template_restarts + context.rewrites if context else 0
            trajectory.metrics[SEQUENCE_RESTARTS] = restarts
        return trajectory

    async def run_groups(
        self,
        task_seeds: Sequence[int],
        group_ids: Sequence[int] | None = None,
        on_episode: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """G episodes per task seed, all concurrently. Returns them group-major
        ([seed0 s0..s(G-1), seed1 s0, ...]); group_ids (default 0, 1, ...) name the groups.
        `on_episode` is called as each episode finishes (progress bars, streaming recorders).
        With `guided_samples` = k, each group's last k samples are the env oracle's episodes
        (`Trajectory.guided`), at the policy's current version."""
        if not self.config.guided_samples:
            return await run_grouped(self.config, self.run_episode, task_seeds, group_ids, on_episode)
        first_guided = self.config.group_size - self.config.guided_samples
        oracle = OraclePolicy(self.renderer, policy_version=self.policy.policy_version)

        async def run_episode(task_seed: int, group_id: int, sample_index: int) -> Trajectory:
            if sample_index < first_guided:
                return await self.run_episode(task_seed, group_id, sample_index)
            trajectory = await self.run_episode(task_seed, group_id, sample_index, policy=oracle)
            trajectory.guided = True
            return trajectory

        return await run_grouped(self.config, run_episode, task_seeds, group_ids, on_episode)

    def run(self, task_seeds: Sequence[int], **kwargs: Any) -> list[Trajectory]:
        """Synchronous wrapper around `run_groups` (not callable from inside a running loop)."""
        return asyncio.run(self.run_groups(task_seeds, **kwargs))
