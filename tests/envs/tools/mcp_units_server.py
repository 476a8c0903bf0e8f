"""An MCP server for tests/envs/tools/test_envs_mcp.py and bench/mcp_tools.py, written with the SDK's
high-level server and run as a subprocess over stdio (`python mcp_units_server.py`), or over
streamable HTTP (`python mcp_units_server.py --http PORT`).

Tools: `convert` (typed, three arguments, one with a default), `refuse` (an isError result),
`whoami` (structured content: the server's pid, so a test can see a restart), and the faults:
`crash` (the process exits mid-call after a line on stderr), `hang` (never answers in time),
`malformed` (answers its own request with a result that is no CallToolResult).
"""

import json
import os
import sys
import time
from typing import Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

KM_PER_MILE = 1.609344

server = MCPServer("units")
_WIRE = os.fstat(1)  # the SDK moves the JSON-RPC stream off fd 1 once it runs; `malformed` finds it


def convert_distance(value: float, unit: str, digits: int = 2) -> float:
    return round(value * KM_PER_MILE if unit == "mi" else value / KM_PER_MILE, digits)


@server.tool()
def convert(value: float, unit: Literal["km", "mi"], digits: int = 2) -> float:
    """Convert a distance between kilometres and miles.

    Args:
        value: the distance to convert.
        unit: the unit `value` is in.
        digits: decimals to round the result to.
    """
    return convert_distance(value, unit, digits)


@server.tool()
def refuse(reason: str) -> str:
    """Refuse, saying why."""
    raise ToolError(f"refused: {reason}")


@server.tool()
def whoami() -> dict[str, int]:
    """The server's process id."""
    return {"pid": os.getpid()}


@server.tool()
def crash() -> str:
    """Exit the server process in the middle of the call."""
    print("units server: crashing on purpose", file=sys.stderr, flush=True)
    os._exit(3)


@server.tool()
def hang(seconds: float = 3600.0) -> str:
    """Sleep, far longer than any caller waits."""
    print(f"units server: hanging for {seconds} s", file=sys.stderr, flush=True)
    time.sleep(seconds)
    return "woke up"


@server.tool()
async def malformed(ctx: Context) -> str:
    """Answer this request with a result whose content is not a list."""

    def is_wire(fd: int) -> bool:
        try:
            found = os.fstat(fd)
        except OSError:
            return False
        return (found.st_dev, found.st_ino) == (_WIRE.st_dev, _WIRE.st_ino)

    wire = next(fd for fd in range(3, 1024) if is_wire(fd))
    print("units server: sending a malformed result", file=sys.stderr, flush=True)
    reply = {"jsonrpc": "2.0", "id": int(ctx.request_id), "result": {"content": "not a list"}}
    os.write(wire, (json.dumps(reply) + "\n").encode())
    return "the real result, which comes too late"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":  # streamable HTTP on 127.0.0.1:PORT/mcp
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
