"""The rollout runner: many multi-turn episodes at once (asyncio), token in, token out.

One episode: `gymnasium.make(env_id, **env_kwargs)` (one env instance per episode), reset with
the task seed, render the system prompt (`info["system_prompt"]`) and the first observation (a
user message) into the turn-0 prompt, then loop: generate one turn on the whole token history,
give the completion's text to `env.step`, render only the observation delta and append it, until
the env terminates/truncates or a limit ends the episode.

Rendering goes through the renderer's per-episode `EpisodeRendering` (agents/chat.py). Plain
ChatML gets the system prompt and each observation as one `observation_role` message. A renderer
that writes tools itself (`renders_tools`: a model's chat template, agents/chat_template.py) gets
the env's tool specs (reset info `tools`) with its `instructions` as the system message (both
kept in `Trajectory.reset_info`, so replay renders the same prompt), and one `tool` message per
`info["tool_results"]` entry (else the observation; `env_replies`). Where a template is not
append-only, the history restarts from its full re-rendering: that transition's info gets
`sequence_start` (rollouts/types.py, SEQUENCE_START), its observation_tokens are the whole new
history, Episodes split there (rollouts/episodes.py), and `Trajectory.metrics["sequence_restarts"]`
counts restarts (template renderers only).

Context policies (rollouts/context.py): the episode's `EpisodeContext` keeps the conversation as
messages beside the tokens and, after each env step the episode goes on from, asks the policy
(`rollout.context`, else the env's `context_policy`, else KeepAll) whether to rewrite it. A
rewrite renders the new conversation in full (`renderer.start_episode`) and restarts the sequence
exactly as a template restart does, with `context_rewrite` beside `sequence_start` in the next
transition's info; `metrics["context_rewrites"]` counts rewrites, `sequence_restarts` counts both
kinds of restart, and `Trajectory.context_policy` records the policy's spec for replay. KeepAll
never builds the message list: its history stays append-only.

Limits, each ending the episode with its StopReason (checked in this order every turn):
- max_tokens_per_episode spent, or a turn cut by a token budget (finish_reason "length"):
  MAX_TOKENS. A cut turn is recorded (its tokens were sampled) but never given to the env.
- context_length: when the next prompt leaves no room for a single new token, or a turn is cut
  because the context room (not a token budget) ran out: CONTEXT_OVERFLOW. Each turn's
  max_tokens is min(per-turn budget, episode budget left, context room).
- max_turns: MAX_TURNS (the env's own turn limit maps to the same reason via its end_reason).
- episode_timeout_s (asyncio.wait_for around the episode): TIMEOUT.
The env's `info["end_reason"]` (answered, no_tool_call, max_turns, parse_error) becomes the
StopReason when the env ends the episode. The info keys the runner reads (end_reason,
reward_components, metrics, failure_mode, system_prompt) are one contract: envs/core/info.py.

Settling the episodes the runner ends (`env_io.SETTLED_STOP_REASONS`: MAX_TOKENS,
CONTEXT_OVERFLOW, and MAX_TURNS when the env had not ended the episode itself): if the env has
the optional `abandon() -> (reward, info)` (envs/core/tool_env.py: the env settles it as its own limits
would, e.g. with an unanswered-episode penalty), the runner calls it (`abandon_env`), adds the reward to the LAST
transition's reward (so total_reward is still the sum of transition rewards), merges the info
into that transition's info and takes its reward_components. So an unanswered episode scores the
same whichever limit, the env's or the runner's, ends it. An episode with no transition (its
prompt alone did not fit) has no step to carry it and is not settled; TIMEOUT and ENV_ERROR never
are (infrastructure failures, not trained on). A failing `abandon()` ends the episode with
ENV_ERROR (the last transition's info gets "abandon_error").

Fault isolation: an env that raises in make/reset/step (or its oracle, for a scripted policy),
or returns what the runner cannot use, ends that episode with ENV_ERROR, as does a prompt or
observation the renderer cannot encode. `reset_env`/`step_env` (rollouts/env_io.py) check the
env's outputs: text that is not an encodable str, a reward that is not a finite number (NaN or
inf would make its whole group's advantages NaN), an info that is not a dict, reward_components
that are not name -> finite number. A generation error or an aborted generation ends the episode
with TIMEOUT (the engine's ContextOverflowError, if raised, with CONTEXT_OVERFLOW). The episode
keeps what it had, `Trajectory.error` holds "ExceptionType: message" (EnvOutputError for an
unusable env output: "EnvOutputError: reward must be a finite number, got None"), and the rest
go on. A step that raised or returned an unusable output is recorded with reward 0 and info
`{"error": ...}`.

Concurrency: all episodes of a call run as asyncio tasks, so their `generate` calls arrive
together and the engine micro-batches them. Env steps run inline, except for an env whose
`step_waits` is true (its `unwrapped` attribute: a ToolEnv with a tool that waits on a sandbox or
a server): its `env.step` runs in a worker thread (ENV_STEP_THREADS of them, shared by all
runners), so a slow tool call does not hold up the other episodes' turns. A timeout that ends such
an episode mid-step keeps what it had; the env is closed once that step returns (the tool's own
limits bound it).

Sampling seeds: each turn's SamplingParams.seed is derived from (config.seed, task seed, sample
index, turn), so the G samples of a group differ and a rerun reproduces them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import gymnasium
import msgspec
import numpy as np

from .. import envs  # noqa: F401 (registers the toolgym/* envs with gymnasium)
from ..agents.chat import ChatRenderer, EpisodeRendering, RenderedTurn, Renderer
from ..agents.errors import ContextOverflowError
from ..agents.policy import Policy
from ..agents.types import Completion, Message, Role, SamplingParams
from ..envs.core.info import INSTRUCTIONS, TOOL_RESULTS, TOOLS
from .context import ContextPolicy, Conversation, KeepAll, Turn, context_policy, keeps_all, policy_spec
from .env_io import EnvOutputError, abandon_env, env_stop_reason, reset_env, settles, step_env
from .metrics import CONTEXT_REWRITES, SEQUENCE_RESTARTS, episode_metrics
from .types import (
    CONTEXT_REWRITE,
    SEQUENCE_START,
    PolicySampling,
    RolloutSettings,
    StopReason,
    Trajectory,
    Transition,
)


class EnvRolloutConfig(RolloutSettings, frozen=True, kw_only=True):
    """What the runner takes to roll out one env: the env-independent `RolloutSettings` plus
    the env id and kwargs, the policy's sampling and the seed (in a run config these come from
    `[rollout]`, `[env]`, `[policy]` and `run.seed`: `Config.rollout_config()`)."""

    env_id: str
    env_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    sampling: PolicySampling = msgspec.field(default_factory=PolicySampling)
    seed: int = 0  # mixed into every per-turn sampling seed

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seed < 0:
            raise ValueError(f"EnvRolloutConfig.seed must be >= 0, got {self.seed}")

    @classmethod
    def build(
        cls,
        settings: RolloutSettings,
        env_id: str,
        env_kwargs: dict[str, Any] | None = None,
        sampling: PolicySampling | None = None,
        seed: int = 0,
    ) -> EnvRolloutConfig:
        """`settings` with the env, sampling and seed (the settings' fields, by name: no copy of
        the declaration)."""
        return cls(
            **{name: getattr(settings, name) for name in RolloutSettings.__struct_fields__},
            env_id=env_id,
            env_kwargs=dict(env_kwargs or {}),
            sampling=PolicySampling.of(sampling) if sampling is not None else PolicySampling(),
            seed=seed,
        )


@runtime_checkable
class EpisodePolicyFactory(Protocol):
    """A policy with privileged access to the episode's env (a scripted expert).

    The runner calls `for_episode(env, seed)` right after `env.reset` and sends that episode's
    generate calls to the Policy it returns; everything else (rendering, limits, env steps) is
    the same path a model takes.
    """

    def for_episode(self, env: gymnasium.Env, seed: int) -> Policy: ...


def sampling_seed(*parts: int) -> int:
    """A 31-bit seed mixed from non-negative ints (SeedSequence hashing: no collisions by
    arithmetic coincidence, unlike sums or products)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint32)[0] >> 1)


