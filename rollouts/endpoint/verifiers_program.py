"""verifiers environments (PyPI `verifiers`, the Environments Hub library) as agent programs.

`VerifiersProgram(taskset_id, ...)` holds one verifiers environment (its `EnvConfig`: a taskset
by id, optionally an `Env` by id, each with its args) and gives the two functions a config's
`[agent_program]` names: `run_agent(client, task)` plays one verifiers episode of `task` (a
taskset row) against the client's endpoint and returns verifiers' reward with its named parts,
and `task(seed)` picks the row. A user module of three lines wires it (docs/environments.md):

    from toolgym.rollouts.endpoint.verifiers_program import VerifiersProgram
    program = VerifiersProgram("my_taskset")
    run_agent, task = program.run_agent, program.task

How an episode runs: verifiers' own machinery end to end. Its env (`SingleAgentEnv` for a plain
taskset) runs its harness program in verifiers' `subprocess` runtime; the program talks to
verifiers' interception server, which relays every model call (streamed: verifiers asks with
`stream=true`) to the toolgym endpoint with the episode's `X-Conversation-Id`, so the endpoint
captures the episode's tokens exactly as it samples them (nothing is re-tokenised). The harness is
verifiers' tool-less/MCP chat program (its `null` harness), run by this interpreter instead of a
`uv`-built environment, so an episode needs no network (verifiers' own `null` harness would
`uv sync` its dependencies first). The trace's rewards come back as `AgentResult` components
(each reward's weighted value: verifiers' reward is their sum), its metrics as metrics; an env
with several traces per episode (best-of-n's attempts) gives each part's mean over its traces.

What is carried and what is not: docs/environments.md ("verifiers environments").
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Mapping
from typing import Any, cast

from .program import AgentResult

try:
    import verifiers.v1 as vf  # pyright: ignore[reportMissingImports]
    from verifiers.v1.configs.agent import agent_config_fields  # pyright: ignore[reportMissingImports]
    from verifiers.v1.harnesses.null.harness import (  # pyright: ignore[reportMissingImports]
        NullHarness,
        NullHarnessConfig,
    )
    from verifiers.v1.harnesses.utils.launch import (  # pyright: ignore[reportMissingImports]
        CHAT_PROGRAM_SOURCE,
        launch_chat_program,
    )
    from verifiers.v1.utils.loaders import (  # pyright: ignore[reportMissingImports]
        env_config_type,
        load_environment,
    )
except ImportError as exc:  # the `verifiers` extra
    raise ImportError(
        "toolgym.rollouts.endpoint.verifiers_program needs verifiers: pip install 'toolgym[verifiers]'"
    ) from exc

CONVERSATION_HEADER = "X-Conversation-Id"  # server.py's; the episode's capture
HARNESS_ID = "toolgym_verifiers_chat"  # the harness's plugin id (module name) in verifiers' loader


class LocalChatHarnessConfig(NullHarnessConfig):
    pass


class _ThisInterpreter:
    """A runtime whose `prepare_uv_script` writes the script and runs it with this interpreter:
    verifiers' chat program needs only verifiers' own dependencies, installed here."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(
        self, script: str | bytes, env: Any = None, *, activate: bool = True
    ) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = ".toolgym-verifiers-chat.py"
        await self._runtime.write(path, data)
        return [sys.executable, path]


class LocalChatHarness(NullHarness):
    """verifiers' `null` harness (its chat program: prompt, tool calls over MCP, turns until the
    model stops) run by this interpreter in the runtime, with no `uv` environment to build."""

    async def setup(self, runtime: Any) -> None:
        pass

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        tool_interception_url: str | None = None,
    ) -> Any:
        system_prompt, prompt = self.resolve_prompt(data)
        extra = [f"--tool-interception-url={tool_interception_url}"] if tool_interception_url else []
        return await launch_chat_program(
            CHAT_PROGRAM_SOURCE,
            self.config,
            ctx,
            trace,
            cast(Any, _ThisInterpreter(runtime)),  # the runtime, duck-typed: one method replaced
            endpoint,
            secret,
            mcp_urls,
            system_prompt,
            prompt,
            extra_args=extra,
        )


__all__ = ["LocalChatHarness"]  # verifiers' loader finds a harness module's one Harness here
# verifiers imports a harness by a top-level module name: this module answers to HARNESS_ID.
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])


