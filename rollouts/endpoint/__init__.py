"""The OpenAI-compatible endpoint over the policy and its token capture, and agent rollouts:
agent programs written against the `openai` client, trained through the endpoint.

- openai_api.py: the wire format (requests, errors, tool calls)
- capture.py: conversations captured token-exactly into Trajectories
- server.py: `PolicyServer` (FastAPI on uvicorn); `toolgym serve` is configs/cli/serve.py
- prompt_logprobs.py: `PromptScorer`, vLLM's `prompt_logprobs` from a checkpoint in float32
- program.py: `AgentProgram` (a config's `[agent_program]`), `AgentResult`
- agent_runner.py: `AgentRunner`, the agent program's episodes for the training loop

It lives in rollouts/ because a capture becomes Trajectories and Episodes (loss masks are made
only here) and tool calls are parsed with envs/tools/call_formats.py's JSON format. Importing this
package imports nothing heavy; the names below load their module (and FastAPI) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "AgentRunner": "agent_runner",
    "evaluate_agent": "agent_runner",
    "AgentProgram": "program",
    "AgentResult": "program",
    "CaptureInfo": "capture",
    "CaptureStore": "capture",
    "EndpointConfig": "server",
    "PolicyServer": "server",
}
if TYPE_CHECKING:
    from .agent_runner import AgentRunner, evaluate_agent
    from .capture import CaptureInfo, CaptureStore
    from .program import AgentProgram, AgentResult
    from .server import EndpointConfig, PolicyServer

__all__ = [
    "AgentProgram",
    "AgentResult",
    "AgentRunner",
    "CaptureInfo",
    "CaptureStore",
    "EndpointConfig",
    "PolicyServer",
    "evaluate_agent",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
