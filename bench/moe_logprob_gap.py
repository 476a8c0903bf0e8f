"""The sampler/trainer logprob gap of a mixture-of-experts policy against the dense one, in RL.

    python bench/moe_logprob_gap.py                       # tiny, tiny-moe (and with replay), fp32 and bf16
    python bench/moe_logprob_gap.py --dtypes float32 --steps 2 --sft-steps 4   # a smoke run

Per dtype, one `toolgym train zorplex_tiny` per arm (the same preset, SFT shortened to
`--sft-steps`, then `--steps` RL steps), and from each run's metrics.jsonl the trainer's measure of
how far its logprobs of the sampled tokens are from the sampler's: `train/logprob_gap_mean` (mean
|trainer - sampler| over sampled tokens), `train/logprob_gap_max`, and `train/sampler_kl_k3`, each
averaged over the RL steps. A MoE's router can send a token to other experts in the trainer's
forward than in the sampler's when their logits round apart (the reason routing replay exists);
the MoE/dense ratio says how much of the gap that adds here, and the third arm replays the
sampler's routes in the trainer's forward (`trainer.replay_routes`) to say how much of it that
removes. The engine and the trainer run the same weights on one machine, so any gap is rounding:
kernels, batch shapes, dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _common import format_table, toolgym_train

# (arm, model, overrides): the dense model, the MoE, and the MoE replaying the sampler's routes.
ARMS = (
    ("tiny", "tiny", []),
    ("tiny-moe", "tiny-moe", []),
    ("tiny-moe replay", "tiny-moe", ["trainer.replay_routes=true"]),
)
KEYS = ("train/logprob_gap_mean", "train/logprob_gap_max", "train/sampler_kl_k3")


def gaps(run_dir: Path) -> dict[str, float]:
    """Each KEYS metric averaged over the run's RL steps."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    train = [r for r in records if r.get("kind") == "train"]
    return {key: statistics.fmean(float(r[key]) for r in train if key in r) for key in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=20, help="RL steps")
    parser.add_argument("--sft-steps", type=int, default=300, help="SFT steps (> 50: the preset warms up 50)")
    parser.add_argument("--out", type=Path, default=Path("runs/moe_logprob_gap"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype in args.dtypes:
        measured = {}
        for arm, model, extra in ARMS:
            name = f"{arm.replace(' ', '_')}_{dtype}"
            run_dir = args.out / name
            overrides = [
                f"run.run_dir={run_dir}", f"model.name={model}", f"model.dtype={dtype}",
                f"run.steps={args.steps}", f"sft.steps={args.sft_steps}", "eval.every_steps=0",
                "eval.at_start=false", "run.plot=false", "run.export_hf=false", *extra,
            ]  # fmt: skip
            seconds = toolgym_train("zorplex_tiny", overrides, args.out / f"{name}.log")
            measured[arm] = gaps(run_dir)
            print(f"{arm} {dtype}: {measured[arm]} ({seconds:.0f} s)", flush=True)
        dense = measured["tiny"]
        for key in KEYS:
            cells = [dtype, key.removeprefix("train/")] + [f"{measured[arm][key]:.3g}" for arm, _, _ in ARMS]
            for arm, _, _ in ARMS[1:]:
                cells.append(f"{measured[arm][key] / dense[key]:.2f}" if dense[key] else "nan")
            rows.append(cells)
    arms = [arm for arm, _, _ in ARMS]
    print(format_table(["dtype", "metric", *arms, *(f"{arm} / dense" for arm in arms[1:])], rows))


if __name__ == "__main__":
    main()
