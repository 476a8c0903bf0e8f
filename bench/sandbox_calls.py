"""The code sandbox's warm pool against a cold interpreter start per call.

    python bench/sandbox_calls.py [--calls 200] [--concurrency 1 64] [--pool-size 1]

A trivial call (`print(6 * 7)`) through each path, `--calls` calls at each concurrency (threads
keeping that many calls in flight):
- warm: `Sandbox.run` (envs/tools/sandbox.py): a fork of a warm zygote inside bubblewrap, rlimits
  set, the output read back and decoded;
- cold bwrap: `subprocess.run` of the same bubblewrap command line with a fresh interpreter
  (`python -I -c code`): the peer with the same isolation;
- cold plain: `subprocess.run([sys.executable, "-c", code])`: no isolation at all.
Printed per path and concurrency: calls/s, p50 and p99 latency; then warm / cold calls/s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from toolgym.envs import Sandbox, SandboxConfig
from toolgym.envs.tools.sandbox import _interpreter, bwrap_argv

CODE = "print(6 * 7)"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per path and concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--pool-size", type=int, default=1, help="the warm pool's zygotes")
    args = parser.parse_args()
    config = SandboxConfig(pool_size=args.pool_size)
    started = time.perf_counter()
    sandbox = Sandbox(config)
    print(f"warm pool start ({args.pool_size} zygote(s)): {time.perf_counter() - started:.3f} s")
    cold_bwrap = [*bwrap_argv(config), _interpreter(config), "-I", "-c", CODE]
    paths: dict[str, Callable[[], str]] = {
        "warm (Sandbox.run)": lambda: sandbox.run(CODE).stdout,
        "cold bwrap (python -I -c)": lambda: subprocess.run(cold_bwrap, capture_output=True, text=True).stdout,
        "cold plain (sys.executable -c)": lambda: subprocess.run(
            [sys.executable, "-c", CODE], capture_output=True, text=True
        ).stdout,
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
