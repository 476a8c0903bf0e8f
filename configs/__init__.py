"""toolgym.configs."""