class VerifiersProgram:
    """One verifiers environment as an agent program (module doc).

    taskset_id: the installed taskset module (`vf-eval`'s `--env.taskset.id`); taskset_args: its
    config's fields. env_id / env_args: a paired `Env` (verifiers' `best-of-n`, ...) and its
    config's fields (roles included). harness: the agent seat's harness config (default: the
    local chat harness above); runtime: its runtime config (default `subprocess`). model: the
    name sent to the endpoint (the endpoint serves one model whatever it is called)."""

    def __init__(
        self,
        taskset_id: str,
        taskset_args: Mapping[str, Any] | None = None,
        env_id: str = "",
        env_args: Mapping[str, Any] | None = None,
        harness: Mapping[str, Any] | None = None,
        runtime: Mapping[str, Any] | None = None,
        model: str = "toolgym",
    ) -> None:
        self.model = model
        seat = {
            "harness": dict(harness or {"id": HARNESS_ID}),
            "runtime": dict(runtime or {"type": "subprocess"}),
        }
        data: dict[str, Any] = {"taskset": {**(taskset_args or {}), "id": taskset_id}, **(env_args or {})}
        if env_id:
            data["id"] = env_id
        config_cls = env_config_type(taskset_id, env_id)
        for role in _roles(config_cls):
            data[role] = {**seat, **dict(data.get(role) or {})}
        self.config = config_cls.model_validate(data)
        self.env = load_environment(self.config)
        taskset = self.env.taskset
        self.tasks = list(taskset if taskset.bounded else taskset.take(10_000))
        if not self.tasks:
            raise ValueError(f"verifiers taskset {taskset_id!r} has no tasks")
        # The env's serving resources (interception server, shared tool servers) are the env's,
        # not an episode's: the first episode in flight opens them, the last one closes them.
        self._serving: contextlib.AsyncExitStack | None = None
        self._users = 0
        self._gate = asyncio.Lock()

    def task(self, seed: int) -> Any:
        """The taskset's row for a task seed (seeds past the end wrap)."""
        return self.tasks[seed % len(self.tasks)]

    async def run_agent(self, client: Any, task: Any) -> AgentResult:
        """One verifiers episode of `task` against `client`'s endpoint, captured under the client's
        conversation id (its API key); an episode verifiers marks failed raises (an
        infrastructure failure, never trained on)."""
        endpoint = vf.EvalClientConfig(
            base_url=str(client.base_url).rstrip("/"), headers={CONVERSATION_HEADER: str(client.api_key)}
        )
        ctx = vf.ModelContext(model=self.model, client=endpoint)
        async with self._served():
            episode = await self.env.run_episode(task, ctx)
        if not episode.ok:
            errors = [*episode.errors, *(e for t in episode.traces for e in _trace_errors(t))]
            summary = "; ".join(f"{e.type}: {e.message}" for e in errors)[:500]
            raise RuntimeError(f"the verifiers episode failed: {summary or 'no error recorded'}")
        # An env with several traces (best-of-n's attempts, a multi-agent env's seats) is one
        # toolgym episode: each reward and metric is its mean over the traces that carry it.
        rewards = [(n, r.value) for t in episode.traces for n, r in t.rewards.items() if r is not None]
        metrics = [(n, v) for t in episode.traces for n, v in t.metrics.items() if v is not None]
        components = _means(rewards)
        return AgentResult(reward=sum(components.values()), components=components, metrics=_means(metrics))

    @contextlib.asynccontextmanager
    async def _served(self):
        async with self._gate:
            if self._users == 0:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.env.serving())
                self._serving = stack
            self._users += 1
        try:
            yield
        finally:
            async with self._gate:
                self._users -= 1
                if self._users == 0 and self._serving is not None:
                    stack, self._serving = self._serving, None
                    await stack.aclose()


def _means(pairs: list[tuple[str, float]]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for name, value in pairs:
        sums.setdefault(name, []).append(float(value))
    return {name: sum(values) / len(values) for name, values in sums.items()}


def _roles(config_cls: type) -> list[str]:
    return list(agent_config_fields(config_cls.model_construct()))


def _trace_errors(trace: Any) -> list[Any]:
    return list(trace.errors)
