"""Errors a policy backend raises that callers (rollouts) map to outcomes."""

from __future__ import annotations


class ContextOverflowError(ValueError):
    """A prompt does not fit the backend's context window (no room left to generate a token).

    Rollouts map it to StopReason.context_overflow. `prompt_len` and `max_seq_len` say by how much.
    """

    def __init__(self, message: str, *, prompt_len: int, max_seq_len: int) -> None:
        super().__init__(message)
        self.prompt_len = prompt_len
        self.max_seq_len = max_seq_len


__all__ = ["ContextOverflowError"]
