"""Model-written notes against keep-all and a sliding window, on a Zorplex chain longer than the
context window (configs/zorplex_notes_tiny.toml: four redirects, a 320-token window).

    python bench/notes_demo.py                                     # 3 seeds, the preset as shipped
    python bench/notes_demo.py --seeds 0 --set run.steps=2 --set sft.steps=4 \
        --set sft.optimizer.warmup_steps=1 --set sft.num_tasks=64 --set eval.num_tasks=4 \
        --set eval.every_steps=1 \
        --out /tmp/notes_smoke                                     # a smoke run (no meaningful figure)

Per seed, one `toolgym train zorplex_notes_tiny` run per arm (bench/rl_arms.py: the later arms
start RL from the first arm's SFT model, so they start from the same note-taking policy):
- notes: the preset as shipped (each NOTE cuts the context back to the system prompt, the task
  and the last note);
- keep_all: `rollout.context.policy = "keep_all"` (the notes are written but cut nothing; the
  history overflows the window before the last lookup, and the episode is truncated);
- window: `rollout.context.policy = "window"`, the last two turns (head + the two newest turns),
  from the same note-taking SFT model;
- window_no_notes: its own SFT and RL without the NOTE tool (`env.kwargs.notes = false`) under
  the same window: the demonstrator follows the chain without notes, and the window keeps the
  last `SEE:` result, which is all this chain needs.
Held-out accuracy is the env's `accuracy` metric (a right answer); the target is 0.80 for the
notes arm. The curves go to `--curves` (bench/notes_demo_curves.png).

Then, per seed, what the notes arm's notes contain in its held-out episodes after SFT and at the
end (its recorded eval trajectories): notes per episode, the share that copy the `SEE:` target the
model had just read (the note the task needs; on the collecting chain, the values read so far and
that target), that have the right form but other content (another word, a miscopied value), or
that carry other text, and the accuracy of the episodes whose every note was a right copy; and one
episode's actions.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from _common import format_table
from rl_arms import ArmsBench, main  # bench/ is sys.path[0] when run as a script

from toolgym.envs.core.info import NOTE
from toolgym.rollouts.recording.format import read_recording
from toolgym.rollouts.types import Trajectory

_SEE = re.compile(r"= (?:(\d+) )?SEE: (\w+)\s*$")  # `= SEE: sun`, collecting `= 12 SEE: sun`

ARMS = {
    "notes": [],
    "keep_all": ["rollout.context.policy=keep_all"],
    "window": ["rollout.context.policy=window", "rollout.context.turns=2"],
    "window_no_notes": [
        "env.kwargs.notes=false",
        "rollout.context.policy=window",
        "rollout.context.turns=2",
    ],
}
BENCH = ArmsBench(
    preset="zorplex_notes_tiny",
    arms=ARMS,
    target={"accuracy": 0.80},
    out=Path("runs/notes_demo"),
    curves=Path(__file__).parent / "notes_demo_curves.png",
    own_sft=frozenset({"window_no_notes"}),
)
VALUES = replace(
    BENCH,
    preset="zorplex_notes_values_tiny",
    out=Path("runs/notes_demo_values"),
    curves=Path(__file__).parent / "notes_demo_values_curves.png",
)


def note_kinds(episodes: list[Trajectory]) -> dict[str, float]:
    """What the notes of one eval's recorded episodes contain (see the module doc)."""
    counts = {"right copy": 0, "other content": 0, "other text": 0}
    clean, clean_right = 0, 0
    for episode in episodes:
        kinds, values = [], []  # values: those read so far (the collecting chain's)
        for transition in episode.transitions:
            seen = _SEE.search(transition.observation)
            if seen is not None and seen.group(1) is not None:
                values.append(seen.group(1))
            note = transition.info.get(NOTE)
            if note is None:
                continue
            right = None if seen is None else " ".join([*values, seen.group(2)])
            if note.strip() == right:
                kinds.append("right copy")
            else:  # the right form: as many values as read, then a word
                form = rf"(\d+ ){{{len(values)}}}[a-z]+"
                kinds.append("other content" if re.fullmatch(form, note.strip()) else "other text")
        for kind in kinds:
            counts[kind] += 1
        if kinds and all(k == "right copy" for k in kinds):
            clean += 1
            clean_right += episode.final_observation == "CORRECT"
    notes = sum(counts.values())
    return {
        "episodes": len(episodes),
        "notes per episode": notes / max(1, len(episodes)),
        **{kind: n / max(1, notes) for kind, n in counts.items()},
        "accuracy, all notes right": clean_right / max(1, clean),
    }


def example(episode: Trajectory) -> str:
    """One recorded episode's question and actions, one line."""
    actions = " | ".join(t.action.text for t in episode.transitions)
    return f"{episode.transitions[0].observation}  {actions}  -> {episode.final_observation}"


def report_notes(out: Path, seeds: list[int]) -> None:
    rows, examples = [], []
    for seed in seeds:
        evals = sorted((BENCH.run_dir(out, "notes", seed) / "trajectories").glob("eval_step_*.jsonl"))
        if not evals:
            continue
        for label, path in (
            ("after SFT", evals[0]),
            (f"step {int(evals[-1].stem.split('_')[-1])}", evals[-1]),
        ):
            _, episodes = read_recording(path)
            kinds = note_kinds(episodes)
            rows.append([seed, label, *(f"{v:.3f}" if isinstance(v, float) else v for v in kinds.values())])
        examples.append(f"seed {seed}, last eval: {example(episodes[0])}")
    if rows:
        headers = ["seed", "eval", "episodes", "notes per episode", "right copy", "other content", "other text",
                   "accuracy, all notes right"]  # fmt: skip
        print("the notes arm's held-out notes:")
        print(format_table(headers, rows))
        print("\n".join(examples))


if __name__ == "__main__":
    args = main({b.preset: b for b in (BENCH, VALUES)}, (__doc__ or "").split("\n")[0])
    report_notes(args.out, args.seeds)
