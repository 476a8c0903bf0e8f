"""toolgym.envs."""
