"""Agent rollouts: the user's agent program, run G times per task against the endpoint, as the
training loop's episodes.

The user writes `async def run_agent(client: openai.AsyncOpenAI, task) -> float` (or an
`AgentResult` with named reward components and metrics, or a {name: value} dict of components
whose sum is the reward) in a module; a config's `[agent_program]` section names the module, the
function and, optionally, a function `task(seed) -> task` (default: the task is the seed).
`AgentRunner.run_groups` (what `collect_batch` calls, as it calls the env runner's) serves the
policy on a loopback endpoint (rollouts/endpoint/server.py) in the caller's event loop for the
batch, and runs every (task, sample) concurrently, each with its own client whose API key is its
conversation id, so its requests are captured into its own Trajectory (task seed, group, sample
index, the reward on its last turn). Groups, advantages and Episodes are then built as for env
rollouts (rollouts/batches.py).

One episode's failure is its own: a timeout (`rollout.episode_timeout_s`) ends it with TIMEOUT,
an exception in the agent with ENV_ERROR (the endpoint's refusal of a token or context limit:
MAX_TOKENS / CONTEXT_OVERFLOW, reward 0, trained on), a capture broken by a disconnect or a
generation error with TIMEOUT; TIMEOUT and ENV_ERROR are infrastructure failures, never trained
on, counted in `rollout/stop_reason/*` and `rollout/errors/*`. A cancelled client request frees
its engine slot.
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ...agents.chat import Renderer
from ...agents.policy import Policy
from ..batches import eval_seeds
from ..episode.config import EnvRolloutConfig, sampling_seed
from ..episode.loop import run_grouped
from ..evaluation import EvalConfig, EvalReport, eval_rollout
from ..metrics import BatchMetrics
from ..recording.replay import format_transcript
from ..types import StopReason, Trajectory
from .capture import CaptureInfo
from .program import AgentProgram, AgentResult, as_result, load_program
from .server import EndpointConfig, PolicyServer


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def shared_http_client() -> Any:
    """The HTTP client a batch's agents share (keep-alive connections, one pool): the `openai`
    package's aiohttp transport where aiohttp is installed, else its httpx one. Why aiohttp: the
    client's per-request CPU, which competes with the engine for the same cores, is markedly
    lower (bench/RESULTS.md, 'bench/serve.py'). Call it inside the event loop that will use it."""
    import openai

    try:
        return openai.DefaultAioHttpClient()
    except RuntimeError:  # openai without its aiohttp extra
        return openai.DefaultAsyncHttpxClient()


class AgentRunner:
    """Runs an agent program's episodes through the endpoint (module doc). Reusable across
    batches and policy versions; `run_groups` has the env runner's signature."""

    def __init__(self, policy: Policy, renderer: Renderer, program: AgentProgram, config: EnvRolloutConfig):
        self.policy, self.renderer, self.program, self.config = policy, renderer, program, config
        self.agent, self.make_task = load_program(program)
        self.last_server: PolicyServer | None = None  # the endpoint of the last batch (stats)

    def endpoint_config(self) -> EndpointConfig:
        c = self.config
        return EndpointConfig(
            max_n=max(c.group_size, 16),
            max_tokens_per_turn=c.max_tokens_per_turn,
            max_tokens_per_episode=c.max_tokens_per_episode,
            context_length=c.context_length,
            sampling=c.sampling,
        )

    async def run_episode(
        self,
        server: PolicyServer,
        task_seed: int,
        group_id: int = 0,
        sample_index: int = 0,
        http_client: Any = None,
    ) -> Trajectory:
        """One agent run on a serving `server`: its conversation, finished into a Trajectory.
        `http_client` (`shared_http_client()`) is shared by the episodes of a batch: each client
        of its own would build its own TLS context and connections, a cost per episode."""
        import openai

        cid = f"episode-{group_id}-{sample_index}-{uuid.uuid4().hex[:12]}"
        seed = sampling_seed(self.config.seed, task_seed, sample_index)
        info = CaptureInfo(
            label=self.program.label,
            task_seed=task_seed,
            group_id=group_id,
            sample_index=sample_index,
            sampling_seed=seed,
        )
        server.captures.register(cid, info)
        result, stop, error = AgentResult(reward=0.0), StopReason.ANSWERED, None
        client = openai.AsyncOpenAI(
            base_url=server.base_url,
            api_key=cid,
            max_retries=0,
            timeout=self.program.request_timeout_s,
            http_client=http_client,
        )
        timeout = self.config.episode_timeout_s
        try:
            task = self.make_task(task_seed) if self.make_task is not None else task_seed
            result = as_result(await asyncio.wait_for(self.agent(client, task), timeout))
        except TimeoutError:
            stop, error = (
                StopReason.TIMEOUT,
                f"TimeoutError: the agent exceeded the {timeout}s wall-clock limit",
            )
        except Exception as exc:
            stop, error = StopReason.ENV_ERROR, _describe(exc)
        finally:
            if http_client is None:  # its own connections; a shared client is closed by its owner
                await client.close()
        return server.captures.finish(
            cid,
            result.reward if error is None else 0.0,
            components=result.components,
            metrics={**result.components, **result.metrics},  # logged as rollout/<name>, eval/<name>
            stop_reason=stop,
            error=error,
            policy_version=self.policy.policy_version,
        )

    async def run_groups(
        self,
        task_seeds: Sequence[int],
        group_ids: Sequence[int] | None = None,
        on_episode: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """G agent runs per task seed, all concurrently (up to `max_concurrent_episodes`), against
        an endpoint served for this call. Group-major, as the env runner returns them."""
        if group_ids is not None and len(group_ids) != len(task_seeds):
            raise ValueError(f"{len(task_seeds)} task seeds but {len(group_ids)} group ids")
        http = shared_http_client()
        async with PolicyServer(self.policy, self.renderer, self.endpoint_config()) as server:
            self.last_server = server

            def run_episode(seed: int, group_id: int, sample: int) -> Any:
                return self.run_episode(server, seed, group_id, sample, http)

            try:
                return await run_grouped(self.config, run_episode, task_seeds, group_ids, on_episode)
            finally:
                await http.aclose()


async def evaluate_agent(runner: AgentRunner, config: EvalConfig | None = None) -> EvalReport:
    """The held-out eval of an agent program (rollouts/evaluation.py's, through the endpoint):
    the first `num_tasks` eval seeds, greedy by default, summarised under `eval/`."""
    config = config or EvalConfig()
    evaluator = copy.copy(runner)  # the same program and policy, the eval's sampling
    evaluator.config = eval_rollout(runner.config, config)
    started = time.perf_counter()
    seeds = eval_seeds(config.num_tasks)
    trajectories = await evaluator.run_groups(seeds, seeds)
    summary = BatchMetrics()
    for trajectory in trajectories:
        summary.add(trajectory)
    examples = [format_transcript(t, runner.renderer) for t in trajectories[: config.num_examples]]
    return EvalReport(
        metrics=summary.result(time.perf_counter() - started, prefix="eval/"),
        examples=examples,
        trajectories=trajectories,
    )
