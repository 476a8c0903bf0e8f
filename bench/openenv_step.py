"""OpenEnv step round trip (WebSocket, local) against the same env stepped in-process.

    python bench/openenv_step.py [--steps 2000] [--repeats 3]

The env is the guess-the-number game of tests/envs/adapters/openenv_servers.py (an openenv-core
`Environment` with a two-part rubric). The peer is that environment object stepped directly in
this process (`env.step(GuessAction(...))`: the action built, the step, the rubric). The OpenEnv
figure is `toolgym/OpenEnv-v0`'s step, as the rollout runner calls it: the text sent as the
server's action over the env's WebSocket session (openenv-core's client on toolgym's OpenEnv
event loop thread) to the server started from its command on 127.0.0.1 (openenv-core's
`create_app` under uvicorn, a subprocess), the reply checked and rendered as text. Each step is
the message "abc" (not a number: never ends the episode). Microseconds per step are the best of
`repeats` runs (the in-process one runs 50x as many steps); the ratio is OpenEnv / in-process.
Also printed: the server's start (what the first env of a run pays; the envs open at once, and
those a run makes within `keep_alive_s` of each other, share it).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVERS = HERE.parent / "tests" / "envs" / "adapters" / "openenv_servers.py"
sys.path.insert(0, str(SERVERS.parent))

from openenv_servers import GuessAction, GuessEnvironment  # noqa: E402 (the server's own env)

from toolgym.envs.adapters.openenv import OpenEnvEnv  # noqa: E402


def per_step_us(step: Callable[[], object], steps: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="OpenEnv steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    total = args.steps * args.repeats + 10

    local = GuessEnvironment()
    local.reset(seed=0)
    action = GuessAction(message="abc")
    local_us = per_step_us(lambda: local.step(action), 50 * args.steps, args.repeats)

    started = time.perf_counter()
    env = OpenEnvEnv(
        command=[sys.executable, str(SERVERS), "guess", "{port}"], keep_alive_s=0, max_turns=total
    )
    env.reset(seed=0)
    start_s = time.perf_counter() - started
    observation, reward, *_ = env.step("abc")
    assert observation.startswith("feedback: That is not a number.") and reward == -0.1, observation
    remote_us = per_step_us(lambda: env.step("abc"), args.steps, args.repeats)
    env.close()

    print(f"{'path':<46} {'us/step':>10} {'steps/s':>10}")
    print(f"{'in-process Environment.step':<46} {local_us:>10.2f} {1e6 / local_us:>10,.0f}")
    print(f"{'toolgym/OpenEnv-v0 step (WebSocket, local)':<46} {remote_us:>10.1f} {1e6 / remote_us:>10,.0f}")
    print(f"OpenEnv / in-process: {remote_us / local_us:,.0f}x")
    print(f"server start + session + reset: {start_s:.2f} s")


if __name__ == "__main__":
    main()
