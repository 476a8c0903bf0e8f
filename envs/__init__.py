"""toolgym.envs: Gymnasium text environments with tools.

Importing this package registers the toolgym envs with Gymnasium:

    import gymnasium, toolgym.envs
    env = gymnasium.make("toolgym/Zorplex-v0", tier="compositional", difficulty="hard")
    question, info = env.reset(seed=0)   # info: system_prompt, question, answer, ...
    obs, reward, terminated, truncated, info = env.step("LOOKUP[apple]")

`list_envs()` lists the registered toolgym envs with their default keyword arguments.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import gymnasium

from .adapters import available_envs
from .base import Example, Task, TextEnv, ToolEnv
from .grading import Grade, exact, numeric, text
from .mcp import MCPServer, MCPServerError
from .shop import ShopEnv
from .spaces import UnicodeText
from .sum_digits import SumDigitsEnv
from .tools import Call, Tool, ToolError, ToolResult, tool
from .zorplex import ZorplexEnv

__all__ = [
    "Call",
    "Example",
    "Grade",
    "MCPServer",
    "MCPServerError",
    "ShopEnv",
    "SumDigitsEnv",
    "Task",
    "TextEnv",
    "Tool",
    "ToolEnv",
    "ToolError",
    "ToolResult",
    "UnicodeText",
    "ZorplexEnv",
    "exact",
    "list_envs",
    "numeric",
    "register_envs",
    "text",
    "tool",
]

NAMESPACE = "toolgym"
_ENVS = {
    f"{NAMESPACE}/Zorplex-v0": "toolgym.envs.zorplex:ZorplexEnv",
    f"{NAMESPACE}/SumDigits-v0": "toolgym.envs.sum_digits:SumDigitsEnv",
    f"{NAMESPACE}/Shop-v0": "toolgym.envs.shop:ShopEnv",
}
_ENVS.update(available_envs(NAMESPACE))  # the adapters whose library is installed (envs/adapters/)


def register_envs() -> None:
    """Register the toolgym envs (idempotent: ids already registered are left alone)."""
    for env_id, entry_point in _ENVS.items():
        if env_id not in gymnasium.registry:
            # No max_episode_steps: the env enforces its own max_turns (and reports why it ended).
            gymnasium.register(id=env_id, entry_point=entry_point)


def _constructor_defaults(cls: type) -> dict[str, Any]:
    """Keyword defaults of `cls.__init__` and of the base initialisers its **kwargs reach."""
    defaults: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None or klass is object or not issubclass(klass, TextEnv):
            continue
        for name, param in inspect.signature(init).parameters.items():
            if param.default is not inspect.Parameter.empty and name not in ("tools", "render_mode"):
                defaults[name] = param.default
    for code_only in ("instructions", "example", "grader"):  # set from code, not from a config
        defaults.pop(code_only, None)
    return defaults


def list_envs(include: set[str] | frozenset[str] = frozenset()) -> dict[str, dict[str, Any]]:
    """Registered `toolgym/` env ids, and the registered ids in `include` (a user's, any
    namespace), -> their default keyword arguments (registration kwargs win). An included id
    whose entry point cannot be resolved lists only its registration kwargs."""
    envs: dict[str, dict[str, Any]] = {}
    for env_id, spec in sorted(gymnasium.registry.items()):
        if spec.namespace != NAMESPACE and env_id not in include:
            continue
        entry = spec.entry_point
        try:
            if isinstance(entry, str):
                module_name, _, attr = entry.partition(":")
                entry = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            if spec.namespace == NAMESPACE:
                raise
            entry = None
        defaults = _constructor_defaults(entry) if isinstance(entry, type) else {}
        envs[env_id] = {**defaults, **spec.kwargs}
    return envs


register_envs()