ENV_STEP_THREADS = 64  # worker threads for envs whose step waits (module doc), shared by all runners
_step_pool: concurrent.futures.ThreadPoolExecutor | None = None
_step_pool_lock = threading.Lock()


def _env_step_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _step_pool
    with _step_pool_lock:
        if _step_pool is None:
            _step_pool = concurrent.futures.ThreadPoolExecutor(ENV_STEP_THREADS, "toolgym-env-step")
        return _step_pool


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _close_quietly(env: gymnasium.Env | None) -> None:
    """Close an env whose episode already ended (nothing is left to record an error in)."""
    if env is not None:
        with contextlib.suppress(Exception):
            env.close()


def first_messages(
    renderer: Renderer, observation: str, info: dict[str, Any], system_prompt: str
) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """The first prompt's messages (the system message if any, the reset observation as the user
    message) and tools: a renderer that renders tools itself gets the env's tool specs and its
    instructions (the system prompt without its tools block); any other gets the system prompt."""
    system, tools = _system_and_tools(renderer, info, system_prompt)
    return [*([Message("system", system)] if system else []), Message("user", observation)], tools


def _system_and_tools(
    renderer: Renderer, info: dict[str, Any], system_prompt: str
) -> tuple[str, list[dict[str, Any]] | None]:
    tools = info.get(TOOLS) if renderer.renders_tools else None
    if not tools:
        return system_prompt, None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise EnvOutputError(f"info['tools'] must be a list of tool specs (dicts), got {tools!r:.80}")
    instructions = info.get(INSTRUCTIONS, system_prompt)
    if not isinstance(instructions, str):
        raise EnvOutputError(f"info['instructions'] must be a str, got {instructions!r:.80}")
    return instructions, tools


