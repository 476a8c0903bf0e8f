"""Check toolgym/BFCL-v0 against all 800 of BFCL's multi-turn tasks:

    python -m toolgym.tools.bfcl_check                      # every category
    python -m toolgym.tools.bfcl_check --category base

For each task, the oracle (the ground-truth calls, each turn ended with a reply) must end the
conversation graded correct, and leaving out any one ground-truth call must fail it, except the
drops BFCL's own checker accepts (`ACCEPTED_WITHOUT`, envs/adapters/bfcl.py). Prints one line per
category and each exception; exits 1 when any task breaks either rule. Needs
`pip install --no-deps bfcl-eval mpmath`.
"""

from __future__ import annotations

import argparse
import sys

from ..envs.adapters.bfcl import ACCEPTED_WITHOUT, CATEGORIES, BFCLEnv, actions_without, play


def check(category: str) -> list[str]:
    """The category's problems, one line each (empty: every task keeps both rules)."""
    env = BFCLEnv(category)
    problems: list[str] = []
    drops = 0
    for seed in range(len(env.tasks)):
        env.reset(seed=seed)
        task_id, calls = env.state.task_id, env.task.needed_tool_calls
        if not play(env, env.oracle_actions()):
            problems.append(f"{task_id}: the oracle fails (turns {env.state.failed})")
        for drop in range(calls):
            env.reset(seed=seed)
            drops += 1
            if play(env, actions_without(env, drop)) != ((task_id, drop) in ACCEPTED_WITHOUT):
                problems.append(f"{task_id}: leaving out call {drop} does not fail it")
    print(
        f"{category}: {len(env.tasks)} tasks, {drops} calls left out one at a time, {len(problems)} problems"
    )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check toolgym/BFCL-v0 on BFCL's multi-turn tasks.")
    parser.add_argument("--category", choices=CATEGORIES, action="append")
    args = parser.parse_args(argv)
    problems = [line for category in args.category or CATEGORIES for line in check(category)]
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
