"""Asynchronous against synchronous RL on the CPU demo (configs/zorplex_tiny.toml), in one run.

    python bench/async_vs_sync.py                                  # 3 seeds, the preset as shipped
    python bench/async_vs_sync.py --seeds 0 --set run.steps=4 --set sft.steps=60 \
        --set eval.num_tasks=8 --out /tmp/avs                      # a tiny smoke run (no figure)

Per seed: `toolgym train zorplex_tiny` in sync mode (SFT, then RL), then in async mode
(`loop.mode = "async"`) from the SYNC run's SFT model (`model.path`), so both RL phases start
from the same weights and only RL is compared. Each run is its own process, one after the other.

Reported per run, from its metrics.jsonl: the RL wall time to the demo's held-out targets (the
first eval with tag rate >= 0.95 and accuracy >= 0.90, timed from the step-0 eval's record, so
both modes pay for the same evals), the final held-out tag rate and accuracy, and the RL wall time
in all. The headline: sync's time to target / async's (the median over seeds that reached it in
both modes; the target is >= 1.5 on 2 cores), and the final metrics' mean over seeds per mode.
`--out/curves.png`: held-out accuracy and tag rate of every run against RL wall time and against
training samples (episodes the trainer took); `--out/results.json`: the figures. Both are
rewritten after each seed, so a run cut short keeps what it measured.

The device is the preset's (`parallel.device = "auto"`: CUDA where there is one). `--one-sft`:
only the first seed's sync run does SFT, and every later run (both modes) starts RL from its
model, for a machine whose time is short (a GPU's lease). `--generator-ranks N`: the async run
is torchrun's 1 + N processes, N of them generating (`loop.generator_ranks`; on one GPU they
share it). Those start before the step-0 eval, so their warm-up and first groups overlap it and
the clock does not count them (the sync policy's warm-up is in that eval too). `--async-set
KEY=VALUE`: an override for the async runs only, to compare async layouts against the same sync
runs (e.g. `--async-set loop.generator_processes=1 --async-set loop.generator_threads=1`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import commit  # bench/ is sys.path[0] when run as a script

sys.path.insert(0, str(Path(__file__).parent))
from _common import format_table, machine_summary

TAG_RATE, ACCURACY = 0.95, 0.90  # the CPU demo's targets (configs/zorplex_tiny.toml)


def train(
    run_dir: Path, seed: int, mode: str, sets: list[str], sft_model: Path | None, generator_ranks: int = 0
) -> float:
    """One `toolgym train zorplex_tiny` (under torchrun with `generator_ranks`); returns its wall
    time. Its output goes to run_dir.log."""
    overrides = [f"run.seed={seed}", f"run.run_dir={run_dir}", f"loop.mode={mode}", "run.export_hf=false"]
    if sft_model is not None:
        overrides += ["sft.enabled=false", f"model.path={sft_model}"]
    command = [sys.executable, "-m", "toolgym.configs.cli", "train", "zorplex_tiny", "--no-progress"]
    if generator_ranks:
        overrides.append(f"loop.generator_ranks={generator_ranks}")
        torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={1 + generator_ranks}"]
        command[1:3] = [*torchrun, "-m", "toolgym.configs.cli"]
    for item in overrides + sets:  # the user's --set last: they win
        command += ["--set", item]
    started = time.perf_counter()
    with open(f"{run_dir}.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - started


def read_run(run_dir: Path) -> dict:
    """The figures of one run from its metrics.jsonl (see the module doc)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    evals = [r for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    start = next(r["time"] for r in evals if r["step"] == 0)
    samples, seen = {0: 0.0}, 0.0
    for r in train:
        seen += r.get("rollout/episodes", 0.0)
        samples[r["step"]] = seen
    reached = next(
        (r for r in evals if r.get("eval/tag_rate", 0) >= TAG_RATE and r.get("eval/accuracy", 0) >= ACCURACY),
        None,
    )
    last = evals[-1]
    return {
        "time_to_target_s": None if reached is None else reached["time"] - start,
        "step_at_target": None if reached is None else reached["step"],
        "final_tag_rate": last.get("eval/tag_rate"),
        "final_accuracy": last.get("eval/accuracy"),
        "rl_wall_s": (train[-1]["time"] if train else start) - start,
        "curve": [
            (r["time"] - start, samples.get(r["step"], 0.0), r.get("eval/accuracy"), r.get("eval/tag_rate"))
            for r in evals
        ],
    }


def plot(results: dict[tuple[str, int], dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7), layout="constrained")
    axes = fig.subplots(2, 2)
    for (mode, seed), result in sorted(results.items()):
        color = "C0" if mode == "sync" else "C1"
        style = ["-", "--", ":", "-."][seed % 4]
        wall, samples, accuracy, tag_rate = zip(*result["curve"], strict=True)
        for row, values in enumerate((accuracy, tag_rate)):
            for col, xs in enumerate((wall, samples)):
                axes[row][col].plot(
                    xs, values, style, color=color, marker="o", markersize=3, label=f"{mode} seed {seed}"
                )
    for row, name, target in ((0, "held-out accuracy", ACCURACY), (1, "held-out tag rate", TAG_RATE)):
        for col, xlabel in enumerate(("RL wall time (s)", "training samples (episodes)")):
            ax = axes[row][col]
            ax.axhline(target, color="grey", linewidth=0.8)
            ax.set_title(name)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.savefig(path, dpi=100)


def report(results: dict[tuple[str, int], dict], seeds: list[int], out: Path) -> None:
    """The table, the means, the ratios and the curves of the seeds run so far (printed after
    each seed, so that a run cut short still reports what it measured)."""

    def fmt(value: float | None, spec: str = ".1f") -> str:
        return "-" if value is None else format(value, spec)

    rows = [
        [mode, seed, fmt(r["time_to_target_s"]), fmt(r["step_at_target"], "d") if r["step_at_target"] is not None else "-",
         fmt(r["final_tag_rate"], ".3f"), fmt(r["final_accuracy"], ".3f"), fmt(r["rl_wall_s"])]
        for (mode, seed), r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0] != "sync"))
    ]  # fmt: skip
    headers = ["mode", "seed", "to target (s)", "at step", "final tag rate", "final accuracy", "RL wall (s)"]
    print(format_table(headers, rows))
    for mode in ("sync", "async"):
        runs = [r for (m, _), r in results.items() if m == mode]
        tags = [r["final_tag_rate"] for r in runs if r["final_tag_rate"] is not None]
        accs = [r["final_accuracy"] for r in runs if r["final_accuracy"] is not None]
        if tags and accs:
            print(f"{mode}: final held-out tag rate {statistics.mean(tags):.3f}, accuracy {statistics.mean(accs):.3f} "
                  f"(mean of {len(runs)} seeds)")  # fmt: skip
    ratios = [
        results["sync", s]["time_to_target_s"] / results["async", s]["time_to_target_s"]
        for s in seeds
        if results["sync", s]["time_to_target_s"] and results["async", s]["time_to_target_s"]
    ]
    if ratios:
        print(
            f"time to target, sync / async: {statistics.median(ratios):.2f}x (median of {len(ratios)} seeds)"
        )
    else:
        print("time to target, sync / async: not measured (a mode did not reach the targets in any seed)")
    wall_ratios = [results["sync", s]["rl_wall_s"] / results["async", s]["rl_wall_s"] for s in seeds
                   if results["async", s]["rl_wall_s"] > 0]  # fmt: skip
    if wall_ratios:
        print(f"RL wall time for the same steps, sync / async: {statistics.median(wall_ratios):.2f}x")
    (out / "results.json").write_text(
        json.dumps([{"mode": m, "seed": s} | r for (m, s), r in sorted(results.items())], indent=1)
    )
    plot(results, out / "curves.png")
    print(f"curves: {out / 'curves.png'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], help="a config override for both modes"
    )
    parser.add_argument(
        "--async-set",
        dest="async_sets",
        action="append",
        default=[],
        help="a config override for the async runs only (after --set's)",
    )
    parser.add_argument(
        "--one-sft",
        action="store_true",
        help="SFT once, in the first seed's sync run; every later run's RL starts from that model",
    )
    parser.add_argument(
        "--generator-ranks",
        type=int,
        default=0,
        help="async under torchrun: 1 trainer rank and this many generators",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/async_vs_sync"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine_summary())
    print(f"commit {commit()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}, overrides {args.sets or 'none'}"
          f"{f', async only {args.async_sets}' if args.async_sets else ''}"
          f"{', one SFT' if args.one_sft else ''}"
          f"{f', async on {args.generator_ranks} generator rank(s)' if args.generator_ranks else ''}",
          flush=True)  # fmt: skip

    results: dict[tuple[str, int], dict] = {}
    sft_model: Path | None = None
    for done, seed in enumerate(args.seeds):
        sync_dir, async_dir = args.out / f"sync_s{seed}", args.out / f"async_s{seed}"
        for path in (sync_dir, async_dir):
            if path.exists():
                raise SystemExit(f"{path} exists: give another --out")
        wall = train(sync_dir, seed, "sync", args.sets, sft_model if args.one_sft else None)
        results["sync", seed] = read_run(sync_dir) | {"process_s": wall}
        if sft_model is None or not args.one_sft:
            sft_model = sync_dir / "sft_model"
        wall = train(async_dir, seed, "async", args.sets + args.async_sets, sft_model, args.generator_ranks)
        results["async", seed] = read_run(async_dir) | {"process_s": wall}
        report(results, args.seeds[: done + 1], args.out)


if __name__ == "__main__":
    main()
