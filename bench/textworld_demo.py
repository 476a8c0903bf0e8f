"""The long-horizon TextWorld demo: outcome credit against turn-level credit, keep-all context
against a window, on generated text adventures held out from training
(configs/textworld_tiny.toml: SFT on walkthroughs, then RL on other games).

    python bench/textworld_demo.py                                 # 3 seeds, the preset as shipped
    python bench/textworld_demo.py --seeds 0 --set run.steps=2 --set sft.steps=4 \
        --set sft.num_tasks=16 --set eval.num_tasks=4 --set eval.every_steps=1 \
        --out /tmp/textworld_smoke                                 # a smoke run (no meaningful figure)

Per seed, one `toolgym train textworld_tiny` run per arm (bench/rl_arms.py: the later arms start
RL from the first arm's SFT model):
- outcome: the preset as shipped (every turn given the episode's advantage);
- turn_loo: `batch.advantage.credit = "turn_loo"`: the game's score rises during the game, each
  point a reward at the turn it is earned, so per-turn returns-to-go carry real signal;
- window: outcome credit over a sliding window (`rollout.context.policy = "window"`, the game's
  opening, which states the goal, and the last two turns) instead of the whole history.
Held-out success is the env's `success` metric (the game won) on eval seeds that neither SFT nor
RL plays; the target is `--set` free: success >= 0.5. The curves go to bench/textworld_demo_curves.png.
"""

from __future__ import annotations

from pathlib import Path

from rl_arms import ArmsBench, main  # bench/ is sys.path[0] when run as a script

TEXTWORLD = ArmsBench(
    preset="textworld_tiny",
    arms={
        "outcome": [],
        "turn_loo": ["batch.advantage.credit=turn_loo"],
        "window": ["rollout.context.policy=window", "rollout.context.turns=2"],
    },
    target={"success": 0.5},
    out=Path("runs/textworld_demo"),
    curves=Path(__file__).parent / "textworld_demo_curves.png",
)


if __name__ == "__main__":
    main({TEXTWORLD.preset: TEXTWORLD}, (__doc__ or "").split("\n")[0])
