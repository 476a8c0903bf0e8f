"""Outcome credit, turn-level credit, and turn-level credit with a per-lookup process reward, in one
run: on a Zorplex chain where each lookup needs the last one (configs/zorplex_chain_credit_tiny.toml,
three links; zorplex_chain4_credit_tiny.toml, four, with a fourth arm, baselines by state) and on
Zorplex's list tier (configs/zorplex_list_credit_tiny.toml, independent lookups).

    python bench/credit_demo.py                                    # 3 seeds, the chain as shipped
    python bench/credit_demo.py --preset zorplex_list_credit_tiny  # 3 seeds, the list
    python bench/credit_demo.py --preset zorplex_chain4_credit_tiny  # 3 seeds, four links
    python bench/credit_demo.py --seeds 0 --set run.steps=2 --set sft.steps=4 \
        --set sft.optimizer.warmup_steps=1 --set sft.num_tasks=64 --set eval.num_tasks=4 \
        --set eval.every_steps=1 \
        --out /tmp/credit_smoke                                    # a smoke run (no meaningful figure)

Per seed, one `toolgym train <preset>` run per arm (bench/rl_arms.py: the later arms start RL from
the first arm's SFT model):
- outcome: the preset as shipped (SFT, then RL with every turn given the episode's advantage);
- turn_loo: `batch.advantage.credit = "turn_loo"` (per-turn returns-to-go, a leave-one-out
  baseline per turn index: docs/credit.md);
- turn_loo+chain: the same, plus `env.kwargs.chain_reward` (the reward component `chain`: 0.1 for
  each lookup that follows the chain to its next word; on the list, 0.2 for each asked word's
  first lookup);
- turn_state (four links): `credit = "turn_state"`, each turn's baseline from the other episodes
  in the same state (followed/strayed lookups);
- outcome+chain (the list): the process reward with outcome credit, which separates what the
  reward adds from what the credit adds.
Held-out accuracy is the env's `accuracy` metric (a right answer), the same in every arm whatever
the reward; the target is 0.85. The curves go to `--curves` (bench/credit_demo_curves.png, bench/credit_demo_list_curves.png).

Last, the bound on what turn-level credit can change: returns-to-go drop from turn t's return only
the rewards before t, so per turn index it prints Var(rewards before t) / Var(episode reward) over
the turn_loo+chain arm's held-out episodes after SFT (its first recorded eval) that reach turn t.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from _common import format_table
from rl_arms import ArmsBench, main  # bench/ is sys.path[0] when run as a script

from toolgym.rollouts.recording.format import read_recording
from toolgym.rollouts.scoring.credit import past_reward_share, turn_rewards

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
CHAIN4 = replace(
    CHAIN,
    preset="zorplex_chain4_credit_tiny",
    arms={**CHAIN.arms, "turn_state": ["batch.advantage.credit=turn_state"]},
    out=Path("runs/credit_demo_chain4"),
    curves=Path(__file__).parent / "credit_demo_chain4_curves.png",
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


def past_reward_shares(per_turn_rewards: list[list[float]]) -> list[float | None]:
    """`past_reward_share` at each turn index t that at least half of the episodes reach."""
    n = len(per_turn_rewards)
    turns = max(map(len, per_turn_rewards), default=0)
    reached = [t for t in range(turns) if 2 * sum(len(r) > t for r in per_turn_rewards) >= n]
    return [past_reward_share(per_turn_rewards, t) for t in reached]


def report_past_reward_shares(bench: ArmsBench, out: Path, seeds: list[int]) -> None:
    rows = []
    for seed in seeds:
        evals = sorted(
            (bench.run_dir(out, "turn_loo+chain", seed) / "trajectories").glob("eval_step_*.jsonl")
        )
        if evals:
            _, episodes = read_recording(evals[0])
            shares = past_reward_shares([turn_rewards(e) for e in episodes])
            rows.append([seed, len(episodes), *("-" if v is None else f"{v:.3f}" for v in shares)])
    if rows:
        width = max(map(len, rows)) - 2
        rows = [row + ["-"] * (width + 2 - len(row)) for row in rows]
        print(
            "the most turn-level credit can remove from turn t's return variance (turn_loo+chain, after SFT):"
        )
        print(format_table(["seed", "episodes", *(f"t={t}" for t in range(width))], rows))


if __name__ == "__main__":
    benches = {b.preset: b for b in (CHAIN, CHAIN4, LIST)}
    args = main(benches, (__doc__ or "").split("\n")[0])
    report_past_reward_shares(benches[args.preset], args.out, args.seeds)
