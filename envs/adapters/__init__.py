"""Adapters for environment libraries written elsewhere, each an optional extra.

    toolgym/ReasoningGym-v0   reasoning-gym's procedural datasets (`pip install toolgym[reasoning-gym]`)
    toolgym/TextArena-v0      TextArena's text games (`pip install toolgym[textarena]`)
    toolgym/TextWorld-v0      TextWorld's generated text adventures (`pip install toolgym[textworld]`)
    toolgym/BFCL-v0           BFCL's multi-turn tool use (`pip install --no-deps bfcl-eval mpmath`:
                              an extra cannot install it, its dependencies pull CUDA torch)
    toolgym/OpenEnv-v0        an OpenEnv server's environment, over its WebSocket protocol
                              (`pip install toolgym[openenv]`)

`available_envs()` lists the ids whose library is installed (found without importing it, so
importing toolgym.envs stays fast); toolgym.envs registers exactly those. The adapter modules
import their library at the top: import one only when its library is there.
"""

from __future__ import annotations

import importlib.util

# env id suffix -> (the library's import name, the entry point)
ADAPTERS: dict[str, tuple[str, str]] = {
    "ReasoningGym-v0": ("reasoning_gym", "toolgym.envs.adapters.reasoning_gym:ReasoningGymEnv"),
    "TextArena-v0": ("textarena", "toolgym.envs.adapters.textarena:TextArenaEnv"),
    "BFCL-v0": ("bfcl_eval", "toolgym.envs.adapters.bfcl:BFCLEnv"),
    "TextWorld-v0": ("textworld", "toolgym.envs.adapters.textworld:TextWorldEnv"),
    "OpenEnv-v0": ("openenv", "toolgym.envs.adapters.openenv:OpenEnvEnv"),
}


def available_envs(namespace: str) -> dict[str, str]:
    """`{namespace}/<id>` -> entry point, for each adapter whose library is importable."""
    return {
        f"{namespace}/{name}": entry
        for name, (library, entry) in ADAPTERS.items()
        if importlib.util.find_spec(library) is not None
    }
