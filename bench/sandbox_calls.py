"""The code sandbox's warm pool against a cold interpreter start per call.

    python bench/sandbox_calls.py [--calls 200] [--concurrency 1 64] [--pool-size 1]
    python bench/sandbox_calls.py --fork-bombs 2 8 [--calls 64] [--timeout 5] [--rounds 1]

A trivial call (`print(6 * 7)`) through each path, `--calls` calls at each concurrency (threads
keeping that many calls in flight):
- warm: `Sandbox.run` (envs/tools/sandbox.py): a fork of a warm zygote inside bubblewrap, rlimits
  set, the output read back and decoded;
- cold bwrap: `subprocess.run` of the same bubblewrap command line with a fresh interpreter
  (`python -I -c code`): the peer with the same isolation;
- cold plain: `subprocess.run([sys.executable, "-c", code])`: no isolation at all.
Printed per path and concurrency: calls/s, p50 and p99 latency; then warm / cold calls/s.

--fork-bombs N... [--no-cgroups]: instead, for each N, `--calls` calls at once through one warm pool
(`timeout_s=--timeout`, as PyCalc-v0 runs them), N of them fork bombs that keep forking past
every failure and the rest `print(6 * 7)`; printed: how many harmless calls answered 42, their
p50 and slowest latency, the bombs' outcomes, and the sandbox's own wall time per round.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable

import toolgym.envs.tools.sandbox as sandbox_module
from toolgym.envs import Sandbox, SandboxConfig
from toolgym.envs.tools.sandbox import SandboxResult, _interpreter, bwrap_argv

CODE = "print(6 * 7)"
FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"


def measure(call: Callable[[], str], calls: int, concurrency: int) -> tuple[float, float, float]:
    """(calls/s, p50 ms, p99 ms) of `calls` calls with `concurrency` in flight."""

    def timed(_: int) -> float:
        start = time.perf_counter()
        out = call()
        assert out.strip() == "42", out
        return time.perf_counter() - start

    for _ in range(min(4, calls)):
        timed(0)  # warm-up
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        latencies = sorted(pool.map(timed, range(calls)))
    wall = time.perf_counter() - start
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return calls / wall, statistics.median(latencies) * 1e3, p99 * 1e3


def fork_bombs(bombs: int, calls: int, timeout_s: float, pool_size: int) -> tuple[int, int, float, float]:
    """One round: `calls` calls at once (a thread each, `Sandbox.run` as the python tool calls
    it), `bombs` of them fork bombs spread among the others. (harmless calls that answered 42,
    harmless calls, their p50 and slowest latency in s); the outcomes printed."""
    with Sandbox(SandboxConfig(timeout_s=timeout_s, pool_size=pool_size)) as sandbox:
        sandbox.run(CODE)  # warm
        step = max(1, calls // max(1, bombs))
        codes = [FORK_BOMB if i % step == 0 and i // step < bombs else CODE for i in range(calls)]

        def timed(code: str) -> tuple[SandboxResult, float]:
            start = time.perf_counter()
            result = sandbox.run(code)
            return result, time.perf_counter() - start

        with concurrent.futures.ThreadPoolExecutor(calls) as pool:
            outcomes = list(pool.map(timed, codes))
    harmless = [outcome for code, outcome in zip(codes, outcomes, strict=True) if code == CODE]
    good = sum(result.kind is None and result.stdout == "42\n" for result, _ in harmless)
    failed = Counter(
        f"{r.kind}: {r.message}" for r, _ in harmless if not (r.kind is None and r.stdout == "42\n")
    )
    bombed = Counter(str(r.kind) for code, (r, _) in zip(codes, outcomes, strict=True) if code == FORK_BOMB)
    print(f"  fork bombs ended as {dict(bombed)}; harmless calls failed: {dict(failed) or 'none'}")
    latencies = sorted(latency for _, latency in harmless)
    return good, len(harmless), statistics.median(latencies), latencies[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per path and concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--pool-size", type=int, default=1, help="the warm pool's zygotes")
    parser.add_argument("--fork-bombs", type=int, nargs="+", help="fork bombs among --calls calls at once")
    parser.add_argument("--timeout", type=float, default=5.0, help="timeout_s (with --fork-bombs)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per --fork-bombs count")
    parser.add_argument(
        "--no-cgroups", action="store_true", help="as where cgroups cannot be written (the fallback)"
    )
    args = parser.parse_args()
    if args.no_cgroups:
        sandbox_module._make_cgroups = dict  # what it returns where cgroups cannot be made
    if args.fork_bombs:
        calls = args.calls if "--calls" in sys.argv else 64
        how = "no cgroups" if args.no_cgroups else "cgroups where writable"
        print(f"{calls} calls at once, timeout_s={args.timeout:g}, pool_size={args.pool_size}, {how}")
        for bombs in args.fork_bombs:
            for _ in range(args.rounds):
                good, harmless, p50, slowest = fork_bombs(bombs, calls, args.timeout, args.pool_size)
                print(
                    f"{bombs} fork bomb(s): {good}/{harmless} harmless calls answered correctly, "
                    f"p50 {p50:.3f} s, slowest {slowest:.3f} s"
                )
        return
    config = SandboxConfig(pool_size=args.pool_size)
    started = time.perf_counter()
    sandbox = Sandbox(config)
    print(f"warm pool start ({args.pool_size} zygote(s)): {time.perf_counter() - started:.3f} s")
    cold_bwrap = [*bwrap_argv(config), _interpreter(config), "-I", "-c", CODE]
    paths: dict[str, Callable[[], str]] = {
        "warm (Sandbox.run)": lambda: sandbox.run(CODE).stdout,
        "cold bwrap (python -I -c)": lambda: (
            subprocess.run(cold_bwrap, capture_output=True, text=True).stdout
        ),
        "cold plain (sys.executable -c)": lambda: (
            subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True).stdout
        ),
    }
    rates: dict[tuple[str, int], float] = {}
    print(f"{'path':32} {'in flight':>9} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for concurrency in args.concurrency:
        for name, call in paths.items():
            rate, p50, p99 = measure(call, args.calls, concurrency)
            rates[name, concurrency] = rate
            print(f"{name:32} {concurrency:9d} {rate:9.1f} {p50:8.2f} {p99:8.2f}")
    sandbox.close()
    warm = "warm (Sandbox.run)"
    for concurrency in args.concurrency:
        for peer in ("cold bwrap (python -I -c)", "cold plain (sys.executable -c)"):
            ratio = rates[warm, concurrency] / rates[peer, concurrency]
            print(f"warm / {peer.split(' (')[0]}, {concurrency} in flight: {ratio:.1f}x calls/s")


if __name__ == "__main__":
    main()
