"""Shared benchmark helpers: the machine's measured matmul peak, repeat timing, a plain table.

Import from a bench script as `from _common import ...` (bench/ is not a package; scripts run as
`python bench/x.py`, which puts bench/ on sys.path).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


def toolgym_train(preset: str, overrides: Sequence[str], log: Path, core: int | None = None) -> float:
    """One `toolgym train <preset> --set ...` process, its output to `log`; with `core`, pinned to
    that core with one torch thread (`parallel.threads=1`, OMP_NUM_THREADS=1), so a figure taken
    beside another pinned run is a one-core figure. Returns its wall time; a failed run exits
    naming the log."""
    command = [sys.executable, "-m", "toolgym.configs.cli", "train", preset, "--no-progress"]
    env = dict(os.environ)
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
        overrides = [*overrides, "parallel.threads=1"]
        env["OMP_NUM_THREADS"] = "1"
    for item in overrides:
        command += ["--set", item]
    started = time.perf_counter()
    with log.open("w") as out:
        returncode = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {returncode}; its output: {log}")
    return time.perf_counter() - started


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_flops(
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    size: int | None = None,
    seconds: float = 1.0,
    repeats: int = 3,
) -> float:
    """Measured dense matmul throughput in FLOP/s (best of `repeats` windows of ~`seconds`).

    A square [size x size] @ [size x size] matmul in `dtype` (default size: 2048 on CPU, 8192 on
    GPU), the best a single large GEMM reaches on this machine with the current thread count:
    the denominator for "share of peak" figures.
    """
    device = torch.device(device)
    size = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    flops_per_call = 2 * size**3
    a @ b  # warm-up (kernel selection, allocator)
    _sync(device)
    start = time.perf_counter()
    a @ b
    _sync(device)
    calls = max(1, int(seconds / max(time.perf_counter() - start, 1e-6)))
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            a @ b
        _sync(device)
        best = max(best, calls * flops_per_call / (time.perf_counter() - start))
    return best


@dataclass
class Timings:
    """Wall times of repeated runs; `best` is the headline (a shared machine only adds delay)."""

    seconds: list[float]

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def time_repeats(fn: Callable[[], object], repeats: int, warmup: int = 1, device: str = "cpu") -> Timings:
    """Run `fn` warmup times untimed, then `repeats` times timed."""
    dev = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(dev)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(dev)
        seconds.append(time.perf_counter() - start)
    return Timings(seconds)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A left-aligned plain-text table (first column left, the rest right)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *(line(r) for r in cells[1:])])


def machine_summary() -> str:
    threads = torch.get_num_threads()
    if torch.cuda.is_available():
        return f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {threads} CPU threads"
    return f"torch {torch.__version__}, CPU, {threads} threads"


def commit() -> str:
    """This tree's commit, or "?" where there is no git (a copy of the tree)."""
    import subprocess

    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return "?"
    return found.stdout.strip() or "?"
