"""How rollouts talk to an env: its outputs checked before anything of them is kept.

The runner and replay (`toolgym replay --verify`) call an env only through these, so both see the
same thing: an env output the runner cannot use (text that is not an encodable str, a reward that
is not a finite number within ±1e30, an info that is not a dict, reward_components or metrics that are not
name -> finite number with usable names (envs/core/info.py), end flags that are not bools) raises
EnvOutputError naming it, and ends only that episode (ENV_ERROR). NaN or inf rewards matter
most: one would make its whole group's advantages NaN.

An info is kept as plain JSON-able data, since recordings write it to disk: numpy scalars and
arrays (common in Gymnasium envs) become their Python values, an object JSON has no type for
(or key) becomes its repr, and the rest is what the recording reads back (tuples as lists, keys
as strings, NaN as None); an info that still cannot be written (one that holds itself) is an
EnvOutputError.

Settling (`abandon_env`, `settles`): when a limit of the runner's (a token or context budget, its
own turn limit) ends an episode the env has not ended, the env's `abandon()` hook (declared on
TextEnv, envs/core/text_env.py; a ToolEnv settles it as unanswered, envs/core/tool_env.py) gives
what it scores, as the env's own limits would have.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import gymnasium
import msgspec
import numpy as np

from ..envs.core.info import END_REASON, METRICS, REWARD_COMPONENTS, SYSTEM_PROMPT
from ..envs.core.text_env import env_hooks
from .metrics import component_name_problem, metric_name_problem
from .types import StopReason, Transition

# The runner's own limits: when one ends an episode the env has not ended, the env settles it.
SETTLED_STOP_REASONS = frozenset({StopReason.MAX_TOKENS, StopReason.CONTEXT_OVERFLOW, StopReason.MAX_TURNS})


class EnvOutputError(ValueError):
    """An env returned something the runner cannot use; it ends only that episode (ENV_ERROR)."""


def _check_text(what: str, value: Any) -> str:
    if not isinstance(value, str):
        raise EnvOutputError(f"{what} must be a str, got {type(value).__name__} {value!r:.80}")
    try:  # a lone surrogate (text decoded with errors="surrogateescape") has no UTF-8 bytes
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EnvOutputError(
            f"{what} is not encodable text ({exc.reason} at index {exc.start}): {value!r:.80}"
        ) from None
    return value


def _check_number(what: str, value: Any) -> float:
    # NaN/inf would turn the whole group's advantages into NaN (and the trainer skips the step)
    try:
        number = math.nan if isinstance(value, str | bytes) else float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise EnvOutputError(f"{what} must be a finite number, got {value!r:.80}")
    return number


# A reward beyond this overflows its group's advantage arithmetic (sums and squares in float64, the
# advantages in the trainer's float32); NaN or inf would poison the group the same way.
MAX_ABS_REWARD = 1e30


def _check_reward(what: str, value: Any) -> float:
    number = _check_number(what, value)
    if abs(number) > MAX_ABS_REWARD:
        raise EnvOutputError(
            f"{what} must be within ±{MAX_ABS_REWARD:g} (beyond, its group's advantages overflow), got {number!r:.80}"
        )
    return number


def _check_flag(what: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise EnvOutputError(f"{what} must be a bool, got {type(value).__name__} {value!r:.80}")
    return bool(value)


def _plain(value: Any) -> Any:
    """msgspec's hook for what JSON has no type for (see the module doc)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return repr(value)


_INFO_ENCODER = msgspec.json.Encoder(enc_hook=_plain)


def _check_info(what: str, info: Any) -> dict[str, Any]:
    if not isinstance(info, Mapping):
        raise EnvOutputError(f"{what} must be a dict, got {type(info).__name__} {info!r:.80}")
    info = dict(info)
    if REWARD_COMPONENTS in info:
        components = info[REWARD_COMPONENTS]
        if not isinstance(components, Mapping) or not all(isinstance(k, str) for k in components):
            raise EnvOutputError(
                f"info['reward_components'] must map names to numbers, got {components!r:.80}"
            )
        for name in components:
            if (problem := component_name_problem(name)) is not None:
                raise EnvOutputError(f"info['reward_components']: {problem}")
        info[REWARD_COMPONENTS] = {
            name: _check_reward(f"info['reward_components'][{name!r}]", v) for name, v in components.items()
        }
    if METRICS in info:
        reported = info[METRICS]
        if not isinstance(reported, Mapping):
            raise EnvOutputError(f"info['metrics'] must map names to numbers, got {reported!r:.80}")
        for name in reported:
            if (problem := metric_name_problem(name)) is not None:
                raise EnvOutputError(f"info['metrics']: {problem}")
        info[METRICS] = {
            name: _check_number(f"info['metrics'][{name!r}]", v) for name, v in reported.items()
        }
    try:  # exactly what a recording of it reads back
        return msgspec.json.decode(_INFO_ENCODER.encode(info))
    except (TypeError, ValueError, RecursionError) as exc:  # e.g. an info that holds itself
        raise EnvOutputError(f"{what} cannot be recorded as JSON ({exc}): {info!r:.80}") from None


