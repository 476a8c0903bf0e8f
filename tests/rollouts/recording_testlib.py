"""Recordings for the trace tests (viewer, schema, export/import): real envs played by the oracle
with the shipped tokenizer, sampler logprobs and policy versions filled in so shading has
something to show. Imported by name (tests/rollouts is on sys.path)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import msgspec
import numpy as np

from toolgym.agents.chat import ChatRenderer
from toolgym.agents.tokenizer import load_tokenizer, tokenizer_fingerprint
from toolgym.configs.cli.main import DEFAULT_TOKENIZER
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.recording.format import RecordingHeader, RecordingWriter
from toolgym.rollouts.scripted import OracleConfig, OraclePolicy
from toolgym.rollouts.types import RolloutSettings, Trajectory


@cache
def shipped_renderer() -> ChatRenderer:
    return ChatRenderer(load_tokenizer(DEFAULT_TOKENIZER))


def play(
    env_id: str,
    seeds: list[int],
    group_size: int = 2,
    env_kwargs: dict | None = None,
    oracle: OracleConfig | None = None,
    policy_version: int = 0,
) -> list[Trajectory]:
    """Oracle episodes of `env_id`, with made-up sampler logprobs (seeded) and `policy_version`."""
    renderer = shipped_renderer()
    config = EnvRolloutConfig.build(RolloutSettings(group_size=group_size), env_id=env_id, env_kwargs=env_kwargs or {})
    runner = RolloutRunner(OraclePolicy(renderer, oracle or OracleConfig(p_omit_tag=0.5)), renderer, config)
    trajectories = runner.run(seeds)
    rng = np.random.default_rng(0)
    out = []
    for t in trajectories:
        transitions = [
            msgspec.structs.replace(
                tr,
                action=msgspec.structs.replace(
                    tr.action,
                    logprobs=[float(-x) for x in rng.exponential(0.7, len(tr.action.tokens))],
                    policy_version=policy_version,
                ),
            )
            for tr in t.transitions
        ]
        out.append(msgspec.structs.replace(t, transitions=transitions, policy_version=policy_version))
    return out


def write(path: Path, trajectories: list[Trajectory], env_id: str, env_kwargs: dict | None = None) -> Path:
    header = RecordingHeader(
        tokenizer_fingerprint=tokenizer_fingerprint(shipped_renderer().tokenizer),
        env_id=env_id,
        env_kwargs=env_kwargs or {},
        policy_id="oracle",
    )
    with RecordingWriter(path, header) as writer:
        writer.write_all(trajectories)
    return path
