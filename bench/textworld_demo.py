"""The long-horizon TextWorld demo: outcome credit against turn-level credit, keep-all context
against a window, on generated text adventures held out from training
(configs/textworld_tiny.toml: SFT on walkthroughs, then RL on other games).

    python bench/textworld_demo.py                                 # 3 seeds, the preset as shipped
    python bench/textworld_demo.py --seeds 0 --set run.steps=2 --set sft.steps=4 \
        --set sft.optimizer.warmup_steps=1 \
        --set sft.num_tasks=16 --set eval.num_tasks=4 --set eval.every_steps=1 \
        --out /tmp/textworld_smoke                                 # a smoke run (no meaningful figure)

Per seed, one `toolgym train textworld_tiny` run per arm (bench/rl_arms.py: the later arms start
RL from the first arm's SFT model):
- outcome: the preset as shipped (every turn given the episode's advantage);
- turn_loo: `batch.advantage.credit = "turn_loo"`: the game's score rises during the game, each
  point a reward at the turn it is earned, so per-turn returns-to-go carry real signal;
- dr_grpo: outcome credit without GRPO's division by the group's std
  (`batch.advantage.estimator = "dr_grpo"`), so a group that differs only by the cost of an
  invalid command gets advantages of that cost's size, not a win's;
- kl: outcome credit with a KL penalty to the SFT model (`trainer.loss.kl_coef = 0.1`);
- group16: outcome credit over groups of 16 samples, not 8 (`rollout.group_size = 16`), so a
  game most samples lose has more chances of a win in its group;
- no_invalid_cost: outcome credit with commands the game does not accept free
  (`env.kwargs.invalid_command_penalty = 0`), so groups differ by score and wins only;
- guided: outcome credit with one sample of each group of 8 played by the game's walkthrough
  (`rollout.guided_samples = 1`), so a game that every sample loses still has a win to learn from;
- window: outcome credit over a sliding window (`rollout.context.policy = "window"`, the game's
  opening, which states the goal, and the last two turns) instead of the whole history, from the
  keep-all SFT model;
- window_sft: the same window with SFT of its own, on walkthroughs recorded under the window.
  Each turn from the third on starts a segment (the opening and the last turns), and each
  segment is a demonstration of its own: ~7.5 of ~300 tokens a game against one of ~560 kept
  whole. So 4,800 games (~36,000 segments) and 32 segments a step: about the positions of a
  keep-all step, one pass in the same 1,200 steps; but a step trains ~230 tokens, a keep-all
  step ~1,000 (docs/demos.md).
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
        "dr_grpo": ["batch.advantage.estimator=dr_grpo"],
        "kl": ["trainer.loss.kl_coef=0.1"],
        "group16": ["rollout.group_size=16"],
        "no_invalid_cost": ["env.kwargs.invalid_command_penalty=0.0"],
        "guided": ["rollout.guided_samples=1"],
        "window": ["rollout.context.policy=window", "rollout.context.turns=2"],
        "window_sft": [
            "rollout.context.policy=window",
            "rollout.context.turns=2",
            "sft.batch_episodes=32",
            "sft.num_tasks=4800",
        ],
    },
    target={"success": 0.5},
    out=Path("runs/textworld_demo"),
    curves=Path(__file__).parent / "textworld_demo_curves.png",
    own_sft=frozenset({"window_sft"}),
)


if __name__ == "__main__":
    main({TEXTWORLD.preset: TEXTWORLD}, (__doc__ or "").split("\n")[0])
