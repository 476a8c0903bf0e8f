"""MCP tool call round trip (stdio) against the same tool called in-process.

    python bench/mcp_tools.py [--calls 2000] [--repeats 3]

The tool is `convert(value: float, unit: Literal["km", "mi"], digits: int = 2)` of the test
server tests/envs/tools/mcp_units_server.py (the SDK's high-level MCPServer). The peer is that same
Python function as a typed in-process Tool (`Tool.from_function`: msgspec validation, a direct
call). The MCP figure is the Tool `MCPServer.tools()` makes (`Tool.from_schema`): the JSON Schema
check, then a `tools/call` round trip over the server's stdin/stdout through the SDK's client on
toolgym's MCP event loop thread, then the result's text. Both are called exactly as
`ToolEnv.step` calls a tool (`tool(arguments, strict=True)`); microseconds per call are the best
of `repeats` runs of `calls` calls (the in-process one runs 50x as many calls), and the ratio is
MCP / in-process. Also printed: the server's start plus its tools listing (what the first
env of a run pays; shared handles pay it once).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVER = HERE.parent / "tests" / "envs" / "tools" / "mcp_units_server.py"
sys.path.insert(0, str(SERVER.parent))

from mcp_units_server import convert  # noqa: E402 (the server's own tool function)

from toolgym.envs import MCPServer, Tool  # noqa: E402


def per_call_us(tool: Tool, arguments: dict, calls: int, repeats: int) -> float:
    expected = tool(arguments).content
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            tool(arguments)
        best = min(best, (time.perf_counter() - start) / calls)
    assert tool(arguments).content == expected
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="MCP calls per run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    arguments = {"value": 1421.0, "unit": "mi", "digits": 3}

    started = time.perf_counter()
    server = MCPServer([sys.executable, str(SERVER)])
    remote = {t.name: t for t in server.tools()}["convert"]
    start_s = time.perf_counter() - started
    local = Tool.from_function(convert)
    assert str(local(arguments).content) == remote(arguments).content, "the two tools disagree"

    local_us = per_call_us(local, arguments, 50 * args.calls, args.repeats)
    remote_us = per_call_us(remote, arguments, args.calls, args.repeats)
    server.close()

    print(f"tool: convert {arguments} -> {local(arguments).content!r}")
    print(f"{'path':<42} {'us/call':>10} {'calls/s':>10}")
    print(f"{'in-process Tool.from_function':<42} {local_us:>10.2f} {1e6 / local_us:>10,.0f}")
    print(f"{'MCP stdio round trip (MCPServer.tools())':<42} {remote_us:>10.1f} {1e6 / remote_us:>10,.0f}")
    print(f"MCP / in-process: {remote_us / local_us:,.0f}x")
    print(f"server start + tools listing: {start_s:.2f} s")


if __name__ == "__main__":
    main()
