"""`toolgym plot RUN_DIR`: PNG curves from a run's metrics.jsonl (matplotlib, no display needed).

One PNG per quantity over RL steps: reward, accuracy, tag rate (training batches as a line, the
held-out evals as markers), entropy and KL to the sampler (the trainer's); `curves.png` puts them
side by side, with the SFT loss when the run had an SFT phase.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # no pyplot: no global backend state, no display

from .metrics_log import read_metrics
from .run_dir import METRICS_FILE

# (file stem, title, train-record key, eval-record key or None, extra train keys)
PANELS: tuple[tuple[str, str, str, str | None, tuple[str, ...]], ...] = (
    ("reward", "reward", "rollout/reward_mean", "eval/reward_mean", ()),
    ("accuracy", "accuracy", "rollout/accuracy", "eval/accuracy", ()),
    ("tag_rate", "[ANSWER] tag rate", "rollout/tag_rate", "eval/tag_rate", ()),
    ("entropy", "entropy (sampled tokens)", "train/entropy", None, ()),
    ("kl", "KL (trainer vs sampler, k3)", "train/sampler_kl_k3", None, ("train/kl_ref",)),
)


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            xs.append(float(r.get("step", 0)))
            ys.append(float(value))
    return xs, ys


def _draw(
    ax: Any,
    title: str,
    train: list[dict],
    evals: list[dict],
    key: str,
    eval_key: str | None,
    extra: tuple[str, ...],
) -> bool:
    drawn = False
    for k in (key, *extra):
        xs, ys = _series(train, k)
        if xs:
            ax.plot(
                xs, ys, label=f"train ({k.split('/', 1)[1]})" if extra else "train batches", linewidth=1.2
            )
            drawn = True
    if eval_key is not None:
        xs, ys = _series(evals, eval_key)
        if xs:
            ax.plot(xs, ys, "o-", label="held-out eval", markersize=4, linewidth=1.0)
            drawn = True
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    return drawn


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the PNGs; returns their paths. Raises FileNotFoundError without metrics, and
    NotADirectoryError when `out_dir` is a file."""
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(f"{run_dir} has no {METRICS_FILE}: not a toolgym run directory")
    records = read_metrics(metrics)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    sft = [r for r in records if r.get("kind") == "sft" and int(r.get("step", 0)) > 0]
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    if out.exists() and not out.is_dir():  # mkdir would say only "File exists"
        raise NotADirectoryError(errno.ENOTDIR, "not a directory (the plots go in a folder)", str(out))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, title, key, eval_key, extra in PANELS:
        fig = Figure(figsize=(6, 4), layout="constrained")
        _draw(fig.add_subplot(), title, train, evals, key, eval_key, extra)
        fig.savefig(out / f"{stem}.png", dpi=100)
        written.append(out / f"{stem}.png")

    panels = len(PANELS) + bool(sft)
    columns = 3
    rows = -(-panels // columns)
    fig = Figure(figsize=(5 * columns, 3.6 * rows), layout="constrained")
    for i, (_, title, key, eval_key, extra) in enumerate(PANELS):
        _draw(fig.add_subplot(rows, columns, i + 1), title, train, evals, key, eval_key, extra)
    if sft:
        ax = fig.add_subplot(rows, columns, panels)
        xs, ys = _series(sft, "sft/loss")
        ax.plot(xs, ys, linewidth=1.2)
        ax.set_title("SFT loss")
        ax.set_xlabel("SFT step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.savefig(out / "curves.png", dpi=100)
    written.append(out / "curves.png")
    return written
