"""On-policy distillation against RL from the same SFT warm start (configs/zorplex_recursive_distill_tiny.toml).

One SFT model and one teacher serve every seed:
1. `toolgym train zorplex_recursive_tiny` at seed 0 (SFT on the fallible demonstrator, then 40
   RL steps on outcome reward; exported): its `sft_model` is every arm's warm start, its
   `final_model` the teacher. This run is also the RL arm of seed 0.
2. per further seed S: the RL arm again from that SFT model (`run.seed=S`, no SFT).
3. per seed S, from the same SFT model:
   - `opd`: pure on-policy distillation (the distill preset: the teacher's per-token log-ratio as
     the advantage, reward_weight 0, 64 episodes a step);
   - `opd_topk`: the same plus the top-k forward KL (`distill.top_k=8`);
   - `sft_teacher`: off-policy distillation at the same teacher-sample budget: the teacher samples
     as many episodes as `opd` samples in its run (`toolgym record --policy <teacher>`, the
     training task stream), and the SFT model is fine-tuned on them (cross-entropy on the
     teacher's tokens, all of them, right or wrong), then evaluated once.
Held-out accuracy is the presets' eval (256 task seeds x 2 samples at temperature 1, the same task
seeds everywhere): RL every 5 steps, OPD every 2. Reported per run: the first step whose eval
reaches the target (>= 0.85) and the wall time to it from the step-0 eval, the accuracy at the
start and at the end, and for OPD the teacher's scoring time as a share of the step. Then per
arm the median over seeds, and the ratios OPD / RL in steps and in seconds.

    python bench/distill_demo.py [--seeds 0 1 2] [--out DIR] [--resume]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import commit, format_table, machine_summary, toolgym_train
from rl_arms import ArmsBench, finished, read_run

TARGET = {"accuracy": 0.85}
RL = ArmsBench(
    "zorplex_recursive_tiny",
    {"rl": []},
    TARGET,
    Path("runs/distill_demo"),
    Path("bench/distill_demo_curves.png"),
)
OPD = ArmsBench("zorplex_recursive_distill_tiny", {}, TARGET, RL.out, RL.curves)
OPD_STEPS, OPD_EVAL_EVERY, RL_EVAL_EVERY, TOP_K = 20, 2, 5, 8
EPISODES_PER_OPD_STEP = 64  # the distill preset's 16 groups x 4
SFT_TEACHER = [
    "sft.steps=120",
    "sft.batch_episodes=32",
    "sft.optimizer.lr=3e-4",
    "sft.optimizer.warmup_steps=10",
]
ENV = [
    "--env",
    "toolgym/Zorplex-v0",
    "--env-kwargs",
    '{"tier": "recursive", "difficulty": "medium", "max_turns": 6}',
]


def train(bench: ArmsBench, run_dir: Path, items: list[str], resume: bool) -> float | None:
    if resume and finished(run_dir):
        print(f"{run_dir}: finished, kept", flush=True)
        return None
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists and is not a finished run: remove it or give another --out")
    wall = toolgym_train(bench.preset, [f"run.run_dir={run_dir}", *items], Path(f"{run_dir}.log"))
    print(f"{run_dir}: {wall:.0f} s", flush=True)
    return wall


def teacher_share(run_dir: Path) -> float | None:
    """The teacher's scoring time as a share of the run's step time (train records)."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in records if r["kind"] == "train"]
    if len(steps) < 2 or "distill/teacher_s" not in steps[0]:
        return None
    wall = steps[-1]["time"] - steps[0]["time"]  # steps 2..N (the first includes start-up)
    return sum(r["distill/teacher_s"] for r in steps[1:]) / wall if wall > 0 else None


