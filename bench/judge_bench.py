"""A judge model served by `toolgym serve`: its verdicts against the env's grader, and throughput.

    python bench/judge_bench.py --judge runs/judge_zorplex_tiny-<time>/final_model [--tasks 512]
    python bench/judge_bench.py --judge <a ranking judge> --mode group [--group-size 8]

The judge (configs/judge_zorplex_tiny.toml's recipe: the tiny model SFT'd on Zorplex episodes of a
fallible oracle, labelled by the env's `success`) is served by `toolgym serve` on 127.0.0.1 and
asked, as a run's `[judge]` asks it (episode mode, final_reply = false, the transcript's last
`--max-transcript-chars`), about `--tasks` episodes of held-out seeds (0..tasks-1; `toolgym record`
draws the training data from the training stream, 2^31 and up) from the same fallible oracle:

- verdicts: accuracy (score >= 0.5 against the grader's success), the pass rate, the hacking rate
  (the share of the episodes the judge passes that the grader fails), unparseable answers;
- throughput: episodes judged per second with 1 request in flight and with 64 (the peer is the
  same judge at 1 in flight: the ratio is what concurrency buys through the engine's batching);
- the cache on a replay: the same questions asked again of a judge with the same `cache_file`
  (a later process): its hit rate, and the seconds it took.

With `--mode group` (a ranking judge: judge.mode = "group", trained on `toolgym judge-data
--group-size`), the episodes are asked `--group-size` at a time, each group in the judge's random
order; throughput counts episodes (groups in flight: 1 and 64), and the verdicts are also given
per position shown: the judge's pass rate there against the grader's on the same episodes (the
position bias the random order leaves) and its accuracy there.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
from _common import commit, machine_summary  # bench/ is sys.path[0] when run as a script
from tokenizers import Tokenizer

from toolgym.agents.chat import ChatRenderer
from toolgym.rollouts.scoring.judge import Judge, JudgeConfig, JudgeCriterion, JudgeStats
from toolgym.rollouts.scoring.judge_data import labelled_episodes
from toolgym.rollouts.scripted import OracleConfig
from toolgym.rollouts.types import Trajectory

CRITERION = "The final answer is correct."
# the fallible oracle of the recipe's `toolgym record` (configs/judge_zorplex_tiny.toml)
ORACLE = OracleConfig(p_omit_tag=0.2, p_malformed_call=0.15, p_stop_early=0.15, p_skip_lookup=0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(judge: Path, port: int) -> subprocess.Popen:
    """`toolgym serve` of the judge; returns once its /v1/models answers (or the process ended)."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "toolgym.configs.cli.main",
            "serve",
            "--policy",
            str(judge),
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    while True:  # the condition it needs: the server answering, or the server gone
        if process.poll() is not None:
            raise SystemExit(
                f"toolgym serve exited {process.returncode}: {process.stderr.read() if process.stderr else ''}"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return process
        except OSError:
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--judge", type=Path, required=True, help="the judge's checkpoint (a final_model)")
    parser.add_argument("--tasks", type=int, default=512, help="held-out episodes to judge")
    parser.add_argument("--max-transcript-chars", type=int, default=200, help="as the recipe's judge-data")
    parser.add_argument("--mode", choices=["episode", "group"], default="episode", help="as judge.mode")
    parser.add_argument("--group-size", type=int, default=8, help="episodes per group with --mode group")
    args = parser.parse_args()
    renderer = ChatRenderer(Tokenizer.from_file(str(args.judge / "tokenizer.json")))
    episodes = labelled_episodes(
        "toolgym/Zorplex-v0", {"tier": "simple"}, range(args.tasks), renderer, ORACLE
    )
    print(f"{machine_summary()}; commit {commit()}; judge {args.judge}; {len(episodes)} held-out episodes")
    port = free_port()
    server = serve(args.judge, port)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        base = JudgeConfig(
            url=url,
            criteria=[JudgeCriterion(name="correct", prompt=CRITERION)],
            final_reply=False,
            max_transcript_chars=args.max_transcript_chars,
            max_tokens=16 if args.mode == "episode" else 8 * args.group_size,
            retries=0,
            mode=args.mode,
        )
        trajectories = [e.trajectory for e in episodes]
        rates = {}
        verdicts: list[float | None] = []
        positions: list[int | None] = []
        for in_flight in (1, 64):
            judge = Judge(_with(base, max_concurrent=in_flight))
            started = time.perf_counter()
            if args.mode == "group":
                verdicts, positions = ask_groups(judge, trajectories, args.group_size)
            else:
                verdicts = ask_all(judge, trajectories)
            rates[in_flight] = len(trajectories) / (time.perf_counter() - started)
        parsed = [(v, e.label) for v, e in zip(verdicts, episodes, strict=True) if v is not None]
        passed = [label for v, label in parsed if v >= 0.5]
        accuracy = sum((v >= 0.5) == bool(label) for v, label in parsed) / len(parsed)
        print(
            f"verdicts: accuracy {accuracy:.3f} against the grader ({len(parsed)} parsed of {len(episodes)}), "
            f"judge pass rate {len(passed) / len(parsed):.3f}, grader pass rate "
            f"{sum(label for _, label in parsed) / len(parsed):.3f}, hacking rate "
            f"{(len(passed) - sum(passed)) / max(1, len(passed)):.3f} (passed by the judge, failed by the grader)"
        )
        if args.mode == "group":
            by_position(verdicts, positions, [e.label for e in episodes], args.group_size)
        unit = "groups" if args.mode == "group" else "requests"
        print(
            f"throughput: {rates[1]:.1f} episodes/s at 1 {unit} in flight, {rates[64]:.1f} at 64: "
            f"{rates[64] / rates[1]:.2f}x"
        )
        with tempfile.TemporaryDirectory() as tmp:
            cache = str(Path(tmp) / "cache.jsonl")
            first, again = JudgeStats(), JudgeStats()
            ask = ask_all if args.mode == "episode" else lambda j, t, s: ask_groups(j, t, args.group_size, s)
            ask(Judge(_with(base, max_concurrent=64, cache_file=cache)), trajectories, first)
            started = time.perf_counter()
            ask(Judge(_with(base, max_concurrent=64, cache_file=cache)), trajectories, again)
            replay_s = time.perf_counter() - started
            asked = again.calls + again.cache_hits
            print(
                f"cache on a replay: {again.cache_hits}/{asked} hits ({again.cache_hits / max(1, asked):.3f}), "
                f"{again.calls} requests, {replay_s:.2f} s (the first pass: {first.calls} requests)"
            )
    finally:
        server.terminate()
        server.wait()


def _with(config: JudgeConfig, **changes: object) -> JudgeConfig:
    return msgspec.structs.replace(config, **changes)


def ask_all(
    judge: Judge, trajectories: list[Trajectory], stats: JudgeStats | None = None
) -> list[float | None]:
    """Each episode's score (None: not judged, or its answer did not parse), up to the judge's
    max_concurrent at once, each episode a group of its own (one unparseable answer loses only
    its own episode)."""
    stats = JudgeStats() if stats is None else stats

    def one(t: Trajectory) -> float | None:
        try:
            entry = judge.judge([t], stats).get(0, {}).get("correct")
        except ValueError:
            return None
        return None if entry is None else float(entry["score"])

    with ThreadPoolExecutor(max_workers=judge.config.max_concurrent) as pool:
        return list(pool.map(one, trajectories))


def ask_groups(
    judge: Judge, trajectories: list[Trajectory], size: int, stats: JudgeStats | None = None
) -> tuple[list[float | None], list[int | None]]:
    """Each episode's score and the position it was shown at (None, None: its group's answer did
    not parse), asked `size` episodes a group in the judge's order, up to max_concurrent groups
    at once."""
    stats = JudgeStats() if stats is None else stats
    groups = [trajectories[i : i + size] for i in range(0, len(trajectories), size)]

    def one(group: list[Trajectory]) -> list[tuple[float | None, int | None]]:
        try:
            results = judge.judge(group, stats)
        except ValueError:
            return [(None, None)] * len(group)
        entries = [results.get(i, {}).get("correct") for i in range(len(group))]
        return [(None, None) if e is None else (float(e["score"]), int(e["position"])) for e in entries]

    with ThreadPoolExecutor(max_workers=judge.config.max_concurrent) as pool:
        pairs = [pair for answer in pool.map(one, groups) for pair in answer]
    return [s for s, _ in pairs], [p for _, p in pairs]


def by_position(
    verdicts: list[float | None], positions: list[int | None], labels: list[int], size: int
) -> None:
    """Per position shown: the judge's pass rate against the grader's on the same episodes, and
    its accuracy there."""
    cells = []
    for position in range(size):
        here = [
            (v >= 0.5, label)
            for v, p, label in zip(verdicts, positions, labels, strict=True)
            if p == position
        ]
        if not here:
            continue
        judge_rate = sum(v for v, _ in here) / len(here)
        grader_rate = sum(label for _, label in here) / len(here)
        accuracy = sum(v == bool(label) for v, label in here) / len(here)
        cells.append((position, len(here), judge_rate - grader_rate, accuracy))
    print(
        "by position shown: "
        + "; ".join(f"{p + 1}: n {n}, pass-rate bias {b:+.3f}, acc {a:.3f}" for p, n, b, a in cells)
    )
    if cells:
        biases = [b for _, _, b, _ in cells]
        print(
            f"position bias: largest |judge - grader pass rate| {max(map(abs, biases)):.3f}, spread {max(biases) - min(biases):.3f}"
        )


if __name__ == "__main__":
    main()
