"""`toolgym plot RUN_DIR`: PNG curves from a run's metrics.jsonl (matplotlib, no display needed).

One PNG per quantity over RL steps: reward; the reward's named components in one panel
(`reward_components.png`: `rollout/reward/<name>` as a line and `eval/reward/<name>` as markers
per component, when the env reported any); every metric the env reported (envs/core/info.py:
`rollout/<name>` for training batches as a line, `eval/<name>` for the held-out evals as markers;
a metric the run did not log gets no plot); entropy and KL to the sampler (the trainer's); the
staleness histogram (`staleness.png`: sampled tokens trained on, by policy versions behind the
trainer, over the whole run, with the mean |trainer - sampler| logprob gap of each bar); a
self-play pool's Elo ratings (`ratings.png`: the policy's and each member's).
`curves.png` puts them side by side, with the SFT loss when the run had an SFT phase. Names come
from the env, so they are drawn as plain text (`_plain`), never as mathtext.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # no pyplot: no global backend state, no display

from ..rollouts.metrics import env_metric_names, reward_component_names
from .metrics_log import METRICS_FILE, display_name, read_metrics

Panel = tuple[str, str, str, str | None, tuple[str, ...]]
# (file stem, title, train-record key, eval-record key or None, extra train keys)
REWARD_PANEL: Panel = ("reward", "reward", "rollout/reward_mean", "eval/reward_mean", ())
TRAINER_PANELS: tuple[Panel, ...] = (
    ("entropy", "entropy (sampled tokens)", "train/entropy", None, ()),
    ("kl", "KL (trainer vs sampler, k3)", "train/sampler_kl_k3", None, ("train/kl_ref",)),
)
COMPONENTS_STEM = "reward_components"
STALENESS_STEM = "staleness"
RATINGS_STEM = "ratings"
RATING = "selfplay/elo"  # the policy's; selfplay/elo/<member>: the pool's (rollouts/episode/opponents.py)
_FIXED_STEMS = {"reward", COMPONENTS_STEM, "entropy", "kl", "curves", STALENESS_STEM, RATINGS_STEM}
_STALENESS_BUCKETS = ("s0", "s1", "s2", "s3plus")  # trainers/losses.py, STALENESS_BUCKETS


def _plain(text: str) -> str:
    """`text` as matplotlib draws it literally: a pair of `$` would start mathtext (text that is
    not valid TeX fails the whole figure) and a legend drops labels that start with `_`."""
    text = text.replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def component_names(train: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]]) -> list[str]:
    """Every reward component the records hold (`rollout/reward/<name>` or `eval/reward/<name>`),
    in the order first logged."""
    names: dict[str, None] = {}
    for records, prefix in ((train, "rollout/"), (evals, "eval/")):
        for record in records:
            names.update(dict.fromkeys(reward_component_names(record, prefix)))
    return list(names)


def env_panels(train: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]]) -> list[Panel]:
    """One panel per env metric the records hold (`rollout/<name>` or `eval/<name>`), in the
    order first logged."""
    names: dict[str, None] = {}
    for records, prefix in ((train, "rollout/"), (evals, "eval/")):
        for record in records:
            names.update(dict.fromkeys(env_metric_names(record, prefix)))
    return [
        (f"env_{n}" if n in _FIXED_STEMS else n, _plain(display_name(n)), f"rollout/{n}", f"eval/{n}", ())
        for n in names
    ]


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


def _draw_components(ax: Any, names: Sequence[str], train: list[dict], evals: list[dict]) -> bool:
    """The reward components in one panel: per name a train line and eval markers of one colour."""
    drawn = False
    for i, name in enumerate(names):
        color = f"C{i % 10}"
        xs, ys = _series(train, f"rollout/reward/{name}")
        if xs:
            ax.plot(xs, ys, color=color, label=_plain(name), linewidth=1.2)
            drawn = True
        xs, ys = _series(evals, f"eval/reward/{name}")
        if xs:
            ax.plot(xs, ys, "o--", color=color, label=_plain(f"{name} (eval)"), markersize=4, linewidth=0.8)
            drawn = True
    ax.set_title("reward components")
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    return drawn


def _draw_staleness(ax: Any, train: list[dict]) -> bool:
    """Bars: tokens trained on per staleness bucket, summed over the run; each labelled with its
    token-weighted mean logprob gap."""
    counts, gaps = [], []
    for bucket in _STALENESS_BUCKETS:
        _, ns = _series(train, f"train/staleness_tokens_{bucket}_sum")
        _, means = _series(train, f"train/logprob_gap_mean_{bucket}")
        counts.append(sum(ns))
        gaps.append(sum(n * g for n, g in zip(ns, means, strict=False)) / sum(ns) if sum(ns) else 0.0)
    labels = ["0", "1", "2", "3+"]
    drawn = sum(counts) > 0
    if drawn:
        bars = ax.bar(labels, counts, color="C0")
        for bar, gap, n in zip(bars, gaps, counts, strict=True):
            if n:
                ax.annotate(
                    f"gap {gap:.3f}",
                    (bar.get_x() + bar.get_width() / 2, n),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
    ax.set_title("staleness of trained tokens (mean |logprob gap|)")
    ax.set_xlabel("policy versions behind the trainer")
    ax.set_ylabel("sampled tokens")
    ax.grid(alpha=0.3, axis="y")
    return drawn


def _draw_ratings(ax: Any, train: list[dict]) -> bool:
    """Elo of the policy (`selfplay/elo`) and of each opponent-pool member over the steps
    (rollouts/episode/opponents.py); a member's line starts where it joined the pool."""
    names: dict[str, None] = {}
    for record in train:
        names.update(dict.fromkeys(k for k in record if k == RATING or k.startswith(RATING + "/")))
    for key in names:
        xs, ys = _series(train, key)
        label = "policy" if key == RATING else _plain(key.removeprefix(RATING + "/"))
        ax.plot(xs, ys, linewidth=2.0 if key == RATING else 1.0, label=label)
    ax.set_title("Elo (self-play pool)")
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return bool(names)


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
    panels = [REWARD_PANEL, *env_panels(train, evals), *TRAINER_PANELS]
    drawers: list[tuple[str, Callable[[Any], bool]]] = [
        (stem, partial(_draw, title=title, train=train, evals=evals, key=key, eval_key=eval_key, extra=extra))
        for stem, title, key, eval_key, extra in panels
    ]
    if components := component_names(train, evals):  # right after the reward they split
        draw_components = partial(_draw_components, names=components, train=train, evals=evals)
        drawers.insert(1, (COMPONENTS_STEM, draw_components))
    stale = (
        "train/staleness_tokens_s1_sum",
        "train/staleness_tokens_s2_sum",
        "train/staleness_tokens_s3plus_sum",
    )
    if any(RATING in r for r in train):  # a self-play run with an opponent pool
        drawers.append((RATINGS_STEM, partial(_draw_ratings, train=train)))
    if any(r.get(key) for r in train for key in stale):  # a synchronous run's tokens are all fresh
        drawers.append((STALENESS_STEM, partial(_draw_staleness, train=train)))
    written = []
    for stem, draw in drawers:
        fig = Figure(figsize=(6, 4), layout="constrained")
        draw(fig.add_subplot())
        fig.savefig(out / f"{stem}.png", dpi=100)
        written.append(out / f"{stem}.png")

    count = len(drawers) + bool(sft)
    columns = 3
    rows = -(-count // columns)
    fig = Figure(figsize=(5 * columns, 3.6 * rows), layout="constrained")
    for i, (_, draw) in enumerate(drawers):
        draw(fig.add_subplot(rows, columns, i + 1))
    if sft:
        ax = fig.add_subplot(rows, columns, count)
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
