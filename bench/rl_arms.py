"""RL arms from one SFT model: the runner behind bench/credit_demo.py and bench/lora_demo.py.

Per seed S, one `toolgym train <preset>` run per arm (`run.seed=S`, `model.init_seed=S`), each its
own process, in the arms' order. The first arm runs the preset as shipped (SFT, then RL); every
later arm starts RL from the first arm's SFT model (`model.path`, `sft.enabled = false`), so the
arms share their starting weights and only RL differs (an arm that needs other demonstrations
runs its own SFT).

Reported per run, from its metrics.jsonl: the RL step and the RL wall time (timed from the step-0
eval's record, so every arm pays for the same evals) at the first held-out eval that meets every
target (`eval/<metric> >= value`), each target metric at step 0 and at the end, and the RL wall
time in all; then per arm the median over the seeds that reached the target. `<out>/results.json`
holds the figures, rewritten after each run, so a bench cut short keeps what it measured; with
`--resume` a finished run in `--out` (its last eval at its configured `run.steps`) is kept.

`--jobs 2` runs two seeds at once, each pinned to its own core with one torch thread (each figure
a one-core figure); `--jobs 1` runs one process at a time on every core.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import threading
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from _common import commit, format_table, machine_summary, toolgym_train


@dataclass(frozen=True)
class ArmsBench:
    """What one bench compares: `arms` maps an arm's name to its `--set` overrides (the first arm
    runs SFT, and so does every arm in `own_sft`, for an arm whose demonstrations differ);
    `target` maps held-out eval metrics to the value each must reach (all at once)."""

    preset: str
    arms: dict[str, list[str]]
    target: dict[str, float]
    out: Path  # default --out
    curves: Path  # default --curves
    own_sft: frozenset[str] = frozenset()

    def run_dir(self, out: Path, arm: str, seed: int) -> Path:
        return out / f"{arm.replace('+', '_')}_s{seed}"


def train(
    bench: ArmsBench, run_dir: Path, seed: int, overrides: list[str], sets: list[str], sft_model: Path | None,
    core: int | None,
) -> float:  # fmt: skip
    """One `toolgym train` of the preset; returns its wall time. Its output goes to run_dir.log."""
    items = [f"run.seed={seed}", f"model.init_seed={seed}", f"run.run_dir={run_dir}", "run.export_hf=false"]
    if sft_model is not None:
        items += ["sft.enabled=false", f"model.path={sft_model}"]
    # the user's --set last: they win (a pinned run's parallel.threads=1 comes after them)
    return toolgym_train(bench.preset, items + overrides + sets, Path(f"{run_dir}.log"), core)


def _records(run_dir: Path) -> list[dict]:
    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line]


def read_run(bench: ArmsBench, run_dir: Path) -> dict:
    """The figures of one run from its metrics.jsonl (see the module doc)."""
    records = _records(run_dir)
    evals = [r for r in records if r["kind"] == "eval"]
    train_records = [r for r in records if r["kind"] == "train"]
    first = next(r for r in evals if r["step"] == 0)
    reached = next(
        (r for r in evals if all(r.get(f"eval/{m}", float("-inf")) >= v for m, v in bench.target.items())),
        None,
    )
    last = evals[-1]
    return {
        "step_at_target": None if reached is None else reached["step"],
        "time_to_target_s": None if reached is None else reached["time"] - first["time"],
        "start": {m: first.get(f"eval/{m}") for m in bench.target},
        "final": {m: last.get(f"eval/{m}") for m in bench.target},
        "final_step": last["step"],
        "rl_wall_s": (train_records[-1]["time"] if train_records else first["time"]) - first["time"],
    }


def finished(run_dir: Path) -> bool:
    """Whether the run in `run_dir` ran to its configured last step (its final eval is logged)."""
    if not (run_dir / "metrics.jsonl").exists():
        return False
    steps = tomllib.loads((run_dir / "config.toml").read_text())["run"]["steps"]
    return any(r["kind"] == "eval" and r["step"] == steps for r in _records(run_dir))


def report(bench: ArmsBench, results: dict[tuple[str, int], dict], out: Path) -> None:
    def fmt(value: float | int | None, spec: str = ".1f") -> str:
        return "-" if value is None else format(value, spec)

    metrics = list(bench.target)
    rows = [
        [arm, seed, fmt(r["step_at_target"], "d"), fmt(r["time_to_target_s"]),
         *(f"{fmt(r['start'][m], '.3f')} -> {fmt(r['final'][m], '.3f')}" for m in metrics),
         fmt(r["final_step"], "d"), fmt(r["rl_wall_s"])]
        for (arm, seed), r in sorted(results.items(), key=lambda kv: (kv[0][1], list(bench.arms).index(kv[0][0])))
    ]  # fmt: skip
    target = ", ".join(f"{m}>={v}" for m, v in bench.target.items())
    headers = ["arm", "seed", f"step at {target}", "RL s to it", *(f"{m}, step 0 -> end" for m in metrics),
               "final step", "RL wall (s)"]  # fmt: skip
    print(format_table(headers, rows))
    for arm in bench.arms:
        runs = [r for (a, _), r in results.items() if a == arm]
        reached = [r for r in runs if r["step_at_target"] is not None]
        if reached:
            print(
                f"{arm}: median {statistics.median(r['step_at_target'] for r in reached)} steps, "
                f"{statistics.median(r['time_to_target_s'] for r in reached):.0f} s of RL to held-out "
                f"{target} ({len(reached)} of {len(runs)} seeds reached it)"
            )
        elif runs:
            print(f"{arm}: held-out {target} not reached ({len(runs)} seeds)")
    (out / "results.json").write_text(
        json.dumps([{"arm": a, "seed": s} | r for (a, s), r in sorted(results.items())], indent=1)
    )


def plot(bench: ArmsBench, out: Path, seeds: list[int], curves: Path) -> None:
    """The first target metric against the RL step, one panel per seed, one line per arm."""
    from matplotlib.figure import Figure

    metric, value = next(iter(bench.target.items()))
    fig = Figure(figsize=(5 * len(seeds), 3.6), layout="constrained")
    axes = fig.subplots(1, len(seeds), squeeze=False)[0]
    for ax, seed in zip(axes, seeds, strict=True):
        for i, arm in enumerate(bench.arms):
            run_dir = bench.run_dir(out, arm, seed)
            if not (run_dir / "metrics.jsonl").exists():
                continue
            ev = [r for r in _records(run_dir) if r["kind"] == "eval"]
            ax.plot(
                [r["step"] for r in ev],
                [r.get(f"eval/{metric}") for r in ev],
                marker="o",
                color=f"C{i}",
                label=arm,
            )
        ax.axhline(value, color="grey", lw=0.8, ls="--")
        ax.set(title=f"seed {seed}: held-out {metric} (T=1)", xlabel="RL step", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.savefig(curves, dpi=100)
    print(f"curves: {curves}")


def main(benches: dict[str, ArmsBench], description: str) -> argparse.Namespace:
    """The command line: `--preset` picks one of `benches` (by preset name; the first by default).
    Returns the parsed arguments (`out` and `curves` resolved), for a bench's own report after."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", choices=list(benches), default=next(iter(benches)))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], help="a config override for every arm"
    )
    parser.add_argument("--out", type=Path, help="where the runs go (default: the preset's)")
    parser.add_argument("--resume", action="store_true", help="keep the runs already finished in --out")
    parser.add_argument("--curves", type=Path, help="the curves PNG (default: the preset's)")
    parser.add_argument(
        "--arms",
        nargs="+",
        help="run (or, with --resume, report) only these arms; the first arm always runs first",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="seeds at once, each on its own core (1: all cores)"
    )
    args = parser.parse_args()
    bench = benches[args.preset]
    if args.arms:
        unknown = sorted(set(args.arms) - set(bench.arms))
        if unknown:
            raise SystemExit(f"--arms: {unknown} are not arms of {bench.preset} ({', '.join(bench.arms)})")
        first = next(iter(bench.arms))  # its SFT model is where the others start
        bench = replace(bench, arms={a: o for a, o in bench.arms.items() if a == first or a in args.arms})
    args.out = args.out or bench.out
    args.curves = args.curves or bench.curves
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine_summary())
    print(
        f"{bench.preset}: commit {commit()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}, jobs {args.jobs}, "
        f"overrides {args.sets or 'none'}",
        flush=True,
    )
    results: dict[tuple[str, int], dict] = {}
    lock = threading.Lock()
    cores: queue.Queue[int | None] = queue.Queue()
    for core in range(args.jobs) if args.jobs > 1 else [None]:
        cores.put(core)

    def one_seed(seed: int) -> None:
        core = cores.get()
        try:
            sft_model: Path | None = None
            for arm, overrides in bench.arms.items():
                run_dir = bench.run_dir(args.out, arm, seed)
                if args.resume and finished(run_dir):
                    print(f"{run_dir}: finished, kept", flush=True)
                    wall = None
                elif run_dir.exists():
                    raise SystemExit(
                        f"{run_dir} exists and is not a finished run: remove it or give another --out"
                    )
                else:
                    start_from = None if arm in bench.own_sft else sft_model
                    wall = train(bench, run_dir, seed, overrides, args.sets, start_from, core)
                    print(
                        f"{run_dir}: {wall:.0f} s" + ("" if core is None else f" (core {core})"), flush=True
                    )
                with lock:
                    results[arm, seed] = read_run(bench, run_dir) | {"process_s": wall}
                    report(bench, results, args.out)
                if sft_model is None:
                    sft_model = run_dir / "sft_model"
        finally:
            cores.put(core)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for future in [pool.submit(one_seed, seed) for seed in args.seeds]:
            future.result()
    plot(bench, args.out, args.seeds, args.curves)
    return args
