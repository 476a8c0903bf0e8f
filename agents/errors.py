"""Errors a policy backend raises that callers (rollouts) map to outcomes, and how a backend hands
a result or an error to a caller's future."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


class ContextOverflowError(ValueError):
    """A prompt does not fit the backend's context window (no room left to generate a token).

    Rollouts map it to StopReason.context_overflow. `prompt_len` and `max_seq_len` say by how much.
    """

    def __init__(self, message: str, *, prompt_len: int, max_seq_len: int) -> None:
        super().__init__(message)
        self.prompt_len = prompt_len
        self.max_seq_len = max_seq_len


def checked_prompt(
    index: int, prompt: Sequence[int], *, max_seq_len: int, vocab_size: int, limit_name: str = "max_seq_len"
) -> list[int]:
    """`prompt` as a list of ints, or the error a backend raises for it: empty, no room left to
    generate (ContextOverflowError; `limit_name` is the backend's name for `max_seq_len`), or a
    token id outside the vocabulary. `index` is its position in the request, for the message."""
    tokens = [int(t) for t in prompt]
    if not tokens:
        raise ValueError(f"prompt {index} is empty")
    if len(tokens) >= max_seq_len:
        raise ContextOverflowError(
            f"prompt {index} has {len(tokens)} tokens; {limit_name} {max_seq_len} leaves no room to generate",
            prompt_len=len(tokens),
            max_seq_len=max_seq_len,
        )
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        raise ValueError(f"prompt {index} has token ids outside [0, {vocab_size})")
    return tokens


def resolve_future(
    future: concurrent.futures.Future, result: Any = None, exception: BaseException | None = None
) -> None:
    """Complete a caller's future unless it is already done. Never raises: the caller may cancel
    it (a timeout) from its own thread at any moment, even between a done() check and a set."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)


def checked_weights(
    named_tensors: Iterable[tuple[str, Any]], parameters: Mapping[str, Any], model_type: str
) -> list:
    """`named_tensors` as a list, or the error a backend's `load_weights` raises before copying
    anything: a name not in `parameters` (KeyError) or a shape that differs (ValueError)."""
    updates = list(named_tensors)
    for name, tensor in updates:
        param = parameters.get(name)
        if param is None:
            raise KeyError(f"load_weights: unknown parameter {name!r} for {model_type}")
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
    return updates


__all__ = ["ContextOverflowError", "checked_prompt", "checked_weights", "resolve_future"]
