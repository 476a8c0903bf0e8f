"""An agent program: the user's `async def run_agent(client, task)` and what it may return.

Cheap to import (no HTTP stack): the config schema names an agent program with `AgentProgram`
(a config's `[agent_program]` section); rollouts/endpoint/agent_runner.py runs it.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from ...envs.registry import import_env_modules
from ..env_io import MAX_ABS_REWARD


class AgentProgram(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A config's `[agent_program]`: where the agent is. Empty `module`: env rollouts."""

    module: str = ""  # imported (the current directory is importable), e.g. "my_agent"
    function: str = "run_agent"  # async def run_agent(client, task) -> float | AgentResult | dict
    task: str = ""  # a function of the module, seed -> task; "" = the task is the seed
    request_timeout_s: float = 120.0  # the client's per-request timeout

    def __post_init__(self) -> None:
        for name in (self.module, self.function, self.task):
            if name and not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"agent_program names modules and functions, got {name!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"agent_program.request_timeout_s must be > 0, got {self.request_timeout_s}")

    @property
    def label(self) -> str:
        """`module:function`: the Trajectories' env_id."""
        return f"{self.module}:{self.function}"


class AgentResult(msgspec.Struct, kw_only=True):
    """What an agent may return instead of a float: the reward, its named parts, its metrics
    (logged as `rollout/<name>`, as an env's are)."""

    reward: float
    components: dict[str, float] = msgspec.field(default_factory=dict)
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


def load_program(program: AgentProgram) -> tuple[Callable[..., Any], Callable[[int], Any] | None]:
    """(the agent function, the task function or None); ValueError in one line naming the key."""
    import_env_modules([program.module], where="agent_program.module")
    module = importlib.import_module(program.module)
    agent = getattr(module, program.function, None)
    if agent is None or not inspect.iscoroutinefunction(agent):
        raise ValueError(
            f"agent_program.function: {program.module} has no async function {program.function!r} "
            "(async def run_agent(client, task) -> float)"
        )
    task = getattr(module, program.task, None) if program.task else None
    if program.task and not callable(task):
        raise ValueError(f"agent_program.task: {program.module} has no function {program.task!r}")
    return agent, task


def as_result(value: Any) -> AgentResult:
    """An agent's return value as an AgentResult; TypeError/ValueError for one that is not."""
    if isinstance(value, AgentResult):
        result = value
    elif isinstance(value, Mapping):
        components = {str(k): float(v) for k, v in value.items()}
        result = AgentResult(reward=sum(components.values()), components=components)
    elif isinstance(value, bool | int | float):
        result = AgentResult(reward=float(value))
    else:
        raise TypeError(
            f"the agent returned {type(value).__name__}: return a float, an AgentResult or a dict"
        )
    numbers = [result.reward, *result.components.values(), *result.metrics.values()]
    if not all(isinstance(x, int | float) and math.isfinite(x) for x in numbers):
        raise ValueError(
            f"the agent's reward, components and metrics must be finite numbers, got {value!r:.80}"
        )
    rewards = [result.reward, *result.components.values()]
    if any(abs(x) > MAX_ABS_REWARD for x in rewards):
        raise ValueError(
            f"the agent's reward and components must be within ±{MAX_ABS_REWARD:g} (beyond, its group's "
            f"advantages overflow), got {value!r:.80}"
        )
    return result
