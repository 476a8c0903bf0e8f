"""toolgym.envs: Gymnasium text environments with tools.

Importing this package registers the toolgym envs with Gymnasium (registry.py):

    import gymnasium, toolgym.envs
    env = gymnasium.make("toolgym/Zorplex-v0", tier="compositional", difficulty="hard")
    question, info = env.reset(seed=0)   # info: system_prompt, question, answer, ...
    obs, reward, terminated, truncated, info = env.step("LOOKUP[apple]")

`list_envs()` lists the registered toolgym envs with their default keyword arguments.

Layout: core/ (the text env, Task, the tool env, the reward ledger, limits, prompt text, the info
contract, spaces, grading), tools/ (typed tools, tool-call formats, MCP, the code sandbox), tasks/
(Zorplex, SumDigits, Shop, PyCalc, CodeTests), adapters/ (libraries written elsewhere), registry.py
(registration).
"""

from __future__ import annotations

from .core.grading import Grade, Unreadable, exact, numeric, text
from .core.spaces import UnicodeText
from .core.task import Example, Task
from .core.text_env import TextEnv
from .core.tool_env import ToolEnv
from .registry import list_envs, register_envs
from .tasks.code_tests import CodeTestsEnv
from .tasks.pycalc import PyCalcEnv
from .tasks.shop import ShopEnv
from .tasks.sum_digits import SumDigitsEnv
from .tasks.zorplex import ZorplexEnv
from .tools.mcp import MCPServer, MCPServerError
from .tools.sandbox import Sandbox, SandboxConfig, SandboxSession, SandboxUnavailable, python_tool
from .tools.typed import Call, Tool, ToolError, ToolResult, tool

__all__ = [
    "Call",
    "CodeTestsEnv",
    "Example",
    "Grade",
    "MCPServer",
    "MCPServerError",
    "PyCalcEnv",
    "Sandbox",
    "SandboxConfig",
    "SandboxSession",
    "SandboxUnavailable",
    "ShopEnv",
    "SumDigitsEnv",
    "Task",
    "TextEnv",
    "Tool",
    "ToolEnv",
    "ToolError",
    "ToolResult",
    "UnicodeText",
    "Unreadable",
    "ZorplexEnv",
    "exact",
    "list_envs",
    "numeric",
    "python_tool",
    "register_envs",
    "text",
    "tool",
]

register_envs()