def off_policy(out: Path, seed: int, sft_model: Path, teacher: Path, resume: bool) -> dict:
    """The teacher's samples (as many as one OPD run's), then SFT on them from the warm start."""
    run_dir = out / f"sft_teacher_s{seed}"
    recording = out / f"teacher_samples_s{seed}.jsonl"
    episodes = OPD_STEPS * EPISODES_PER_OPD_STEP
    if not (resume and recording.exists()):
        recording.unlink(missing_ok=True)
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "toolgym.configs.cli", "record", *ENV, "--policy", str(teacher),
             "--tasks", str(episodes // 4), "--group-size", "4", "--max-turns", "6", "--max-tokens-per-turn", "16",
             "--max-tokens-per-episode", "64", "--temperature", "1.0", "--seed", str(1000 + seed),
             "--out", str(recording), "--no-progress"],
            check=True,
        )  # fmt: skip
        print(f"{recording}: {episodes} teacher episodes in {time.perf_counter() - start:.0f} s", flush=True)
    items = [f"model.path={sft_model}", "sft.enabled=true", "sft.source=recording", f"sft.recording={recording}",
             *SFT_TEACHER, "run.steps=1", "eval.every_steps=0", f"run.seed={seed}",
             "run.export_hf=false"]  # fmt: skip
    wall = train(RL, run_dir, items, resume)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    first = next(r for r in records if r["kind"] == "eval")
    return {"accuracy": first.get("eval/accuracy"), "process_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=RL.out)
    parser.add_argument("--resume", action="store_true", help="keep the runs already finished in --out")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    print(machine_summary())
    print(f"distill demo: commit {commit()}", flush=True)
    base = out / "rl_s0"
    results: dict[tuple[str, int], dict] = {}

    def record(arm: str, seed: int, run_dir: Path, wall: float | None) -> None:
        bench = RL if arm == "rl" else OPD
        results[arm, seed] = read_run(bench, run_dir) | {
            "process_s": wall,
            "teacher_share": teacher_share(run_dir),
        }
        report(results, out)

    wall = train(
        RL,
        base,
        [f"eval.every_steps={RL_EVAL_EVERY}", "run.seed=0", "model.init_seed=0", "run.export_hf=true"],
        args.resume,
    )
    record("rl", 0, base, wall)
    sft_model, teacher = base / "sft_model", base / "final_model"

    def opd(arm: str, seed: int, extra: list[str]) -> None:
        run_dir = out / f"{arm}_s{seed}"
        items = [f"model.path={sft_model}", f"distill.teacher={teacher}", f"run.steps={OPD_STEPS}",
                 f"eval.every_steps={OPD_EVAL_EVERY}", f"run.seed={seed}", "run.export_hf=false",
                 "checkpoint.every_steps=0", *extra]  # fmt: skip
        record(arm, seed, run_dir, train(OPD, run_dir, items, args.resume))

    # The headline comparison first (RL and OPD on every seed), then the other arms: a bench cut
    # short keeps the figures that matter most.
    for seed in args.seeds:
        if seed != 0:
            run_dir = out / f"rl_s{seed}"
            items = [f"model.path={sft_model}", "sft.enabled=false", f"eval.every_steps={RL_EVAL_EVERY}",
                     f"run.seed={seed}", "run.export_hf=false"]  # fmt: skip
            record("rl", seed, run_dir, train(RL, run_dir, items, args.resume))
        opd("opd", seed, [])
    for seed in args.seeds:
        opd("opd_topk", seed, [f"distill.top_k={TOP_K}"])
    for seed in args.seeds:
        results["sft_teacher", seed] = off_policy(out, seed, sft_model, teacher, args.resume)
        report(results, out)


def report(results: dict[tuple[str, int], dict], out: Path) -> None:
    def fmt(value, spec: str = ".1f") -> str:
        return "-" if value is None else format(value, spec)

    rows = []
    for (arm, seed), r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if arm == "sft_teacher":
            rows.append([arm, seed, "-", "-", f"-> {fmt(r['accuracy'], '.3f')}", "-", "-"])
            continue
        rows.append([
            arm, seed, fmt(r["step_at_target"], "d"), fmt(r["time_to_target_s"]),
            f"{fmt(r['start']['accuracy'], '.3f')} -> {fmt(r['final']['accuracy'], '.3f')}",
            fmt(r["rl_wall_s"]), fmt(r["teacher_share"], ".2f"),
        ])  # fmt: skip
    print(format_table(["arm", "seed", "step at acc>=0.85", "s to it", "held-out acc, start -> end",
                        "train wall (s)", "teacher share"], rows))  # fmt: skip
    medians = {}
    for arm in ("rl", "opd", "opd_topk"):
        reached = [r for (a, _), r in results.items() if a == arm and r["step_at_target"] is not None]
        runs = [r for (a, _), r in results.items() if a == arm]
        if reached:
            medians[arm] = (
                statistics.median(r["step_at_target"] for r in reached),
                statistics.median(r["time_to_target_s"] for r in reached),
            )
            print(f"{arm}: median {medians[arm][0]} steps, {medians[arm][1]:.0f} s to held-out acc >= 0.85 "
                  f"({len(reached)} of {len(runs)} seeds)")  # fmt: skip
        elif runs:
            print(f"{arm}: held-out acc >= 0.85 not reached ({len(runs)} seeds)")
    for arm in ("opd", "opd_topk"):
        if arm in medians and "rl" in medians:
            print(f"{arm} / rl: {medians[arm][0] / medians['rl'][0]:.2f} of the steps, "
                  f"{medians[arm][1] / medians['rl'][1]:.2f} of the wall time")  # fmt: skip
    (out / "results.json").write_text(
        json.dumps([{"arm": a, "seed": s} | r for (a, s), r in sorted(results.items())], indent=1)
    )


if __name__ == "__main__":
    main()
