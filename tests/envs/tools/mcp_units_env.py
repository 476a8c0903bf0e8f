"""A ToolEnv whose tools come from the MCP server in mcp_units_server.py (a subprocess over stdio),
registered as `mcptest/Units-v0`: convert a distance, answer with the result. `fault` names a
fault tool (crash, hang, malformed) that the oracle calls first in the episodes whose task seed
is in `fault_seeds`, so tests can see one episode lost while the others go on."""

import sys
from pathlib import Path

import gymnasium

from toolgym.envs import Call, MCPServer, Task, ToolEnv, numeric

SERVER_COMMAND = [sys.executable, str(Path(__file__).with_name("mcp_units_server.py"))]
KM_PER_MILE = 1.609344


class UnitsEnv(ToolEnv):
    """Convert a distance between kilometres and miles with the server's `convert` tool."""

    def __init__(self, fault=None, fault_seeds=(), timeout_s=30.0, shared=True, keep_alive_s=5.0, **knobs):
        self.server = MCPServer(SERVER_COMMAND, shared=shared, keep_alive_s=keep_alive_s, timeout_s=timeout_s)
        knobs.setdefault("grader", numeric(abs_tol=0.005))
        super().__init__(tools=self.server.tools(), instructions="Convert distances with the tools.", **knobs)
        self.fault, self.fault_seeds, self._seed = fault, set(fault_seeds), None

    def reset(self, *, seed=None, options=None):
        self._seed = seed
        return super().reset(seed=seed, options=options)

    def new_task(self) -> Task:
        value = round(float(self.np_random.uniform(1, 500)), 1)
        unit, other = ("km", "mi") if self.np_random.random() < 0.5 else ("mi", "km")
        digits = int(self.np_random.integers(1, 4))
        answer = round(value * KM_PER_MILE if unit == "mi" else value / KM_PER_MILE, digits)
        steps = [Call("convert", {"value": value, "unit": unit, "digits": digits})]
        if self.fault is not None and self._seed in self.fault_seeds:
            steps.insert(0, Call(self.fault, {}))
        question = f"How much is {value} {unit} in {other}, to {digits} decimals?"
        return Task(question, answer, solution=steps, needed_tool_calls=1)

    def close(self):
        self.server.close()
        super().close()


if "mcptest/Units-v0" not in gymnasium.registry:
    gymnasium.register("mcptest/Units-v0", entry_point=UnitsEnv)
