"""Model-written notes against keep-all and a sliding window, on a Zorplex chain longer than the
context window (configs/zorplex_notes_tiny.toml: four redirects, a 320-token window).

    python bench/notes_demo.py                                     # 3 seeds, the preset as shipped
    python bench/notes_demo.py --seeds 0 --set run.steps=2 --set sft.steps=4 \
        --set sft.num_tasks=64 --set eval.num_tasks=4 --set eval.every_steps=1 \
        --out /tmp/notes_smoke                                     # a smoke run (no meaningful figure)

Per seed, three `toolgym train zorplex_notes_tiny` runs (bench/rl_arms.py: the later arms start
RL from the first arm's SFT model, so every arm starts from the same note-taking policy):
- notes: the preset as shipped (each NOTE cuts the context back to the system prompt, the task
  and the last note);
- keep_all: `rollout.context.policy = "keep_all"` (the notes are written but cut nothing; the
  history overflows the window before the last lookup, and the episode is truncated);
- window: `rollout.context.policy = "window"`, the last two turns (head + the two newest turns).
Held-out accuracy is the env's `accuracy` metric (a right answer); the target is 0.80 for the
notes arm. The curves go to `--curves` (bench/notes_demo_curves.png).
"""

from __future__ import annotations

from pathlib import Path

from rl_arms import ArmsBench, main  # bench/ is sys.path[0] when run as a script

BENCH = ArmsBench(
    preset="zorplex_notes_tiny",
    arms={
        "notes": [],
        "keep_all": ["rollout.context.policy=keep_all"],
        "window": ["rollout.context.policy=window", "rollout.context.turns=2"],
    },
    target={"accuracy": 0.80},
    out=Path("runs/notes_demo"),
    curves=Path(__file__).parent / "notes_demo_curves.png",
)

if __name__ == "__main__":
    main({BENCH.preset: BENCH}, (__doc__ or "").split("\n")[0])
