"""Env throughput: steps/s per tier with oracle actions, unwrapped vs through `gymnasium.make`,
and the cost of JSON tool calls against bracket calls.

    python bench/envs.py [--episodes 20000] [--repeats 3] [--cpu 0] [--json out.json] [--only tool-calls]

Each measurement runs `episodes` oracle episodes (reset, oracle_actions(), every step) in this
one thread and counts steps per second of that whole loop, so reset costs are included. The best
of `repeats` runs is reported (timings on a shared machine only get slower, never faster).
`--cpu N` pins this process (only) to core N. The "peer" is the same env through
`gymnasium.make` with its default wrappers (PassiveEnvChecker, OrderEnforcing); the ratio is
unwrapped / make. Target: >= 50,000 Zorplex steps/s unwrapped.

Tool-call formats: two two-tool envs, each once with JSON calls (`<tool_call>{...}</tool_call>`,
tool_format="json") and once with bracket calls (`NAME[a, b]`, the peer; the ratio is
json / brackets): `convert` (below: typed tools, one with three arguments, a float answer) and
Zorplex multi_step (GETKEY/FETCH, one str argument each). Figures: oracle steps/s (as above;
target >= 20,000 JSON steps/s for `convert`), microseconds per call for parse + validate +
dispatch (ToolEnv.step's path for one call: the format's parse, the tool's argument validation
and the call, the result's text), and microseconds per `step` of an action holding that call
(no reset in the loop).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Literal

import gymnasium

import toolgym.envs  # noqa: F401 (registers toolgym/*)
from toolgym.envs import Call, Task, ToolEnv, ZorplexEnv, numeric, tool
from toolgym.envs.tools.typed import result_text

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
TARGET_JSON_STEPS_PER_S = 20_000
FORMATS = ("brackets", "json")
CITIES = ("oslo", "rome", "lima", "pune", "baku", "kyiv", "quito", "perth")
KM_PER_MILE = 1.609344


class ConvertEnv(ToolEnv):
    """A two-tool env as users write them: typed tools (one with three arguments), a float answer
    graded with a tolerance. Oracle: distance(origin, destination, unit), convert(value, source,
    target), then the answer."""

    def __init__(self, **knobs: Any):
        knobs.setdefault("grader", numeric(rel_tol=1e-6))
        super().__init__(instructions="Answer distances in miles.", **knobs)

    @tool
    def distance(self, origin: str, destination: str, unit: Literal["km", "mi"] = "km") -> float:
        """The road distance between two cities."""
        km = self.state[(origin, destination)]
        return km if unit == "km" else km / KM_PER_MILE

    @tool
    def convert(self, value: float, source: Literal["km", "mi"], target: Literal["km", "mi"]) -> float:
        """Convert a distance from one unit to another."""
        if source == target:
            return value
        return value / KM_PER_MILE if target == "mi" else value * KM_PER_MILE

    def new_task(self) -> Task:
        rng = self.np_random
        a, b = (CITIES[i] for i in rng.choice(len(CITIES), 2, replace=False).tolist())
        km = float(rng.integers(100, 5000))
        solution = [
            Call("distance", {"origin": a, "destination": b, "unit": "km"}),
            Call("convert", {"value": km, "source": "km", "target": "mi"}),
        ]
        return Task(f"How many miles is it from {a} to {b}?", km / KM_PER_MILE, solution, state={(a, b): km})


TWO_TOOL_ENVS: list[tuple[str, Any]] = [
    ("convert (typed, 3-arg tool)", ConvertEnv),
    ("zorplex multi_step", lambda **kw: ZorplexEnv(tier="multi_step", **kw)),
]


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


def call_microseconds(env: ToolEnv, action: str, calls: int) -> float:
    """Microseconds per call of ToolEnv.step's path for the one call in `action`: the format's
    parse, the tool's argument validation and dispatch, the result's text."""
    fmt, tools = env.format, env.tools
    near_miss = fmt.near_miss(tools)
    start = time.perf_counter()
    for _ in range(calls):
        parsed = fmt.parse(action, near_miss).calls
        assert parsed is not None and len(parsed) == 1, action
        call = parsed[0]
        one = tools[call.name.upper()]
        arguments, strict = fmt.arguments(one, call)
        fmt.result(one.name, call, result_text(one(arguments, strict=strict).content))
    return (time.perf_counter() - start) / calls * 1e6


def step_microseconds(env: ToolEnv, action: str, steps: int) -> float:
    """Microseconds per `env.step(action)` in one long episode (no reset in the loop)."""
    env.reset(seed=0)
    start = time.perf_counter()
    for _ in range(steps):
        env.step(action)
    return (time.perf_counter() - start) / steps * 1e6


def tool_call_rows(episodes: int, repeats: int) -> list[dict]:
    """Per two-tool env and format: oracle steps/s, and per-call / per-step microseconds for the
    oracle's last call (convert: a float and two Literals; Zorplex: FETCH). Each figure is the
    best of `repeats`."""
    rows = []
    for name, make in TWO_TOOL_ENVS:
        row: dict[str, Any] = {"env": name}
        for fmt in FORMATS:
            row[f"{fmt} steps/s"] = best_of(make(tool_format=fmt), episodes, repeats)
            env = make(tool_format=fmt, max_turns=10**9, max_tool_calls=10**9, max_consecutive_errors=None)
            env.reset(seed=0)
            action = env.oracle_actions()[-2]
            calls = max(1000, episodes)
            call_microseconds(env, action, min(calls, 200))  # warm-up
            row[f"{fmt} call us"] = min(call_microseconds(env, action, calls) for _ in range(repeats))
            row[f"{fmt} step us"] = min(step_microseconds(env, action, calls) for _ in range(repeats))
            row[f"{fmt} action"] = action
        rows.append(row)
    return rows


def print_tool_call_rows(rows: list[dict]) -> None:
    print(
        f"{'two-tool env':<30} {'brackets steps/s':>17} {'json steps/s':>13} {'json/brackets':>14}"
        f" {'call us b/j':>12} {'step us b/j':>12}"
    )
    for row in rows:
        ratio = row["json steps/s"] / row["brackets steps/s"]
        calls = f"{row['brackets call us']:.1f}/{row['json call us']:.1f}"
        steps = f"{row['brackets step us']:.1f}/{row['json step us']:.1f}"
        print(
            f"{row['env']:<30} {row['brackets steps/s']:>17,.0f} {row['json steps/s']:>13,.0f}"
            f" {ratio:>14.2f} {calls:>12} {steps:>12}"
        )
    for row in rows:
        print(f"  {row['env']}: call measured: {row['json action']!r} / {row['brackets action']!r}")
    typed = rows[0]["json steps/s"]
    verdict = "meets" if typed >= TARGET_JSON_STEPS_PER_S else "MISSES"
    print(
        f"{rows[0]['env']} with JSON calls: {typed:,.0f} steps/s "
        f"({verdict} the {TARGET_JSON_STEPS_PER_S:,} target); JSON call parse + validate + dispatch "
        f"{rows[0]['json call us']:.1f} us ({rows[0]['json call us'] / rows[0]['brackets call us']:.2f}x brackets)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu", type=int, default=None, help="pin this process to one core")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument(
        "--only", choices=("envs", "tool-calls"), default=None, help="run one of the two measurements"
    )
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})

    rows: list[dict] = []
    tool_rows: list[dict] = []
    if args.only != "envs":
        tool_rows = tool_call_rows(args.episodes, args.repeats)
        print_tool_call_rows(tool_rows)
        if args.only == "tool-calls":
            return write_json(args, rows, tool_rows)
        print()
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
    write_json(args, rows, tool_rows)


def write_json(args: argparse.Namespace, rows: list[dict], tool_rows: list[dict]) -> None:
    if args.json:
        figures = {"episodes": args.episodes, "repeats": args.repeats, "rows": rows, "tool_calls": tool_rows}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
