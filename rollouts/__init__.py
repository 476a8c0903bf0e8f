"""toolgym.rollouts."""
