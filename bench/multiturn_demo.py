"""The multi-turn CPU demo (configs/zorplex_recursive_tiny.toml): does RL take the policy past its
fallible demonstrator, and does SFT alone, given the same wall-clock budget, not?

Per seed S (`model.init_seed=S` and `run.seed=S`: the model's init, the demonstrations and the
task streams):
1. the preset as `toolgym train` runs it: SFT on the demonstrator, then RL on outcome reward;
2. SFT only, given step 1's whole wall time: step 1's SFT model trained on by SFT alone, on the
   same demonstrations, for as many more steps as step 1 spent on everything after SFT (RL,
   evals, export) at step 1's own SFT step rate, at the schedule's final lr (a fresh AdamW), then
   the same held-out eval. (Continuing rather than rerunning costs a quarter of a run, not one.)
The demonstrator's accuracy is the one `toolgym train` logs for its demonstrations
(`sft_data/accuracy`, 8,192 episodes). Held-out accuracy is the preset's eval (256 task seeds x 2
samples at temperature 1, the same task seeds in every run).

With `--jobs 2` two runs go at once, each pinned to its own core with one torch thread (so each
figure is a one-core figure; the preset itself uses both cores). Prints one row per seed and
the mean, then per seed the held-out episodes' failures by kind after SFT and after RL (guessed
without a lookup, stopped a link early, mis-copied a word or number, other), and writes a
curves PNG (held-out accuracy, tool calls per episode and those failure kinds against RL step,
every seed).

    python bench/multiturn_demo.py [--seeds 0 1 2] [--jobs 2] [--out DIR] [--set KEY=VALUE ...]
    python bench/multiturn_demo.py --plot-only --out DIR    # the kinds table and curves of DIR's runs
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import format_table, toolgym_train

from toolgym.configs.load import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train(run_dir: Path, preset: str, overrides: list[str], core: int | None, log: Path) -> float:
    """One `toolgym train` run; returns its wall time in seconds (the process's, install-free)."""
    return toolgym_train(preset, [f'run.run_dir="{run_dir}"', "run.plot=false", *overrides], log, core)


def sft_phase(records: list[dict]) -> tuple[int, float]:
    """(SFT steps, SFT phase seconds) from a run's metrics."""
    steps = [r for r in records if r.get("kind") == "sft" and r.get("step", 0) > 0]
    start = next(r["time"] for r in records if r.get("kind") == "sft")
    return len(steps), steps[-1]["time"] - start


def evals(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind") == "eval"]


FAILURE_KINDS = ("no lookup, guessed", "stopped a link early", "mis-copied a word or number", "other")


def failure_kind(trajectory) -> str | None:
    """What went wrong in one held-out episode (None: it was right). The answer turn's observation
    is the last tool result it saw: a SEE pointer means it stopped a link early; a number (or an
    unknown-word error) that it still got wrong means a copy went wrong."""
    if trajectory.metrics.get("failure_mode") == "success":
        return None
    if trajectory.stop_reason != "answered":
        return "other"
    if not trajectory.metrics.get("env", {}).get("tool_calls"):
        return "no lookup, guessed"
    if "SEE:" in trajectory.transitions[-1].observation:
        return "stopped a link early"
    return "mis-copied a word or number"


def failure_kinds(run_dir: Path) -> dict[int, dict[str, float]]:
    """Per eval step, the share of held-out episodes that failed in each way (FAILURE_KINDS)."""
    from toolgym.rollouts.recording.format import read_recording

    shares: dict[int, dict[str, float]] = {}
    for path in sorted((run_dir / "trajectories").glob("eval_step_*.jsonl")):
        _, trajectories = read_recording(path)
        kinds = [failure_kind(t) for t in trajectories]
        step = int(path.stem.rsplit("_", 1)[-1])
        shares[step] = {k: sum(kind == k for kind in kinds) / max(len(kinds), 1) for k in FAILURE_KINDS}
    return shares


def plot(rows: dict[int, list[dict]], kinds: dict[int, dict[int, dict[str, float]]], out: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4), layout="constrained")
    acc, calls, modes = fig.subplots(1, 3)
    for seed, records in sorted(rows.items()):
        ev = evals(records)
        acc.plot([r["step"] for r in ev], [r["eval/accuracy"] for r in ev], marker="o", label=f"seed {seed}")
        train = [r for r in records if r.get("kind") == "train"]
        calls.plot([r["step"] for r in train], [r.get("rollout/tool_calls") for r in train], label=f"seed {seed}")
        steps = sorted(kinds.get(seed, {}))
        for i, kind in enumerate(FAILURE_KINDS):
            modes.plot(
                steps,
                [kinds[seed][step][kind] for step in steps],
                color=f"C{i}",
                marker="o",
                alpha=0.4 + 0.2 * (seed % 4),
                label=f"{kind} (seed {seed})",
            )
    acc.set(title="held-out accuracy (sampled, T=1)", xlabel="RL step", ylim=(0, 1))
    calls.set(title="tool calls per episode (rollouts)", xlabel="RL step")
    modes.set(title="held-out failures by kind (share of episodes)", xlabel="RL step", ylim=(0, 0.6))
    for ax in (acc, calls, modes):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(out, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="zorplex_recursive_tiny")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--jobs", type=int, default=2, help="runs at once, each on its own core (1: one run, all cores)")
    p.add_argument("--out", type=Path, default=Path("bench_runs/multiturn_demo"))
    p.add_argument("--curves", type=Path, default=ROOT / "bench" / "multiturn_demo_curves.png")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--plot-only", action="store_true", help="no runs: the failure kinds and curves of the runs in --out")
    args = p.parse_args()
    args.out = args.out.resolve()
    if args.plot_only:
        return print_kinds_and_plot(args.out, args.seeds, args.curves)
    try:  # a bad --set fails here, before any run
        config, _ = load_config(args.preset, args.overrides)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    final_lr = config.sft.optimizer.lr * config.sft.optimizer.min_lr_ratio  # the SFT-only runs' lr
    args.out.mkdir(parents=True, exist_ok=True)
    cores: queue.Queue[int | None] = queue.Queue()
    for core in range(args.jobs) if args.jobs > 1 else [None]:
        cores.put(core)

    def job(name: str, overrides: list[str]) -> tuple[Path, float]:
        core = cores.get()
        try:
            run_dir = args.out / name
            wall = train(run_dir, args.preset, [*args.overrides, *overrides], core, args.out / f"{name}.log")
            print(f"  {name}: {wall:.0f} s" + (f" (core {core})" if core is not None else ""), flush=True)
            return run_dir, wall
        finally:
            cores.put(core)

    def seed_pair(seed: int) -> dict:
        seeds = [f"model.init_seed={seed}", f"run.seed={seed}"]
        rl_dir, rl_wall = job(f"rl-seed{seed}", seeds)
        records = read_metrics(rl_dir)
        sft_steps, sft_seconds = sft_phase(records)
        extra_steps = max(1, int(sft_steps * (rl_wall - sft_seconds) / sft_seconds))
        sft_dir, sft_wall = job(
            f"sft-only-seed{seed}",
            [
                *seeds,
                f'model.path="{rl_dir / "sft_model"}"',
                "run.steps=0",
                f"sft.steps={extra_steps}",
                f"sft.optimizer.lr={final_lr}",
                "sft.optimizer.warmup_steps=0",
                'sft.optimizer.decay="constant"',
            ],
        )
        budget_steps = sft_steps + extra_steps
        ev = evals(records)
        demo = next(r["sft_data/accuracy"] for r in records if "sft_data/accuracy" in r)
        return {
            "seed": seed,
            "records": records,
            "demonstrator": demo,
            "after_sft": ev[0]["eval/accuracy"],
            "after_rl": ev[-1]["eval/accuracy"],
            "rl_wall": rl_wall,
            "sft_steps": sft_steps,
            "sft_seconds": sft_seconds,
            "sft_only": evals(read_metrics(sft_dir))[-1]["eval/accuracy"],
            "sft_only_steps": budget_steps,
            "sft_only_wall": sft_seconds + sft_wall,
        }

    print(f"{args.preset}: seeds {args.seeds}, {args.jobs} at once; runs in {args.out}", flush=True)
    with ThreadPoolExecutor(max_workers=len(args.seeds)) as pool:
        results = list(pool.map(seed_pair, args.seeds))
    headers = ["seed", "demonstrator", "after SFT", "after RL", "SFT only, same budget", "RL run s (SFT s)", "SFT-only steps, s"]
    rows = [
        [
            r["seed"],
            f"{r['demonstrator']:.3f}",
            f"{r['after_sft']:.3f}",
            f"{r['after_rl']:.3f}",
            f"{r['sft_only']:.3f}",
            f"{r['rl_wall']:.0f} ({r['sft_seconds']:.0f})",
            f"{r['sft_only_steps']}, {r['sft_only_wall']:.0f}",
        ]
        for r in results
    ]
    mean = {k: statistics.mean(r[k] for r in results) for k in ("demonstrator", "after_sft", "after_rl", "sft_only")}
    rows.append(["mean", *(f"{mean[k]:.3f}" for k in ("demonstrator", "after_sft", "after_rl", "sft_only")), "", ""])
    print(format_table(headers, rows))
    print(
        f"RL over SFT: {mean['after_rl'] - mean['after_sft']:+.3f}; SFT only over the demonstrator: "
        f"{mean['sft_only'] - mean['demonstrator']:+.3f}"
    )
    print_kinds_and_plot(args.out, args.seeds, args.curves)


def print_kinds_and_plot(out: Path, seeds: list[int], curves: Path) -> None:
    """The held-out failures by kind after SFT and after RL, per seed, and the curves PNG, from
    the runs under `out` (rl-seed<S>)."""
    kinds = {seed: failure_kinds(out / f"rl-seed{seed}") for seed in seeds}
    rows = []
    for seed in seeds:
        first, last = min(kinds[seed]), max(kinds[seed])
        rows.append([seed, *(f"{kinds[seed][first][k]:.3f} -> {kinds[seed][last][k]:.3f}" for k in FAILURE_KINDS)])
    print("held-out episodes by failure kind, after SFT -> after RL:")
    print(format_table(["seed", *FAILURE_KINDS], rows))
    plot({seed: read_metrics(out / f"rl-seed{seed}") for seed in seeds}, kinds, curves)
    print(f"curves: {curves}")


if __name__ == "__main__":
    main()
