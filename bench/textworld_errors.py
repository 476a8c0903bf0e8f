"""Where a TextWorld policy first leaves the walkthrough, in a run's eval recordings: for each
held-out episode, the game is made again from its task seed (the run's cached games), its
walkthrough read from the env's oracle, and the policy's first command that differs from it
classified:

- "right command, other names": the walkthrough's verb at that step with names the step does not
  hold (`open box44` for `open box49`): the model fails to copy a name;
- "a later step" / "an earlier step" of the walkthrough: it lost its place in the goal;
- "another command".

It also counts the names the policy wrote right, by kind (lettered: X-key; numbered: box49), in
every command up to the first deviation whose verb and length are the walkthrough's; and, per
game, how many of its episodes won, and in how many of the games every episode lost the episodes
first left the walkthrough alike (at the same step, with the same command): a policy sure of its
mistake, whose RL groups on such a game all fail and give no signal.

    python bench/textworld_errors.py runs/textworld_demo/outcome_s1            # its first eval
    python bench/textworld_errors.py runs/textworld_demo/outcome_s1 --step 20  # the eval at step 20
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

import gymnasium

import toolgym.envs  # noqa: F401  (registers the envs)
from toolgym.envs.adapters.textworld import NOUNS
from toolgym.rollouts.recording.format import read_recording

NAME_KINDS = {
    "lettered": re.compile(r"^[A-Za-z]-(key|box|door)$"),
    "numbered": re.compile(rf"^({'|'.join(NOUNS)})\d{{1,2}}$"),
}


def first_deviations(
    recording: Path,
) -> tuple[collections.Counter, collections.Counter, list[str], collections.Counter, dict[int, list[tuple]]]:
    """(how many episodes first deviate at each step, the kinds of deviation, examples, names
    right and wrong by kind: keys (kind, True/False), and per game (task seed) each episode's
    (won, first deviating step or None, the command written there))."""
    header, trajectories = read_recording(recording)
    env = gymnasium.make(header.env_id, **header.env_kwargs)
    steps, kinds, examples, names = collections.Counter(), collections.Counter(), [], collections.Counter()
    games: dict[int, list[tuple]] = collections.defaultdict(list)
    try:
        for trajectory in trajectories:
            observation, _ = env.reset(seed=trajectory.task_seed)
            if observation != trajectory.transitions[0].observation:
                raise SystemExit(f"{recording}: task seed {trajectory.task_seed} makes another game now")
            walkthrough = env.unwrapped.oracle_actions()
            played = [t.action.text.strip() for t in trajectory.transitions]
            k = next((i for i, (a, w) in enumerate(zip(played, walkthrough, strict=False)) if a != w), None)
            won = bool(trajectory.metrics.get("env", {}).get("success"))
            games[trajectory.task_seed].append((won, k, None if k is None else played[k]))
            for action, expected in list(zip(played, walkthrough, strict=False))[
                : None if k is None else k + 1
            ]:
                words, wanted = action.split(), expected.split()
                if words[:1] == wanted[:1] and len(words) == len(wanted):
                    for word, want in zip(words, wanted, strict=True):
                        kind = next((n for n, pattern in NAME_KINDS.items() if pattern.match(want)), None)
                        if kind:
                            names[kind, word == want] += 1
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
    return steps, kinds, examples, names, games


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("run", type=Path, help="a textworld_tiny run directory")
    parser.add_argument("--step", type=int, default=0, help="the eval step (default: the first)")
    args = parser.parse_args()
    recording = args.run / "trajectories" / f"eval_step_{args.step:08d}.jsonl"
    steps, kinds, examples, names, games = first_deviations(recording)
    total = sum(steps.values())
    print(f"{recording}: {total} episodes")
    print(
        "first deviation at walkthrough step:",
        ", ".join(f"{k}: {n}" for k, n in sorted(steps.items(), key=str)),
    )
    print("kind:", ", ".join(f"{kind} {n}" for kind, n in kinds.most_common()))
    print(
        "names written right, up to the first deviation:",
        ", ".join(
            f"{kind} {names[kind, True]}/{names[kind, True] + names[kind, False]}" for kind in NAME_KINDS
        ),
    )
    wins = collections.Counter(sum(won for won, _, _ in episodes) for episodes in games.values())
    samples = {len(episodes) for episodes in games.values()}
    print(f"games ({len(games)}, {'/'.join(map(str, sorted(samples)))} episodes each) by episodes won:",
          ", ".join(f"{n} won: {count}" for n, count in sorted(wins.items())))  # fmt: skip
    lost = [
        episodes for episodes in games.values() if len(episodes) > 1 and not any(w for w, _, _ in episodes)
    ]
    alike = sum(len({(k, command) for _, k, command in episodes}) == 1 for episodes in lost)
    print(f"games lost by every episode: {alike} of {len(lost)} first leave the walkthrough alike", end="")
    print(" (the same step, the same command)")
    for line in examples:
        print("  " + line)


if __name__ == "__main__":
    main()
