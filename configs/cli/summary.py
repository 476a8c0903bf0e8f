"""What the commands print about a batch of episodes: the summary table and an error-only
episode's cause (`toolgym record`, `replay`, `eval`)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ...rollouts.metrics import GROUP_PREFIX, env_metric_names
from ...rollouts.types import Trajectory


def error_text(trajectory: Trajectory) -> str:
    """What went wrong in an error-only episode: its error, else its stop reason."""
    steps = "" if trajectory.transitions else ", no steps"
    return trajectory.error or f"stop reason {trajectory.stop_reason.value}{steps}"


def print_summary(console: Console, metrics: dict[str, float], title: str) -> None:
    table = Table("metric", "value", title=title)
    for key in ("episodes", "reward_mean", *env_metric_names(metrics, ""), "turns_mean", "tokens_generated"):
        if key in metrics:
            table.add_row(key, f"{metrics[key]:.4g}")
    for key, value in metrics.items():
        if key.startswith(("stop_reason/", "failure_mode/")) and value > 0:
            table.add_row(key, f"{value:.3f}")
        elif key.startswith("errors"):
            table.add_row(key, f"{value:g}")
        elif key.startswith(GROUP_PREFIX):  # the env's metric groups (BFCL's categories)
            table.add_row(key, f"{value:.4g}")
    console.print(table)

