"""What the runner takes to roll out one env (`EnvRolloutConfig`) and the sampling seeds derived
from it (`sampling_seed`).

Sampling seeds: each turn's SamplingParams.seed is derived from (config.seed, task seed, sample
index, turn), so the G samples of a group differ and a rerun reproduces them.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ..types import PolicySampling, RolloutSettings


class EnvRolloutConfig(RolloutSettings, frozen=True, kw_only=True):
    """What the runner takes to roll out one env: the env-independent `RolloutSettings` plus
    the env id and kwargs, the policy's sampling and the seed (in a run config these come from
    `[rollout]`, `[env]`, `[policy]` and `run.seed`: `Config.rollout_config()`)."""

    env_id: str
    env_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    sampling: PolicySampling = msgspec.field(default_factory=PolicySampling)
    seed: int = 0  # mixed into every per-turn sampling seed

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seed < 0:
            raise ValueError(f"EnvRolloutConfig.seed must be >= 0, got {self.seed}")

    @classmethod
    def build(
        cls,
        settings: RolloutSettings,
        env_id: str,
        env_kwargs: dict[str, Any] | None = None,
        sampling: PolicySampling | None = None,
        seed: int = 0,
    ) -> EnvRolloutConfig:
        """`settings` with the env, sampling and seed (the settings' fields, by name: no copy of
        the declaration)."""
        return cls(
            **{name: getattr(settings, name) for name in RolloutSettings.__struct_fields__},
            env_id=env_id,
            env_kwargs=dict(env_kwargs or {}),
            sampling=PolicySampling.of(sampling) if sampling is not None else PolicySampling(),
            seed=seed,
        )


def sampling_seed(*parts: int) -> int:
    """A 31-bit seed mixed from non-negative ints (SeedSequence hashing: no collisions by
    arithmetic coincidence, unlike sums or products)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint32)[0] >> 1)
