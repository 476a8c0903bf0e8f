"""The toolgym envs' Gymnasium registration, and the checks on env ids and env modules.

`register_envs()` registers `toolgym/*` (the shipped tasks, and the adapters whose library is
installed); `list_envs()` lists them with the keyword arguments they take and the value each has
when not given (read from the source, nothing is made). `import_env_modules`
imports the modules a user names (which register their own envs) and `check_env_id` refuses an
id whose `module:` gymnasium would import: config loading, replay and serving use both.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
import textwrap
from collections.abc import Iterable
from typing import Any

import gymnasium

from .adapters import available_envs
from .core.text_env import TextEnv
from .core.tool_env import ToolEnv

NAMESPACE = "toolgym"
_ENVS = {
    f"{NAMESPACE}/Zorplex-v0": "toolgym.envs.tasks.zorplex:ZorplexEnv",
    f"{NAMESPACE}/SumDigits-v0": "toolgym.envs.tasks.sum_digits:SumDigitsEnv",
    f"{NAMESPACE}/Shop-v0": "toolgym.envs.tasks.shop:ShopEnv",
    f"{NAMESPACE}/PyCalc-v0": "toolgym.envs.tasks.pycalc:PyCalcEnv",
    f"{NAMESPACE}/CodeTests-v0": "toolgym.envs.tasks.code_tests:CodeTestsEnv",
    f"{NAMESPACE}/Nim-v0": "toolgym.envs.tasks.nim:NimEnv",
}
_ENVS.update(available_envs(NAMESPACE))  # the adapters whose library is installed (envs/adapters/)


def register_envs() -> None:
    """Register the toolgym envs (idempotent: ids already registered are left alone)."""
    for env_id, entry_point in _ENVS.items():
        if env_id not in gymnasium.registry:
            # No max_episode_steps: the env enforces its own max_turns (and reports why it ended).
            gymnasium.register(id=env_id, entry_point=entry_point)


def _fixed_in_super_call(init: Any) -> set[str]:
    """The keywords an `__init__` passes to `super().__init__` by name (`tool_format="json"`):
    the class fixes them, so they are not knobs of its own (passing one again would be a
    TypeError, "multiple values"). Empty when the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError, SyntaxError):
        return set()
    fixed = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "__init__"
            and isinstance(node.func.value, ast.Call)
            and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "super"
        ):
            fixed.update(kw.arg for kw in node.keywords if kw.arg is not None)
    return fixed


def _set_by_default(init: Any, kwargs_name: str) -> dict[str, Any]:
    """The knobs an `__init__` gives a value of its own when the caller did not: each statement
    `<kwargs_name>.setdefault("knob", <literal>)` in the function's body itself (not under an
    `if` or a loop, so it always runs). A value that is not a literal (code, `numeric()`) is not
    read. Empty when the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError, SyntaxError):
        return {}
    function = tree.body[0] if tree.body else None
    if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        return {}
    values: dict[str, Any] = {}
    for statement in function.body:
        call = statement.value if isinstance(statement, ast.Expr) else None
        if not (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "setdefault"
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == kwargs_name
            and len(call.args) == 2
            and isinstance(call.args[0], ast.Constant)
            and isinstance(call.args[0].value, str)
        ):
            continue
        try:
            values[call.args[0].value] = ast.literal_eval(call.args[1])
        except (ValueError, TypeError, SyntaxError, RecursionError):
            continue
    return values


def _constructor_defaults(cls: type) -> dict[str, Any]:
    """Keyword defaults of `cls.__init__` and of the base initialisers its **kwargs reach, as the
    env takes them: a subclass's `kwargs.setdefault("knob", value)` replaces the base's default
    (`_set_by_default`), and the knobs a subclass fixes in its call to the base are left out
    (`_fixed_in_super_call`)."""
    defaults: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None or klass is object or not issubclass(klass, TextEnv):
            continue
        own = inspect.signature(init).parameters
        for name, param in own.items():
            if param.default is not inspect.Parameter.empty and name not in ("tools", "render_mode"):
                defaults[name] = param.default
        if klass not in (TextEnv, ToolEnv):  # a subclass's own super() call
            for name in _fixed_in_super_call(init) - set(own):
                defaults.pop(name, None)
            kwargs = next((p.name for p in own.values() if p.kind is p.VAR_KEYWORD), None)
            if kwargs is not None:
                for name, value in _set_by_default(init, kwargs).items():
                    if name not in own:
                        defaults[name] = value
    for code_only in ("instructions", "example", "grader"):  # set from code, not from a config
        defaults.pop(code_only, None)
    return defaults


def list_envs(include: set[str] | frozenset[str] = frozenset()) -> dict[str, dict[str, Any]]:
    """Registered `toolgym/` env ids, and the registered ids in `include` (a user's, any
    namespace), -> their default keyword arguments as the env takes them
    (`_constructor_defaults`; registration kwargs win). An included id whose entry point cannot
    be resolved lists only its registration kwargs."""
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


# ---- env ids and env modules that data or a user names ---------------------------------------


class EnvModuleNotAllowed(ValueError):
    """A recorded env id whose module is not imported: making it would import code named by data.
    str() is one line naming the module and the flag that allows it."""


def check_env_id(env_id: str) -> None:
    """Raise EnvModuleNotAllowed if `gymnasium.make(env_id)` would import a module (an id
    `module:Env-v0` whose module is not imported yet); a registered id, or one whose module is
    already imported, passes. Registered ids import only what their registering code named."""
    module = env_id.split(":", 1)[0] if ":" in env_id else None
    if module is not None and module not in sys.modules:
        raise EnvModuleNotAllowed(
            f"env id {env_id!r} needs module {module!r}, which is not imported: a recording never "
            f"imports code; if you trust that module, allow it with --env-module {module}"
        )


def import_env_modules(modules: Iterable[str], where: str = "--env-module") -> None:
    """Import the modules the user named (`--env-module`, a config's `env.module`), which
    register their envs with gymnasium. The current directory is importable, as under
    `python -m` (appended to sys.path when missing: the `toolgym` script's sys.path[0] is its own
    folder), so it never shadows an installed package. Raises ValueError (one line, naming
    `where` and the module) for one that cannot be imported or raises while importing."""
    modules = list(modules)
    if modules and "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"{where} {module}: cannot import it: {exc}") from None
        except Exception as exc:  # the module itself failed (a syntax error, a duplicate id, ...)
            raise ValueError(f"{where} {module}: cannot import it: {type(exc).__name__}: {exc}") from None