class AsyncEnv(Protocol):
    """An env stepped by awaiting coroutines (one seat of a game, envs/core/seats.py)."""

    async def reset_async(self, seed: int) -> tuple[Any, dict[str, Any]]: ...

    async def step_async(self, action: str) -> tuple[Any, Any, Any, Any, dict[str, Any]]: ...


def async_env(env: gymnasium.Env) -> AsyncEnv | None:
    """`env` (unwrapped) when it is stepped by awaiting its `reset_async(seed)` and
    `step_async(action)` rather than `reset`/`step`; else None."""
    unwrapped = env.unwrapped
    if callable(getattr(unwrapped, "reset_async", None)) and callable(getattr(unwrapped, "step_async", None)):
        return cast(AsyncEnv, unwrapped)
    return None


def reset_env(env: gymnasium.Env, seed: int) -> tuple[str, dict[str, Any], str]:
    """`env.reset(seed=seed)`, its outputs checked: (observation, info, system prompt).

    Raises what the env raises, or EnvOutputError naming the output the runner cannot use."""
    return checked_reset(env.reset(seed=seed))


def checked_reset(outputs: Any) -> tuple[str, dict[str, Any], str]:
    """A reset's (observation, info) checked, as `reset_env` returns them."""
    observation, raw_info = outputs
    info = _check_info("reset info", raw_info)
    system_prompt = raw_info.get(SYSTEM_PROMPT)  # as the env gave it (JSON would take bytes)
    system_prompt = "" if system_prompt is None else _check_text("info['system_prompt']", system_prompt)
    return _check_text("reset observation", observation), info, system_prompt


def step_env(env: gymnasium.Env, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    """`env.step(action)`, its outputs checked and converted (info["reward_components"] to
    name -> float). Raises what the env raises, or EnvOutputError naming the unusable output."""
    return checked_step(env.step(action))


def checked_step(outputs: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
    """A step's five outputs checked and converted, as `step_env` returns them."""
    observation, reward, terminated, truncated, info = outputs
    return (
        _check_text("observation", observation),
        _check_reward("reward", reward),
        _check_flag("terminated", terminated),
        _check_flag("truncated", truncated),
        _check_info("info", info),
    )


def abandon_env(env: gymnasium.Env) -> tuple[float, dict[str, Any]] | None:
    """The env's `abandon()` hook (see the module doc), its outputs checked; None when the env has
    nothing to settle. Raises what it raises, or EnvOutputError naming the unusable output."""
    settled: Any = env_hooks(env).abandon()
    if settled is None:
        return None
    reward, info = settled
    return _check_reward("abandon() reward", reward), _check_info("abandon() info", info)


def settles(stop_reason: StopReason | None, transitions: Sequence[Transition]) -> bool:
    """Whether the runner asks the env to settle an episode (`abandon_env`): a limit of the
    runner's ended it while the env had not, and it has a transition to carry the reward."""
    if stop_reason not in SETTLED_STOP_REASONS or not transitions:
        return False
    return not (transitions[-1].terminated or transitions[-1].truncated)


def env_stop_reason(info: dict[str, Any], terminated: bool) -> StopReason:
    """The StopReason of an episode the env ended: its info's end_reason, else by the flag."""
    try:
        return StopReason(info.get(END_REASON))
    except ValueError:
        return StopReason.ANSWERED if terminated else StopReason.MAX_TURNS


__all__ = [
    "SETTLED_STOP_REASONS",
    "EnvOutputError",
    "abandon_env",
    "env_stop_reason",
    "reset_env",
    "settles",
    "step_env",
]
