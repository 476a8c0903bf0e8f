"""Real RL steps at real model shapes on one device: does it fit, and where the step's time goes.

    python bench/gpu_rl_step.py                                   # on a GPU: the default rows
    python bench/gpu_rl_step.py --rows qwen3-4b:8 qwen3-4b:0 qwen3-1.7b:0 --steps 2
    python bench/gpu_rl_step.py --device cpu --rows qwen3-0.6b:8 --steps 1 --groups 1 --group-size 2  # smoke
    python bench/gpu_rl_step.py --full-fit --set trainer.activation_checkpointing=true

Each row is MODEL:RANK, a named shape (agents/model/config.py; random weights) and a LoRA rank (0:
full fine-tuning). Per row, one `toolgym train zorplex_tiny` process (its own, so one row's
out-of-memory leaves the next row's figures clean): no SFT, `--steps` RL steps of real Zorplex
rollouts (the shipped tokenizer; the model's larger vocabulary only costs the head), engine and
trainer on the same device, bf16 weights (LoRA adapters float32), `--groups` groups of
`--group-size`. Printed from each run's metrics.jsonl, for its last step: the step, rollout,
train and weight-sync seconds, the device's allocation high-water mark
(`memory/device_peak_gib`; host RSS on a CPU) and whether it fitted. `--full-fit` rows go largest
first and stop at the first that fits: the largest full fine-tuning shape the device holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, format_table, machine_summary, toolgym_train

from toolgym.trainers.metrics_log import METRICS_FILE, read_metrics

DEFAULT_ROWS = ["qwen3-4b:8", "qwen3-4b:32"]
FULL_FIT = ["qwen3-8b:0", "qwen3-4b:0", "qwen3-1.7b:0", "qwen3-0.6b:0"]  # largest first


def overrides(model: str, rank: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        f"model.name={model}",
        "model.dtype=bfloat16",
        f"policy.lora.rank={rank}",
        f"policy.lora.alpha={2 * rank}" if rank else "policy.lora.alpha=16",
        f"parallel.device={args.device}",
        "sft.enabled=false",
        f"run.steps={args.steps}",
        f"run.run_dir={run_dir}",
        "run.export_hf=false",
        "run.plot=false",
        "run.max_steps_without_learning=0",
        f"batch.groups_per_batch={args.groups}",
        f"batch.max_groups_per_round={args.groups}",
        "batch.dynamic_sampling=false",
        f"rollout.group_size={args.group_size}",
        f"policy.max_batch_size={args.groups * args.group_size}",
        "eval.every_steps=0",
        "eval.at_start=false",
        "eval.at_end=false",
        "checkpoint.every_steps=0",
        "checkpoint.at_end=false",
        *args.set,
    ]


def one_row(spec: str, args: argparse.Namespace) -> dict:
    model, rank_text = spec.split(":")
    rank = int(rank_text)
    run_dir = args.out / spec.replace(":", "_r")
    started = time.perf_counter()
    try:
        toolgym_train("zorplex_tiny", overrides(model, rank, args, run_dir), Path(f"{run_dir}.log"))
        fitted = True
    except SystemExit:
        fitted = False
    wall = time.perf_counter() - started
    log = Path(f"{run_dir}.log").read_text(errors="replace")
    oom = "OutOfMemoryError" in log or "out of memory" in log
    train = [r for r in read_metrics(run_dir / METRICS_FILE) if r["kind"] == "train"]
    fitted = fitted and bool(train)  # a run that logged no RL step did not show it fits
    return {
        "row": spec,
        "fitted": fitted,
        "oom": oom,
        "wall_s": wall,
        "last": train[-1] if train else {},
        "error": "" if fitted else log.strip().splitlines()[-1][:160] if log.strip() else "no output",
    }


def show(results: list[dict], device: str) -> None:
    def g(r: dict, key: str, spec: str = ".2f") -> str:
        value = r["last"].get(key)
        return "-" if value is None else format(value, spec)

    peak = "memory/device_peak_gib" if device == "cuda" else "memory/host_peak_gib"
    rows = [
        [
            r["row"],
            "yes" if r["fitted"] else ("OOM" if r["oom"] else "failed"),
            g(r, "time/step_s"),
            g(r, "time/rollout_s"),
            g(r, "time/train_s"),
            g(r, "time/sync_s", ".3f"),
            g(r, peak, ".1f"),
            f"{r['wall_s']:.0f}",
        ]
        for r in results
    ]
    headers = ["model:rank", "fits", "step s", "rollout s", "train s", "sync s",
               f"{'device' if device == 'cuda' else 'host'} peak GiB", "process s"]  # fmt: skip
    print(format_table(headers, rows), flush=True)
    for r in results:
        if not r["fitted"]:
            print(f"{r['row']}: {r['error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="*", default=DEFAULT_ROWS, help="MODEL:RANK (rank 0: full; none: --full-fit only)")
    ap.add_argument(
        "--full-fit", action="store_true", help=f"then {FULL_FIT}, largest first, to the first fit"
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=2, help="RL steps a row (the last is reported)")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_rl_step"))
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a config override for every row (e.g. trainer.activation_checkpointing=true)",
    )  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine_summary())
    print(
        f"commit {commit()}; {args.steps} RL steps a row, {args.groups} x {args.group_size} episodes",
        flush=True,
    )
    results = []
    for spec in args.rows:
        results.append(one_row(spec, args))
        show(results, args.device)
    if args.full_fit:
        for spec in FULL_FIT:
            results.append(one_row(spec, args))
            show(results, args.device)
            if results[-1]["fitted"]:
                print(f"largest full fine-tuning shape that fits: {spec.split(':')[0]}")
                break
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
