"""The code sandbox as a tool (configs/pycalc_tiny.toml): held-out accuracy on 3-digit products
with the sandbox, against the same model, SFT and RL steps with no tool at all.

    python bench/pycalc_demo.py --jobs 2              # seeds 0, 1, 2 (needs bubblewrap)
    python bench/pycalc_demo.py --seeds 0 --set run.steps=2 --set sft.steps=4 --set sft.num_tasks=64 \
        --set sft.optimizer.warmup_steps=1 --set eval.num_tasks=4 --set eval.every_steps=1 \
        --out /tmp/pycalc_smoke                       # a smoke run (no figure)

Per seed, three `toolgym train pycalc_tiny` runs (bench/rl_arms.py):
- tool: the preset as shipped: SFT on demonstrations that call python half the time and guess
  100000 otherwise, then RL;
- no_tool: `env.kwargs.tool=false`: the same tasks with no tool (no sandbox started), SFT on the
  right answers stated at once, then RL, its own SFT (its demonstrations differ);
- no_tool_same_wall: the same with 2900 SFT steps, about the tool run's wall time on one core
  (a tool-free SFT step is ~4x cheaper: its sequences are shorter and it runs no sandbox).
The target is held-out accuracy >= 0.90 (with the tool; the tool-free model is the baseline).
The curves go to bench/pycalc_demo_curves.png.
"""

from __future__ import annotations

from pathlib import Path

from rl_arms import ArmsBench, main  # bench/ is sys.path[0] when run as a script

BENCH = ArmsBench(
    preset="pycalc_tiny",
    arms={
        "tool": [],
        "no_tool": ["env.kwargs.tool=false"],
        "no_tool_same_wall": ["env.kwargs.tool=false", "sft.steps=2900"],
    },
    target={"accuracy": 0.90},
    out=Path("runs/pycalc_demo"),
    curves=Path(__file__).parent / "pycalc_demo_curves.png",
    own_sft=frozenset({"no_tool", "no_tool_same_wall"}),
)

if __name__ == "__main__":
    main({BENCH.preset: BENCH}, (__doc__ or "").split("\n")[0])
