"""The episode's messages: the env's reset and replies as chat messages for the renderer.

Plain ChatML gets the system prompt and each observation as one `observation_role` message. A
renderer that writes tools itself (`renders_tools`: a model's chat template,
agents/chat_template.py) gets the env's tool specs (reset info `tools`) with its `instructions`
as the system message (both kept in `Trajectory.reset_info`, so replay renders the same prompt),
and one `tool` message per `info["tool_results"]` entry (else the observation; `env_replies`).
A step whose info names its own `observation_role` (the env speaking as the user mid-episode)
gets that role instead of the run's (`reply_role`: the one place that decides, for the runner,
replay and the chat export alike). The info keys are envs/core/info.py's. What a renderer cannot
encode is the env's fault (`rendered`: EnvOutputError), as is a malformed `tools`,
`tool_results` or `observation_role`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...agents.chat import Renderer
from ...agents.types import Message, Role
from ...envs.core.info import INSTRUCTIONS, OBSERVATION_ROLE, OBSERVATION_ROLES, TOOL_RESULTS, TOOLS
from ..env_io import EnvOutputError
from .context import ContextPolicyError
from .loop import describe


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


def reply_role(info: dict[str, Any], role: Role) -> Role:
    """The chat role of a step's observation: the step info's `observation_role` where the env
    names one, else `role` (rollout.observation_role). A value other than "user" or "tool" is
    the env's fault (EnvOutputError)."""
    named = info.get(OBSERVATION_ROLE)
    if named is None:
        return role
    if named not in OBSERVATION_ROLES:
        raise EnvOutputError(f"info['observation_role'] must be 'user' or 'tool', got {named!r:.80}")
    return named


def env_replies(renderer: Renderer, observation: str, info: dict[str, Any], role: Role) -> list[Message]:
    """The env's reply to an action as messages: one `tool` message per `info["tool_results"]`
    entry for a renderer that renders tools itself, else the observation in the step's role
    (`reply_role`: the info's `observation_role`, else `role`, rollout.observation_role)."""
    role = reply_role(info, role)
    results = info.get(TOOL_RESULTS) if renderer.renders_tools else None
    if not results:
        return [Message(role, observation)]
    if not isinstance(results, list) or not all(isinstance(r, str) for r in results):
        raise EnvOutputError(f"info['tool_results'] must be a list of str, got {results!r:.80}")
    return [Message("tool", r) for r in results]


def rendered(render: Callable[..., Any], *args: Any) -> Any:
    """`render(*args)`, a renderer's failure raised as EnvOutputError (the env's text cannot be
    encoded); a context policy's failure (ContextPolicyError) as it is."""
    try:
        return render(*args)
    except ContextPolicyError:
        raise
    except Exception as exc:
        raise EnvOutputError(f"the renderer cannot encode the env's text ({describe(exc)})") from exc
