"""Env throughput: steps/s per tier with oracle actions, unwrapped vs through `gymnasium.make`.

    python bench/envs.py [--episodes 20000] [--repeats 3] [--cpu 0] [--json out.json]

Each measurement runs `episodes` oracle episodes (reset, oracle_actions(), every step) in this
one thread and counts steps per second of that whole loop, so reset costs are included. The best
of `repeats` runs is reported (timings on a shared machine only get slower, never faster).
`--cpu N` pins this process (only) to core N. The "peer" is the same env through
`gymnasium.make` with its default wrappers (PassiveEnvChecker, OrderEnforcing); the ratio is
unwrapped / make. Target: >= 50,000 Zorplex steps/s unwrapped.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import gymnasium

import toolgym.envs  # noqa: F401 (registers toolgym/*)

CONFIGS: list[tuple[str, str, dict]] = [
    ("zorplex simple", "toolgym/Zorplex-v0", {"tier": "simple"}),
    ("zorplex compositional easy", "toolgym/Zorplex-v0", {"tier": "compositional", "difficulty": "easy"}),
    ("zorplex compositional medium", "toolgym/Zorplex-v0", {"tier": "compositional", "difficulty": "medium"}),
    ("zorplex compositional hard", "toolgym/Zorplex-v0", {"tier": "compositional", "difficulty": "hard"}),
    ("zorplex multi_step", "toolgym/Zorplex-v0", {"tier": "multi_step"}),
    ("zorplex recursive", "toolgym/Zorplex-v0", {"tier": "recursive"}),
    ("sum_digits", "toolgym/SumDigits-v0", {}),
]
TARGET_STEPS_PER_S = 50_000


def steps_per_second(env: gymnasium.Env, episodes: int, seed: int = 0) -> float:
    oracle = env.unwrapped.oracle_actions
    env.reset(seed=seed)
    steps = 0
    start = time.perf_counter()
    for _ in range(episodes):
        env.reset()
        for action in oracle():
            env.step(action)
            steps += 1
    return steps / (time.perf_counter() - start)


def best_of(env: gymnasium.Env, episodes: int, repeats: int) -> float:
    steps_per_second(env, min(episodes, 200))  # warm up caches and the checker's first calls
    return max(steps_per_second(env, episodes, seed=repeat) for repeat in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu", type=int, default=None, help="pin this process to one core")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})

    rows = []
    print(f"{'env':<30} {'unwrapped steps/s':>18} {'gymnasium.make steps/s':>23} {'ratio':>6}")
    for name, env_id, kwargs in CONFIGS:
        unwrapped = best_of(gymnasium.make(env_id, **kwargs).unwrapped, args.episodes, args.repeats)
        made = best_of(gymnasium.make(env_id, **kwargs), args.episodes, args.repeats)
        rows.append({"env": name, "unwrapped": unwrapped, "make": made, "ratio": unwrapped / made})
        print(f"{name:<30} {unwrapped:>18,.0f} {made:>23,.0f} {unwrapped / made:>6.2f}")

    zorplex_min = min(row["unwrapped"] for row in rows if row["env"].startswith("zorplex"))
    verdict = "meets" if zorplex_min >= TARGET_STEPS_PER_S else "MISSES"
    print(
        f"slowest Zorplex tier unwrapped: {zorplex_min:,.0f} steps/s ({verdict} the {TARGET_STEPS_PER_S:,} target)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"episodes": args.episodes, "repeats": args.repeats, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
