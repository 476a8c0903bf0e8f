"""Credit over a 4-link Zorplex chain (configs/zorplex_chain_credit_tiny.toml): outcome credit,
turn-level credit, and turn-level credit with a per-link process reward, in one run.

    python bench/credit_demo.py                                    # 3 seeds, the preset as shipped
    python bench/credit_demo.py --seeds 0 --set run.steps=2 --set sft.steps=4 \
        --set sft.num_tasks=64 --set eval.num_tasks=4 --set eval.every_steps=1 \
        --out /tmp/credit_smoke                                    # a smoke run (no meaningful figure)

Per seed, three `toolgym train zorplex_chain_credit_tiny` runs, one after the other, each its own
process:
- outcome: the preset as shipped (SFT, then RL with every turn given the episode's advantage);
- turn_loo: `batch.advantage.credit = "turn_loo"` (per-turn returns-to-go, a leave-one-out
  baseline per turn index: docs/credit.md);
- turn_loo+chain: the same, plus `env.kwargs.chain_reward = 0.1` (the reward component `chain`:
  0.1 for each lookup that follows the chain to its next word).
The last two start RL from the outcome run's SFT model (`model.path`, `sft.enabled = false`), so
the three arms share their starting weights and only RL differs. Held-out accuracy is the env's
`accuracy` metric (a right answer), the same in every arm whatever the reward.

Reported per run, from its metrics.jsonl: the RL step and the RL wall time (timed from the step-0
eval's record, so every arm pays for the same evals) at the first eval with held-out accuracy >=
0.85, the final held-out accuracy, and the RL wall time in all; then per arm the median over seeds
that reached the target. `--out/results.json` holds the figures, rewritten after each run, so a
run cut short keeps what it measured; `--resume` reads the runs already finished in `--out` (a run
is finished when its last held-out eval is at its configured `run.steps`) and starts the rest.
The held-out accuracy curves go to `--curves` (bench/credit_demo_curves.png).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from _common import commit  # bench/ is sys.path[0] when run as a script

sys.path.insert(0, str(Path(__file__).parent))
from _common import format_table, machine_summary

PRESET = "zorplex_chain_credit_tiny"
TARGET = 0.85  # held-out accuracy
ARMS: dict[str, list[str]] = {
    "outcome": [],
    "turn_loo": ["batch.advantage.credit=turn_loo"],
    "turn_loo+chain": ["batch.advantage.credit=turn_loo", "env.kwargs.chain_reward=0.1"],
}


def train(run_dir: Path, seed: int, overrides: list[str], sets: list[str], sft_model: Path | None) -> float:
    """One `toolgym train` of the preset; returns its wall time. Its output goes to run_dir.log."""
    command = [sys.executable, "-m", "toolgym.configs.cli", "train", PRESET, "--no-progress"]
    items = [f"run.seed={seed}", f"model.init_seed={seed}", f"run.run_dir={run_dir}", "run.export_hf=false"]
    if sft_model is not None:
        items += ["sft.enabled=false", f"model.path={sft_model}"]
    for item in items + overrides + sets:  # the user's --set last: they win
        command += ["--set", item]
    started = time.perf_counter()
    with open(f"{run_dir}.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - started


def read_run(run_dir: Path) -> dict:
    """The figures of one run from its metrics.jsonl (see the module doc)."""
    records = [json.loads(line) for line in _lines(run_dir)]
    evals = [r for r in records if r["kind"] == "eval"]
    train_records = [r for r in records if r["kind"] == "train"]
    start = next(r["time"] for r in evals if r["step"] == 0)
    reached = next((r for r in evals if r.get("eval/accuracy", 0.0) >= TARGET), None)
    last = evals[-1]
    return {
        "step_at_target": None if reached is None else reached["step"],
        "time_to_target_s": None if reached is None else reached["time"] - start,
        "start_accuracy": next(r.get("eval/accuracy") for r in evals if r["step"] == 0),
        "final_accuracy": last.get("eval/accuracy"),
        "final_step": last["step"],
        "rl_wall_s": (train_records[-1]["time"] if train_records else start) - start,
        "reward_chain_last": train_records[-1].get("rollout/reward/chain") if train_records else None,
    }


def finished(run_dir: Path) -> bool:
    """Whether the run in `run_dir` ran to its configured last step (its final eval is logged)."""
    if not (run_dir / "metrics.jsonl").exists():
        return False
    steps = tomllib.loads((run_dir / "config.toml").read_text())["run"]["steps"]
    return any(r["kind"] == "eval" and r["step"] == steps for r in map(json.loads, _lines(run_dir)))


def _lines(run_dir: Path) -> list[str]:
    return [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def report(results: dict[tuple[str, int], dict], out: Path) -> None:
    def fmt(value: float | int | None, spec: str = ".1f") -> str:
        return "-" if value is None else format(value, spec)

    rows = [
        [arm, seed, fmt(r["step_at_target"], "d"), fmt(r["time_to_target_s"]), fmt(r["start_accuracy"], ".3f"),
         fmt(r["final_accuracy"], ".3f"), fmt(r["final_step"], "d"), fmt(r["rl_wall_s"])]
        for (arm, seed), r in sorted(results.items(), key=lambda kv: (kv[0][1], list(ARMS).index(kv[0][0])))
    ]  # fmt: skip
    headers = ["arm", "seed", f"step at acc>={TARGET}", "RL s to it", "acc at step 0", "final acc",
               "final step", "RL wall (s)"]  # fmt: skip
    print(format_table(headers, rows))
    for arm in ARMS:
        runs = [r for (a, _), r in results.items() if a == arm]
        reached = [r for r in runs if r["step_at_target"] is not None]
        if reached:
            print(
                f"{arm}: median {statistics.median(r['step_at_target'] for r in reached)} steps, "
                f"{statistics.median(r['time_to_target_s'] for r in reached):.0f} s of RL to held-out "
                f"accuracy {TARGET} ({len(reached)} of {len(runs)} seeds reached it)"
            )
        elif runs:
            print(f"{arm}: held-out accuracy {TARGET} not reached ({len(runs)} seeds)")
    (out / "results.json").write_text(
        json.dumps([{"arm": a, "seed": s} | r for (a, s), r in sorted(results.items())], indent=1)
    )


def plot(out: Path, seeds: list[int], curves: Path) -> None:
    """Held-out accuracy against the RL step, one panel per seed, one line per arm."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(seeds), 3.6), layout="constrained")
    axes = fig.subplots(1, len(seeds), squeeze=False)[0]
    for ax, seed in zip(axes, seeds, strict=True):
        for i, arm in enumerate(ARMS):
            run_dir = out / f"{arm.replace('+', '_')}_s{seed}"
            if not (run_dir / "metrics.jsonl").exists():
                continue
            ev = [r for r in map(json.loads, _lines(run_dir)) if r["kind"] == "eval"]
            ax.plot([r["step"] for r in ev], [r.get("eval/accuracy") for r in ev], marker="o", color=f"C{i}", label=arm)
        ax.axhline(TARGET, color="grey", lw=0.8, ls="--")
        ax.set(title=f"seed {seed}: held-out accuracy (T=1)", xlabel="RL step", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.savefig(curves, dpi=100)
    print(f"curves: {curves}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], help="a config override for every arm"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/credit_demo"))
    parser.add_argument("--resume", action="store_true", help="keep the runs already finished in --out")
    parser.add_argument("--curves", type=Path, default=Path(__file__).parent / "credit_demo_curves.png")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine_summary())
    print(
        f"commit {commit()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}, "
        f"overrides {args.sets or 'none'}",
        flush=True,
    )
    results: dict[tuple[str, int], dict] = {}
    for seed in args.seeds:
        sft_model: Path | None = None
        for arm, overrides in ARMS.items():
            run_dir = args.out / f"{arm.replace('+', '_')}_s{seed}"
            if args.resume and finished(run_dir):
                print(f"{run_dir}: finished, kept", flush=True)
                wall = None
            elif run_dir.exists():
                raise SystemExit(f"{run_dir} exists and is not a finished run: remove it or give another --out")
            else:
                wall = train(run_dir, seed, overrides, args.sets, sft_model)
            results[arm, seed] = read_run(run_dir) | {"process_s": wall}
            if sft_model is None:
                sft_model = run_dir / "sft_model"
            report(results, args.out)
    plot(args.out, args.seeds, args.curves)


if __name__ == "__main__":
    main()