def env_replies(renderer: Renderer, observation: str, info: dict[str, Any], role: Role) -> list[Message]:
    """The env's reply to an action as messages: one `tool` message per `info["tool_results"]`
    entry for a renderer that renders tools itself, else the observation in `role`
    (rollout.observation_role)."""
    results = info.get(TOOL_RESULTS) if renderer.renders_tools else None
    if not results:
        return [Message(role, observation)]
    if not isinstance(results, list) or not all(isinstance(r, str) for r in results):
        raise EnvOutputError(f"info['tool_results'] must be a list of str, got {results!r:.80}")
    return [Message("tool", r) for r in results]


class ContextPolicyError(RuntimeError):
    """A context policy raised or returned something that is not a Conversation (the episode
    ends as an env error, as when a tool raises)."""


def _render(render: Callable[..., Any], *args: Any) -> Any:
    try:
        return render(*args)
    except ContextPolicyError:
        raise
    except Exception as exc:
        raise EnvOutputError(f"the renderer cannot encode the env's text ({_describe(exc)})") from exc


class EpisodeContext:
    """One episode's conversation as tokens and, unless the policy keeps everything, as messages.

    `prompt` first; then per sampled turn `extend`, which appends the turn to the conversation,
    asks the policy, and returns the tokens to feed next: the renderer's delta, or (a rewrite, or
    a chat template that restarts) the whole new history. The runner and replay's token check
    both go through here, so they cannot disagree on where a segment starts."""

    def __init__(
        self,
        renderer: Renderer,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        policy: ContextPolicy | None = None,
    ) -> None:
        self.renderer, self.tools = renderer, tools
        self.policy = policy if policy is not None else KeepAll()
        self.rendering: EpisodeRendering = renderer.start_episode(messages, tools)
        self.prompt = self.rendering.prompt
        self._turns: list[Turn] = []
        self.conversation = Conversation(list(messages), self._turns)
        self.rewrites = 0  # the policy's rewrites
        self._earlier_restarts = 0  # template restarts of renderings a rewrite replaced

    @property
    def template_restarts(self) -> int:
        return self._earlier_restarts + self.rendering.restarts

    def extend(
        self, sampled_tokens: Sequence[int], text: str, replies: Sequence[Message], info: Mapping[str, Any]
    ) -> tuple[RenderedTurn, bool]:
        """(what to feed next, whether the policy rewrote the conversation)."""
        if keeps_all(self.policy):
            return self.rendering.extend(sampled_tokens, replies), False
        self._turns.append(Turn([Message("assistant", text), *replies], info))
        self.conversation = Conversation(self.conversation.head, self._turns)
        try:
            rewritten = self.policy.rewrite(self.conversation)
        except Exception as exc:
            raise ContextPolicyError(f"the context policy failed: {_describe(exc)}") from exc
        if rewritten is not None and not isinstance(rewritten, Conversation):
            raise ContextPolicyError(f"the context policy returned {rewritten!r:.80}, not a Conversation")
        if rewritten is None:
            return self.rendering.extend(sampled_tokens, replies), False
        self._earlier_restarts += self.rendering.restarts
        self.conversation, self._turns = rewritten, list(rewritten.turns)
        self.rendering = self.renderer.start_episode(rewritten.messages, self.tools)
        self.rewrites += 1
        return RenderedTurn(list(self.rendering.prompt), restarted=True), True


