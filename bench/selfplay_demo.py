"""The self-play demo on Nim: mirror self-play against RL on the random player alone.

Both evaluated against the random and the expert bot (configs/selfplay_tiny.toml: SFT on random
legal moves, then RL).

    python bench/selfplay_demo.py                                  # 3 seeds, the preset as shipped
    python bench/selfplay_demo.py --seeds 0 --set run.steps=2 --set eval.every_steps=1 \
        --out /tmp/selfplay_smoke                                  # a smoke run (no meaningful figure)

Per seed, one `toolgym train selfplay_tiny` run per arm (bench/rl_arms.py: the later arms start
RL from the first arm's SFT model):
- mirror: mirror self-play (both seats the policy, both trained, groups per (task, seat));
- vs_random: `selfplay.enabled = false` and the env's opponent the random bot: plain RL of one
  seat against the random player, the same steps;
- pool: the preset as shipped (one seat a match against a snapshot drawn from the pool of the
  policy's own, by its loss rate against each; Elo logged).
Both report eval/vs_random/* and eval/vs_expert/* (`selfplay.eval_opponents`). Targets: win rate
against the random player >= 0.9 (`vs_random/success`); against the expert, whose optimal play
leaves only the positions the policy's seat can win, the rise from step 0 to the end (read off
the table). The curves go to bench/selfplay_demo_curves.png.

    python bench/selfplay_demo.py --preset selfplay_tictactoe_tiny --seeds 0

is the same loop on TextArena's TicTacToe (the preset as shipped, the pool arm alone), evaluated
against TextArena's random and `first` bots.
"""

from __future__ import annotations

from pathlib import Path

from rl_arms import ArmsBench, main  # bench/ is sys.path[0] when run as a script

SELFPLAY = ArmsBench(
    preset="selfplay_tiny",
    arms={
        "mirror": ["selfplay.learn=\"all\"", "selfplay.opponent=\"self\""],
        "vs_random": ["selfplay.enabled=false", "env.kwargs.opponent=\"random\""],
        "pool": [],
    },
    target={"vs_random/success": 0.9, "vs_expert/success": 0.0},
    out=Path("runs/selfplay_demo"),
    curves=Path(__file__).parent / "selfplay_demo_curves.png",
)

TICTACTOE = ArmsBench(
    preset="selfplay_tictactoe_tiny",
    arms={"pool": []},
    target={"vs_random/success": 0.9, "vs_first/success": 0.0},
    out=Path("runs/selfplay_tictactoe"),
    curves=Path(__file__).parent / "selfplay_tictactoe_curves.png",
)


if __name__ == "__main__":
    main({b.preset: b for b in (SELFPLAY, TICTACTOE)}, (__doc__ or "").split("\n")[0])
