"""RL on LoRA adapters against RL on every weight, from the same SFT model: the CPU demo
(configs/zorplex_tiny.toml) and the multi-turn demo (configs/zorplex_recursive_tiny.toml).

    python bench/lora_demo.py --jobs 2                                 # the CPU demo, 3 seeds
    python bench/lora_demo.py --preset zorplex_recursive_tiny --jobs 2 # the multi-turn demo
    python bench/lora_demo.py --seeds 0 --set run.steps=2 --set sft.steps=4 --set sft.num_tasks=64 \
        --set sft.optimizer.warmup_steps=1 --set eval.num_tasks=4 --set eval.every_steps=1 \
        --out /tmp/lora_smoke                                          # a smoke run (no figure)

Per seed, `toolgym train <preset>` runs (bench/rl_arms.py: the later arms start RL from the first
arm's SFT model; SFT trains every weight):
- full: the preset as shipped, RL on every weight;
- lora_r8: `policy.lora.rank=8` (alpha 16: the adapters scaled by 2), RL on the adapters alone at
  the preset's lr;
- lora_r8_lr1e-3: the same at lr 1e-3 (5x the presets' 2e-4): a zero-initialised B moves the
  product s·BA by about lr·s·|A| per step, a fraction of what Adam moves a full weight by;
- lora_r8_lr2e-3: 10x (zorplex_tiny only, as is lora_r8: zorplex_recursive_tiny runs full and
  lora_r8_lr1e-3);
- lora_r8_lr1e-3_dr, lora_r8_lr2e-3_dr: 5x and 10x with Dr. GRPO's mean-centred advantages
  (zorplex_tiny; GRPO's std division makes the 0.2 format-reward gap unit-scale once every answer
  is right, which collapsed an adapter run, docs/training.md);
- lora_r8_lr2e-3_eps0.1: 10x, GRPO with 0.1 added to the group's std (a floor that shrinks a
  format-only 0.2 gap's advantages about 2x and a right/wrong gap's by about 15%).
The held-out targets are the presets': tag rate >= 0.95 with accuracy >= 0.90 (zorplex_tiny),
accuracy >= 0.90 (zorplex_recursive_tiny). The curves go to bench/lora_demo_<preset>_curves.png.
"""

from __future__ import annotations

from pathlib import Path

from rl_arms import ArmsBench, main  # bench/ is sys.path[0] when run as a script

FULL: list[str] = []
LORA = ["policy.lora.rank=8"]
LORA_5X = ["policy.lora.rank=8", "trainer.optimizer.lr=1e-3"]
LORA_10X = ["policy.lora.rank=8", "trainer.optimizer.lr=2e-3"]
DR_GRPO = ["batch.advantage.estimator=dr_grpo"]
STD_FLOOR = ["batch.advantage.eps=0.1"]
BENCHES = {
    preset: ArmsBench(
        preset=preset,
        arms=arms,
        target=target,
        out=Path("runs/lora_demo") / preset,
        curves=Path(__file__).parent / f"lora_demo_{preset}_curves.png",
    )
    for preset, arms, target in [
        (
            "zorplex_tiny",
            {
                "full": FULL,
                "lora_r8": LORA,
                "lora_r8_lr1e-3": LORA_5X,
                "lora_r8_lr2e-3": LORA_10X,
                "lora_r8_lr1e-3_dr": LORA_5X + DR_GRPO,
                "lora_r8_lr2e-3_dr": LORA_10X + DR_GRPO,
                "lora_r8_lr2e-3_eps0.1": LORA_10X + STD_FLOOR,
            },
            {"tag_rate": 0.95, "accuracy": 0.90},
        ),
        ("zorplex_recursive_tiny", {"full": FULL, "lora_r8_lr1e-3": LORA_5X}, {"accuracy": 0.90}),
    ]
}

if __name__ == "__main__":
    main(BENCHES, (__doc__ or "").split("\n")[0])
