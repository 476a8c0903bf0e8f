"""The OpenAI-compatible endpoint over the policy and its token capture, and agent rollouts:
agent programs written against the `openai` client, trained through the endpoint.

- openai_api.py: the wire format (requests, errors, tool calls)
- capture.py: conversations captured token-exactly into Trajectories
- server.py: `PolicyServer` (FastAPI on uvicorn) and `toolgym serve`
- agent_runner.py: `AgentRunner`, the agent program's episodes for the training loop

It lives in rollouts/ because a capture becomes Trajectories and Episodes (loss masks are made
only here) and tool calls are parsed with envs/tool_calls.py's JSON format.
"""

from .agent_runner import AgentProgram, AgentResult, AgentRunner, evaluate_agent
from .capture import CaptureInfo, CaptureStore
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
