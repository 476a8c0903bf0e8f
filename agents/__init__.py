"""toolgym.agents."""
