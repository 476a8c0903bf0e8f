"""toolgym.trainers."""
