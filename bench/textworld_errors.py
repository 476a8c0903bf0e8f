"""Where a TextWorld policy first leaves the walkthrough, in a run's eval recordings: for each
held-out episode, the game is made again from its task seed (the run's cached games), its
walkthrough read from the env's oracle, and the policy's first command that differs from it
classified:

- "right command, other names": the walkthrough's verb at that step with names the step does not
  hold (`open box44` for `open box49`): the model fails to copy a name;
- "a later step" / "an earlier step" of the walkthrough: it lost its place in the goal;
- "another command".

    python bench/textworld_errors.py runs/textworld_demo/outcome_s1            # its first eval
    python bench/textworld_errors.py runs/textworld_demo/outcome_s1 --step 20  # the eval at step 20
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import gymnasium

import toolgym.envs  # noqa: F401  (registers the envs)
from toolgym.rollouts.recording.format import read_recording


def first_deviations(recording: Path) -> tuple[collections.Counter, collections.Counter, list[str]]:
    """(how many episodes first deviate at each step, the kinds of deviation, examples)."""
    header, trajectories = read_recording(recording)
    env = gymnasium.make(header.env_id, **header.env_kwargs)
    steps, kinds, examples = collections.Counter(), collections.Counter(), []
    try:
        for trajectory in trajectories:
            observation, _ = env.reset(seed=trajectory.task_seed)
            if observation != trajectory.transitions[0].observation:
                raise SystemExit(f"{recording}: task seed {trajectory.task_seed} makes another game now")
            walkthrough = env.unwrapped.oracle_actions()
            played = [t.action.text.strip() for t in trajectory.transitions]
            k = next((i for i, (a, w) in enumerate(zip(played, walkthrough, strict=False)) if a != w), None)
            if k is None:
                steps["none"] += 1
                continue
            steps[k] += 1
            action, expected = played[k], walkthrough[k]
            if action in walkthrough[k + 1 :]:
                kind = "a later step"
            elif action in walkthrough[:k]:
                kind = "an earlier step"
            elif action.split()[:1] == expected.split()[:1]:
                kind = "right command, other names"
            else:
                kind = "another command"
            kinds[kind] += 1
            if len(examples) < 6:
                examples.append(f"step {k}: {action!r} for {expected!r}")
    finally:
        env.close()
    return steps, kinds, examples


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("run", type=Path, help="a textworld_tiny run directory")
    parser.add_argument("--step", type=int, default=0, help="the eval step (default: the first)")
    args = parser.parse_args()
    recording = args.run / "trajectories" / f"eval_step_{args.step:08d}.jsonl"
    steps, kinds, examples = first_deviations(recording)
    total = sum(steps.values())
    print(f"{recording}: {total} episodes")
    print(
        "first deviation at walkthrough step:",
        ", ".join(f"{k}: {n}" for k, n in sorted(steps.items(), key=str)),
    )
    print("kind:", ", ".join(f"{kind} {n}" for kind, n in kinds.most_common()))
    for line in examples:
        print("  " + line)


if __name__ == "__main__":
    main()
