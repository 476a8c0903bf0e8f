"""Shared by the tests that need the code sandbox: skip cleanly where bubblewrap cannot run,
unless TOOLGYM_REQUIRE_SANDBOX is set (CI sets it, so a missing bubblewrap fails loudly there)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import gymnasium
import pytest

from toolgym.envs import Sandbox, SandboxConfig, SandboxUnavailable


def sandbox_missing(why: str) -> NoReturn:
    if os.environ.get("TOOLGYM_REQUIRE_SANDBOX"):
        pytest.fail(f"TOOLGYM_REQUIRE_SANDBOX is set but the sandbox cannot start: {why}")
    pytest.skip(f"the sandbox cannot start ({why}); install bubblewrap, e.g. `apt-get install -y bubblewrap`")


def start_sandbox(config: SandboxConfig | None = None) -> Sandbox:
    try:
        return Sandbox(config)
    except SandboxUnavailable as exc:
        sandbox_missing(str(exc))


# Envs that need a server to exist: the one the generic tests play (by default kwargs).
SERVED_ENVS: dict[str, dict[str, Any]] = {
    "toolgym/OpenEnv-v0": {
        "command": [
            sys.executable,
            str(Path(__file__).parent / "adapters" / "openenv_servers.py"),
            "guess",
            "{port}",
        ]
    },
}


def make_env(env_id: str, **kwargs: Any) -> gymnasium.Env:
    """gymnasium.make, skipping (as above) an env whose sandbox cannot start; an env that needs a
    server gets one of the test servers (SERVED_ENVS) unless kwargs are given."""
    if not kwargs:
        kwargs = dict(SERVED_ENVS.get(env_id, {}))
    try:
        return gymnasium.make(env_id, **kwargs)
    except SandboxUnavailable as exc:
        sandbox_missing(str(exc))
