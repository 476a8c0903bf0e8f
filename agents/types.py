"""Records that cross the agents/ boundary: chat messages, sampling parameters, completions.

These are msgspec Structs so that they serialise to JSON/msgpack unchanged (recordings, RPC)
and hold no tensors.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "abort"]


class Message(msgspec.Struct, frozen=True):
    """One chat message. `role` is system, user, assistant or tool."""

    role: Role
    content: str


class SamplingParams(msgspec.Struct, frozen=True):
    """How to sample one request. Mirrors the subset of vLLM's SamplingParams that RL needs.

    temperature == 0 means greedy. top_k == 0 and top_p == 1.0 disable those filters.
    `seed` makes the request's samples reproducible (see the backend's docs for what is
    guaranteed across batch compositions). `n` samples share one prompt (and one prefill).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 disables), got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")


class Routes(msgspec.Struct, frozen=True):
    """The experts a mixture-of-experts model sent each of a sequence's first positions to:
    `experts` is int16 little-endian [positions, layers, top_k] in C order (layers: the MoE layers
    in order), -1 where none was recorded. The torch engine records them on request
    (agents/engine/routes.py); the trainer replays them (TrainerConfig.replay_routes)."""

    experts: bytes
    layers: int
    top_k: int

    def __post_init__(self) -> None:
        row = 2 * self.layers * self.top_k
        if self.layers < 1 or self.top_k < 1 or len(self.experts) % row:
            raise ValueError(
                f"Routes: {len(self.experts)} bytes is no whole number of positions of {self.layers} "
                f"layers x top {self.top_k} (int16)"
            )

    @property
    def positions(self) -> int:
        return len(self.experts) // (2 * self.layers * self.top_k)

    @classmethod
    def of(cls, experts: Any) -> Routes:
        """From an integer array [positions, layers, top_k] (numpy, or anything it reads)."""
        import numpy as np

        array = np.ascontiguousarray(experts, dtype="<i2")
        return cls(experts=array.tobytes(), layers=array.shape[1], top_k=array.shape[2])

    def array(self) -> Any:
        """The experts as a read-only numpy array int16 [positions, layers, top_k]."""
        import numpy as np

        return np.frombuffer(self.experts, dtype="<i2").reshape(self.positions, self.layers, self.top_k)


class Completion(msgspec.Struct):
    """What a policy returns for one sample of one request.

    tokens: the sampled token ids, verbatim, including the stop token when generation stopped on
        one (it was sampled, so it is trained on).
    logprobs: one per token: the sampler's log-probability of the token it sampled, under the
        distribution it actually sampled from (after temperature and top-k/top-p). For greedy
        requests (temperature 0) it is the log-probability under the unscaled distribution.
    finish_reason: "stop" (hit a stop token), "length" (hit max_tokens) or "abort".
    text: the decoded tokens (for humans and for envs; never re-encoded); the rollout runner sets
        it to its renderer's `action_text` (agents/chat.py).
    policy_version: the version of the weights that sampled the first token (the oldest).
    token_versions: per token, the version that sampled it, when new weights arrived while this
        sample ran (an engine with in-flight weight updates); [] means every token is
        `policy_version`.
    routes: a mixture of experts' routing of the whole sequence the model ran (the prompt, then
        every sampled token but the last), when the engine records it (`Routes`); else None.
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str = ""
    policy_version: int = 0
    token_versions: list[int] = msgspec.field(default_factory=list)
    routes: Routes | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(f"Completion has {len(self.tokens)} tokens but {len(self.logprobs)} logprobs")
        if self.token_versions and len(self.token_versions) != len(self.tokens):
            raise ValueError(
                f"Completion has {len(self.tokens)} tokens but {len(self.token_versions)} token_versions"
            )
