"""Outcome credit, turn-level credit, and turn-level credit with a per-lookup process reward, in one
run: on a 4-link Zorplex chain (configs/zorplex_chain_credit_tiny.toml, where each lookup needs the
last one) and on Zorplex's list tier (configs/zorplex_list_credit_tiny.toml, four independent
lookups).

    python bench/credit_demo.py                                    # 3 seeds, the chain as shipped
    python bench/credit_demo.py --preset zorplex_list_credit_tiny  # 3 seeds, the list
    python bench/credit_demo.py --seeds 0 --set run.steps=2 --set sft.steps=4 \
        --set sft.num_tasks=64 --set eval.num_tasks=4 --set eval.every_steps=1 \
        --out /tmp/credit_smoke                                    # a smoke run (no meaningful figure)

Per seed, one `toolgym train <preset>` run per arm (bench/rl_arms.py: the later arms start RL from
the first arm's SFT model):
- outcome: the preset as shipped (SFT, then RL with every turn given the episode's advantage);
- turn_loo: `batch.advantage.credit = "turn_loo"` (per-turn returns-to-go, a leave-one-out
  baseline per turn index: docs/credit.md);
- turn_loo+chain: the same, plus `env.kwargs.chain_reward` (the reward component `chain`: 0.1 for
  each lookup that follows the chain to its next word; on the list, 0.2 for each asked word's
  first lookup);
- outcome+chain (the list): the process reward with outcome credit, which separates what the
  reward adds from what the credit adds.
Held-out accuracy is the env's `accuracy` metric (a right answer), the same in every arm whatever
the reward; the target is 0.85. The curves go to `--curves` (bench/credit_demo_curves.png, bench/credit_demo_list_curves.png).
"""

from __future__ import annotations

from pathlib import Path

from rl_arms import ArmsBench, main  # bench/ is sys.path[0] when run as a script

CHAIN = ArmsBench(
    preset="zorplex_chain_credit_tiny",
    arms={
        "outcome": [],
        "turn_loo": ["batch.advantage.credit=turn_loo"],
        "turn_loo+chain": ["batch.advantage.credit=turn_loo", "env.kwargs.chain_reward=0.1"],
    },
    target={"accuracy": 0.85},
    out=Path("runs/credit_demo"),
    curves=Path(__file__).parent / "credit_demo_curves.png",
)
LIST = ArmsBench(
    preset="zorplex_list_credit_tiny",
    arms={
        "outcome": [],
        "turn_loo": ["batch.advantage.credit=turn_loo"],
        "turn_loo+chain": ["batch.advantage.credit=turn_loo", "env.kwargs.chain_reward=0.2"],
        "outcome+chain": ["env.kwargs.chain_reward=0.2"],
    },
    target={"accuracy": 0.85},
    out=Path("runs/credit_demo_list"),
    curves=Path(__file__).parent / "credit_demo_list_curves.png",
)

if __name__ == "__main__":
    main({CHAIN.preset: CHAIN, LIST.preset: LIST}, (__doc__ or "").split("\n")[0])
