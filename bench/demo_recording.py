"""SFT demonstrations recorded in several processes (`sft.processes`) against one: the oracle's
episodes of a preset, the same task seeds both ways, timed from the call to the last trajectory
(so the spawned processes' start-up counts); the ratio is one process's time / several's.

    python bench/demo_recording.py                                  # textworld_tiny, 1,000 demos
    python bench/demo_recording.py --preset zorplex_tiny --tasks 4096 --processes 2

It also checks that both ways give the same demonstrations (timings aside).
"""

from __future__ import annotations

import argparse
import time

import msgspec
from _common import commit, machine_summary  # bench/ is sys.path[0] when run as a script

from toolgym.configs.assembly.demos import demo_trajectories
from toolgym.configs.assembly.parts import build_renderer
from toolgym.configs.checks import check_environment
from toolgym.configs.load import load_config
from toolgym.rollouts.types import Trajectory


def _untimed(trajectory: Trajectory) -> bytes:
    metrics = {k: v for k, v in trajectory.metrics.items() if not k.endswith("_s")}
    return msgspec.json.encode(msgspec.structs.replace(trajectory, metrics=metrics))


def record(preset: str, tasks: int, processes: int) -> tuple[list[Trajectory], float]:
    """The preset's oracle demonstrations of `tasks` task seeds in `processes` processes, and the
    seconds they took."""
    config, _ = load_config(preset, [f"sft.num_tasks={tasks}", f"sft.processes={processes}"])
    check_environment(config)  # the preset's games compiled (cached) before the clock starts
    renderer, _ = build_renderer(config)
    start = time.perf_counter()
    trajectories, _ = demo_trajectories(config, renderer)
    return trajectories, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--preset", default="textworld_tiny")
    parser.add_argument("--tasks", type=int, default=1000, help="demonstrations (task seeds)")
    parser.add_argument("--processes", type=int, default=0, help="the several (0: one per usable core)")
    args = parser.parse_args()
    print(machine_summary())
    print(f"{args.preset}: commit {commit()}, {args.tasks} demonstrations", flush=True)
    alone, one_s = record(args.preset, args.tasks, 1)
    print(f"1 process: {one_s:.1f} s ({len(alone) / one_s:.1f} demonstrations/s)", flush=True)
    shared, several_s = record(args.preset, args.tasks, args.processes)
    print(
        f"sft.processes={args.processes}: {several_s:.1f} s ({len(shared) / several_s:.1f} demonstrations/s)"
    )
    same = [_untimed(t) for t in shared] == [_untimed(t) for t in alone]
    print(f"ratio (1 process / several): {one_s / several_s:.2f}x; the same demonstrations: {same}")
    if not same:
        raise SystemExit("the demonstrations differ")


if __name__ == "__main__":
    main()
