"""RL from a judge model against RL from the env's grader, from one SFT model, over seeds, with the
judge served by this script (configs/zorplex_judged_tiny.toml; docs/demos.md, "Rewards from a judge").

    python bench/judged_demo.py --judge runs/judge_zorplex_tiny-<time>/final_model
    python bench/judged_demo.py                 # the judge built first, by its recipe, in --out/judge
    python bench/judged_demo.py --judge J --seeds 0 --set run.steps=2 --set sft.steps=4 \
        --set sft.optimizer.warmup_steps=1 --set sft.num_tasks=64 --set eval.num_tasks=4 \
        --set eval.every_steps=1 \
        --out /tmp/judged_smoke                 # a smoke run (no meaningful figure)

The judge: `--judge` (a checkpoint directory), or configs/judge_zorplex_tiny.toml's recipe run here
(a fallible oracle's 4,000 episodes recorded, each made the judge's question with the grader's
verdict as the answer, 300 SFT steps). `toolgym serve` serves it on a free 127.0.0.1 port for the
whole bench and is stopped at the end. Per seed, one `toolgym train zorplex_judged_tiny` per arm
(bench/rl_arms.py: the later arms start RL from the first arm's SFT model):
- grader: no judge (`judge.url = ""`): the env's own reward, the CPU demo's RL;
- judge: the judge's verdict is the whole reward (`judge.reward = "replace"`, as shipped);
- judge+check: the judge beside a programmatic check of the `[ANSWER] <number>` form
  (toolgym.examples.judge_checks:answer_tagged, weight 1);
- group-judge (with `--group-judge J`, a ranking judge: `toolgym judge-data --group-size 8` of the
  same recording, SFT'd alike; served beside the first): one request per group, the group's 8
  episodes in a random order (`judge.mode = "group"`), its scores the whole reward.
Held-out success is the env's grader's (which the judge arms never train on); the target is 0.9,
and a judge arm that reaches it may still lose it to reward hacking, so the end value matters as
much. Last, per judge arm and seed: the training batches' hacking rate (episodes the judge passed
that the grader failed, `judge/hacking_rate`), its highest and its last value.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from _common import format_table
from judge_bench import free_port, serve
from rl_arms import ArmsBench, _records, main

CRITERION = "The final answer is correct."
CHECK = "toolgym.examples.judge_checks:answer_tagged"
ARMS = ("grader", "judge", "judge+check", "group-judge")


def arms(url: str, group_url: str | None = None) -> dict[str, list[str]]:
    correct = f'{{ name = "correct", prompt = "{CRITERION}", weight = 1.0 }}'
    tagged = f'{{ name = "tagged", function = "{CHECK}", weight = 1.0 }}'
    out = {
        "grader": ["judge.url="],
        "judge": [f"judge.url={url}"],
        "judge+check": [f"judge.url={url}", f"judge.criteria=[{correct}, {tagged}]"],
    }
    if group_url is not None:  # a group's 8 scores: '{"scores": [1, 0, ...]}' is ~30 tokens
        out["group-judge"] = [f"judge.url={group_url}", "judge.mode=group", "judge.max_tokens=64"]
    return out


def toolgym(*args: str, log: Path) -> None:
    """One `toolgym` command of the judge's recipe, its output to `log`; a failure exits naming it."""
    command = [sys.executable, "-m", "toolgym.configs.cli", *args]
    with log.open("w") as out:
        if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed; its output: {log}")


def build_judge(out: Path) -> Path:
    """configs/judge_zorplex_tiny.toml's recipe, in `out`; returns the judge's checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    noisy, questions, recording = out / "noisy.jsonl", out / "judge.jsonl", out / "judge_rec.jsonl"
    print(f"building the judge in {out} (its recipe: record, judge-data, import, SFT)", flush=True)
    toolgym("record", "--env", "toolgym/Zorplex-v0", "--tasks", "4000", "--out", str(noisy),
            "--p-omit-tag", "0.2", "--p-malformed-call", "0.15", "--p-stop-early", "0.15",
            "--p-skip-lookup", "0.1", log=out / "record.log")  # fmt: skip
    toolgym("judge-data", str(noisy), "--criterion", CRITERION, "--max-transcript-chars", "200",
            "--out", str(questions), log=out / "judge_data.log")  # fmt: skip
    toolgym("import", str(questions), "--out", str(recording), log=out / "import.log")
    run = out / "train"
    toolgym("train", "judge_zorplex_tiny", "--no-progress", "--set", f"sft.recording={recording}",
            "--set", f"run.run_dir={run}", log=out / "train.log")  # fmt: skip
    return run / "final_model"


def hacking(out: Path, bench: ArmsBench, seeds: list[int]) -> None:
    """Per judge arm and seed: the training batches' highest and last `judge/hacking_rate`."""
    rows = []
    for arm in ARMS[1:]:
        for seed in seeds:
            metrics = bench.run_dir(out, arm, seed) / "metrics.jsonl"
            if not metrics.exists():
                continue
            rates = [
                (r["step"], value)
                for r in _records(metrics.parent)
                if r["kind"] == "train"
                for key, value in r.items()
                if key.endswith("judge/hacking_rate")
            ]
            if rates:
                worst = max(rates, key=lambda sv: sv[1])
                rows.append([arm, seed, f"{worst[1]:.3f} (step {worst[0]})", f"{rates[-1][1]:.3f}"])
    if rows:
        print("\ntraining batches' hacking rate (passed by the judge, failed by the grader)")
        print(format_table(["arm", "seed", "highest", "last"], rows))


def run() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--judge", type=Path, help="the judge's checkpoint (default: built by its recipe)")
    parser.add_argument("--group-judge", type=Path, help="a ranking judge's checkpoint: adds the 'group-judge' arm")
    parser.add_argument("--out", type=Path, default=Path("runs/judged_demo"))
    known, rest = parser.parse_known_args()
    out = known.out
    sys.argv = [sys.argv[0], *rest, "--out", str(out)]  # bench/rl_arms.py's command line

    def bench(url: str, group_url: str | None = None) -> ArmsBench:
        return ArmsBench(
            preset="zorplex_judged_tiny",
            arms=arms(url, group_url),
            target={"success": 0.9},
            out=out,
            curves=Path(__file__).parent / "judged_demo_curves.png",
        )

    if {"-h", "--help"} & set(rest):  # the help, before any judge is built or served
        main({"zorplex_judged_tiny": bench("")}, __doc__ or "")
    judge = known.judge or build_judge(out / "judge")
    servers = []
    try:
        port = free_port()
        servers.append(serve(judge, port))
        group_url = None
        if known.group_judge is not None:
            group_port = free_port()
            servers.append(serve(known.group_judge, group_port))
            group_url = f"http://127.0.0.1:{group_port}/v1"
        served = bench(f"http://127.0.0.1:{port}/v1", group_url)
        args = main({served.preset: served}, __doc__ or "")
        hacking(args.out, served, args.seeds)
    finally:
        for server in servers:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    run()