class _EpisodeState:
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
        self.context: EpisodeContext | None = None
        self.policy: ContextPolicy = KeepAll()

    def end(self, reason: StopReason, error: str | None = None) -> None:
        if self.stop_reason is None:
            self.stop_reason, self.error = reason, error


async def run_grouped(
    config: EnvRolloutConfig,
    run_episode: Callable[[int, int, int], Awaitable[Trajectory]],
    task_seeds: Sequence[int],
    group_ids: Sequence[int] | None = None,
    on_episode: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """`config.group_size` calls of `run_episode(seed, group_id, sample)` per task seed, all
    concurrent (at most `config.max_concurrent_episodes` at a time), group-major; `on_episode` is
    called as each finishes. The one group loop of the env runner and the agent runner."""
    group_ids = range(len(task_seeds)) if group_ids is None else group_ids
    if len(group_ids) != len(task_seeds):
        raise ValueError(f"{len(task_seeds)} task seeds but {len(group_ids)} group ids")
    limit = config.max_concurrent_episodes
    semaphore = asyncio.Semaphore(limit) if limit else None

    async def one(seed: int, group_id: int, sample: int) -> Trajectory:
        if semaphore is None:
            trajectory = await run_episode(seed, group_id, sample)
        else:
            async with semaphore:
                trajectory = await run_episode(seed, group_id, sample)
        if on_episode is not None:
            on_episode(trajectory)
        return trajectory

    jobs = [
        one(seed, group_id, s)
        for seed, group_id in zip(task_seeds, group_ids, strict=True)
        for s in range(config.group_size)
    ]
    return list(await asyncio.gather(*jobs))


class RolloutRunner:
    """Rolls out `policy` on `config.env_id`. Reusable across batches and policy versions."""

    def __init__(self, policy: Policy, renderer: Renderer, config: EnvRolloutConfig):
        self.policy = policy
        self.renderer = renderer
        self.config = config
        limits = [
            config.context_length,
            getattr(policy, "max_seq_len", None),
            getattr(policy, "context_length", None),
        ]
        known = [int(n) for n in limits if isinstance(n, int)]
        self.context_length = min(known) if known else None
        # A wrong env id or kwargs is a configuration error, not an episode failure: fail now.
        try:
            gymnasium.make(config.env_id, **config.env_kwargs).close()
        except Exception as exc:
            raise ValueError(f"cannot make env {config.env_id!r} with {config.env_kwargs}: {exc}") from exc

    # ---- one episode ------------------------------------------------------------------------

    async def run_episode(self, task_seed: int, group_id: int = 0, sample_index: int = 0) -> Trajectory:
        state = _EpisodeState()
        started = time.perf_counter()
        timeout = self.config.episode_timeout_s
        try:
            await asyncio.wait_for(self._play(state, task_seed, sample_index), timeout)
            self._settle(state)
        except TimeoutError:
            state.end(StopReason.TIMEOUT, f"TimeoutError: episode exceeded the {timeout}s wall-clock limit")
        finally:
            if state.pending_step is not None and not state.pending_step.done():
                env = state.env  # cut off mid-step: close it when the step returns, in that thread
                state.pending_step.add_done_callback(lambda _: _close_quietly(env))
            elif state.env is not None:
                try:
                    state.env.close()
                except Exception as exc:
                    state.end(StopReason.ENV_ERROR, _describe(exc))
        trajectory = Trajectory(
            env_id=self.config.env_id,
            env_kwargs=dict(self.config.env_kwargs),
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
        )
        trajectory.metrics = episode_metrics(
            trajectory, time.perf_counter() - started, state.generate_s, state.env_s
        )
        context, rewrites = state.context, not keeps_all(state.policy)
        if rewrites:
            trajectory.context_policy = policy_spec(state.policy)
            trajectory.metrics[CONTEXT_REWRITES] = context.rewrites if context else 0
        if rewrites or not isinstance(self.renderer, ChatRenderer):  # plain ChatML alone never restarts
            restarts = context.template_restarts + context.rewrites if context else 0
            trajectory.metrics[SEQUENCE_RESTARTS] = restarts
        return trajectory

    def _settle(self, state: _EpisodeState) -> None:
        """Let the env settle an episode a runner limit ended (see the module doc)."""
        if state.env is None or not settles(state.stop_reason, state.transitions):
            return
        last = state.transitions[-1]
        tick = time.perf_counter()
        try:
            settled = abandon_env(state.env)
        except Exception as exc:
            last.info = {**last.info, "abandon_error": _describe(exc)}
            state.stop_reason, state.error = StopReason.ENV_ERROR, _describe(exc)
            return
        finally:
            state.env_s += time.perf_counter() - tick
        if settled is not None:
            reward, info = settled
            last.reward += reward
            last.info = {**last.info, **info}
            if "reward_components" in info:
                state.reward_components = info["reward_components"]

    async def _play(self, state: _EpisodeState, task_seed: int, sample_index: int) -> None:
        config, renderer = self.config, self.renderer
        tick = time.perf_counter()
        try:
            env = state.env = gymnasium.make(config.env_id, **config.env_kwargs)
            state.step_waits = bool(getattr(env.unwrapped, "step_waits", False))
            declared = getattr(env.unwrapped, "context_policy", None)  # the env's, unless configured
            state.policy = context_policy(config.context if config.context is not None else declared)
            observation, info, state.system_prompt = reset_env(env, task_seed)
            messages, tools = first_messages(renderer, observation, info, state.system_prompt)
            if tools is not None:
                state.reset_info = {k: info[k] for k in (TOOLS, INSTRUCTIONS) if k in info}
            context = state.context = _render(EpisodeContext, renderer, messages, tools, state.policy)
            observation_tokens = context.prompt
        except Exception as exc:
            return state.end(StopReason.ENV_ERROR, _describe(exc))
        history = list(observation_tokens)
        restarted: str | None = None
        state.env_s += time.perf_counter() - tick

        episode_seed = sampling_seed(config.seed, task_seed, sample_index)
        policy: Policy = self.policy
        if isinstance(policy, EpisodePolicyFactory):
            try:
                policy = policy.for_episode(env, episode_seed)
            except Exception as exc:
                return state.end(StopReason.ENV_ERROR, _describe(exc))

        for turn in range(config.max_turns):
            episode_left = config.max_tokens_per_episode - state.sampled_tokens
            room = None if self.context_length is None else self.context_length - len(history)
            if episode_left <= 0 or (room is not None and room <= 0):
                if turn > 0:  # the env's reply to the last action, never shown to the model
                    state.final_observation = observation
                return state.end(StopReason.MAX_TOKENS if episode_left <= 0 else StopReason.CONTEXT_OVERFLOW)
            budget = min(config.max_tokens_per_turn, episode_left)
            max_tokens = budget if room is None else min(budget, room)
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=config.sampling.temperature,
                top_p=config.sampling.top_p,
                top_k=config.sampling.top_k,
                stop_token_ids=renderer.stop_token_ids,
                seed=sampling_seed(episode_seed, turn),
            )
            completion = await self._generate(state, policy, history, params)
            if completion is None:
                return
            tick = time.perf_counter()
            try:
                shown = (observation, observation_tokens, restarted)
                turn_result = await self._step(state, env, context, turn, shown, completion, history)
            finally:
                state.env_s += time.perf_counter() - tick
            if turn_result is None:
                if completion.finish_reason == "length":
                    context_bound = room is not None and room < budget
                    state.end(StopReason.CONTEXT_OVERFLOW if context_bound else StopReason.MAX_TOKENS)
                return
            observation, observation_tokens, restarted = turn_result
        return state.end(StopReason.MAX_TURNS)  # unreachable unless max_turns == 0

    async def _step(
        self,
        state: _EpisodeState,
        env: gymnasium.Env,
        context: EpisodeContext,
        turn: int,
        shown: tuple[str, list[int], str | None],
        completion: Completion,
        history: list[int],
    ) -> tuple[str, list[int], str | None] | None:
        """Record the turn, step the env, render the delta (appended to `history`; a restarted
        rendering or a context rewrite replaces it). `shown` is what the model saw before this
        turn: (observation, observation tokens, None or why they restart the sequence: "template"
        or "rewrite"). Returns the next such triple, or None when the episode ends here (a turn
        cut by a token limit ends it without a stop reason: the caller knows which limit)."""
        observation, observation_tokens, restarted = shown
        if not completion.text and completion.tokens:  # a backend without a tokenizer
            completion.text = self.renderer.decode(completion.tokens, skip_special_tokens=True)
        transition = Transition(observation, observation_tokens, completion)
        if restarted:
            transition.info = {SEQUENCE_START: True}
            if restarted == "rewrite":
                transition.info[CONTEXT_REWRITE] = True
        state.transitions.append(transition)
        state.sampled_tokens += len(completion.tokens)
        history += completion.tokens
        if completion.finish_reason == "length":
            return None
        if completion.finish_reason == "abort":
            state.end(StopReason.TIMEOUT, "GenerationAborted: the engine aborted the request")
            return None
        # Nothing of the step is kept until all of it is usable: a bad output is an env error.
        try:
            observation, reward, terminated, truncated, info = await self._step_env(
                state, env, completion.text
            )
            ended = terminated or truncated or turn + 1 == self.config.max_turns
            delta, rewritten = None, False
            if not ended:
                replies = env_replies(self.renderer, observation, info, self.config.observation_role)
                delta, rewritten = _render(context.extend, completion.tokens, completion.text, replies, info)
        except Exception as exc:
            transition.info = {**transition.info, "error": _describe(exc)}
            state.end(StopReason.ENV_ERROR, _describe(exc))
            return None
        transition.reward = reward
        transition.terminated, transition.truncated = terminated, truncated
        transition.info = {**transition.info, **info} if transition.info else info
        if "reward_components" in info:
            state.reward_components = info["reward_components"]
        if delta is None:
            state.final_observation = observation
            state.end(env_stop_reason(info, terminated) if terminated or truncated else StopReason.MAX_TURNS)
            return None
        if delta.restarted:
            history[:] = delta.tokens
        else:
            history += delta.tokens
        return observation, delta.tokens, "rewrite" if rewritten else "template" if delta.restarted else None

    @staticmethod
    async def _step_env(
        state: _EpisodeState, env: gymnasium.Env, action: str
    ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """`step_env`, inline or (`state.step_waits`) in a worker thread (module doc)."""
        if not state.step_waits:
            return step_env(env, action)
        state.pending_step = _env_step_pool().submit(step_env, env, action)
        result = await asyncio.wrap_future(state.pending_step)
        state.pending_step = None
        return result

    async def _generate(
        self, state: _EpisodeState, policy: Policy, history: list[int], params: SamplingParams
    ) -> Completion | None:
        started = time.perf_counter()
        try:
            completions = await policy.generate([list(history)], params)
        except ContextOverflowError as exc:
            state.end(StopReason.CONTEXT_OVERFLOW, _describe(exc))
            return None
        except Exception as exc:
            state.end(StopReason.TIMEOUT, _describe(exc))
            return None
        finally:
            state.generate_s += time.perf_counter() - started
        if len(completions) != 1:
            state.end(StopReason.TIMEOUT, f"PolicyError: expected 1 completion, got {len(completions)}")
            return None
        return completions[0]

    # ---- many episodes ----------------------------------------------------------------------

    async def run_groups(
        self,
        task_seeds: Sequence[int],
        group_ids: Sequence[int] | None = None,
        on_episode: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """G episodes per task seed, all concurrently. Returns them group-major
        ([seed0 s0..s(G-1), seed1 s0, ...]); group_ids (default 0, 1, ...) name the groups.
        `on_episode` is called as each episode finishes (progress bars, streaming recorders)."""
        return await run_grouped(self.config, self.run_episode, task_seeds, group_ids, on_episode)

    def run(self, task_seeds: Sequence[int], **kwargs: Any) -> list[Trajectory]:
        """Synchronous wrapper around `run_groups` (not callable from inside a running loop)."""
        return asyncio.run(self.run_groups(task_seeds, **kwargs))
