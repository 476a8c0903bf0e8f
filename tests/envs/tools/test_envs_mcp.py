"""Tools from an MCP server (envs/tools/mcp.py) against a real server: mcp_units_server.py, written with
the SDK's high-level server and started as a subprocess over stdio. Listing, both call formats,
the oracle through the real rollout runner, a crash / hang / malformed result ending only its
own episode (as env_error, with the server's stderr) while the next one works, no process left
after close(). Also Tool.from_schema's argument check, which needs no server."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import gymnasium
import pytest

pytest.importorskip("mcp")

from mcp_units_env import SERVER_COMMAND, UnitsEnv  # tests/envs; registers mcptest/Units-v0
from tokenizers import Tokenizer

from toolgym.agents.chat import ChatRenderer
from toolgym.envs import Call, MCPServer, MCPServerError, Task, Tool, ToolEnv
from toolgym.envs.tools.typed import ToolCallError, check_arguments
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.metrics import batch_metrics
from toolgym.rollouts.scripted import OraclePolicy
from toolgym.rollouts.types import StopReason

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def server_children() -> list[int]:
    """Live child processes of this process that run the test server."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"mcp_units_server.py" in cmdline and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def pid_of(server: MCPServer) -> int:
    return json.loads(server.call("whoami"))["pid"]


@pytest.fixture(scope="module")
def server():
    with MCPServer(SERVER_COMMAND, timeout_s=2.0) as handle:
        yield handle


@pytest.fixture(scope="module")
def renderer():
    return ChatRenderer(Tokenizer.from_file(str(ROOT / "configs" / "assets" / "tokenizer.json")))


def step_body(env, action):
    observation, *_, info = env.step(action)
    return observation.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>"), info


# ---- listing and calling -------------------------------------------------------------------


def test_tools_are_listed_with_their_schemas(server):
    tools = {t.name: t for t in server.tools()}
    assert list(tools) == ["convert", "refuse", "whoami", "crash", "hang", "malformed"]
    convert = tools["convert"]
    assert convert.description == "Convert a distance between kilometres and miles."
    assert convert.param_names == ("value", "unit", "digits")
    assert convert.parameters["required"] == ["value", "unit"]
    assert convert.parameters["properties"]["unit"]["enum"] == ["km", "mi"]
    assert convert.spec["function"]["parameters"] is convert.parameters
    assert [t.name for t in server.tools(include=["whoami", "convert"])] == ["convert", "whoami"]
    with pytest.raises(ValueError, match="no tool named"):
        server.tools(include=["nope"])


def test_calls_results_and_errors(server):
    tools = {t.name: t for t in server.tools()}
    assert tools["convert"]({"value": 10, "unit": "mi"}).content == "16.09"
    assert tools["convert"]({"value": "10", "unit": "mi", "digits": "3"}, strict=False).content == "16.093"
    assert json.loads(tools["whoami"]({}).content)["pid"] == pid_of(server)
    with pytest.raises(ToolCallError) as refused:  # isError: a tool_error observation
        tools["refuse"]({"reason": "closed today"})
    assert refused.value.kind == "tool_error" and "refused: closed today" in str(refused.value)
    for arguments, message in [
        ({"unit": "mi"}, "missing argument `value`"),
        ({"value": "10", "unit": "mi"}, "argument `value`: expected `number`, got `string`"),
        ({"value": 1, "unit": "yd"}, "argument `unit`: expected one of 'km', 'mi', got 'yd'"),
    ]:
        with pytest.raises(ToolCallError, match=message) as bad:  # checked here, never sent
            tools["convert"](arguments)
        assert bad.value.kind == "bad_arguments"


@pytest.mark.parametrize("tool_format", ["brackets", "json"])
def test_a_tool_env_plays_them_in_both_formats(tool_format):
    env = UnitsEnv(tool_format=tool_format)
    try:
        _, info = env.reset(seed=4)
        assert any(spec["function"]["name"] == "convert" for spec in env.tool_specs)
        assert ("tools" in info) == (tool_format == "json")  # a template's tools block teaches JSON calls
        if tool_format == "json":
            assert '"name": "convert"' in info["system_prompt"]
            refuse = '<tool_call>\n{"name": "refuse", "arguments": {"reason": "no"}}\n</tool_call>'
            wrong = '<tool_call>\n{"name": "convert", "arguments": {"value": 1}}\n</tool_call>'
        else:
            assert "CONVERT[value, unit, digits]: Convert a distance" in info["system_prompt"]
            refuse, wrong = "REFUSE[no]", "CONVERT[1]"
        body, info = step_body(env, refuse)
        assert "refused: no" in body and info["step_errors"] == ["tool_error"]
        body, info = step_body(env, wrong)
        assert body.endswith("ERROR: missing argument `unit`") and info["step_errors"] == ["bad_arguments"]
        *calls, answer = env.oracle_actions()
        body, info = step_body(env, calls[0])
        assert float(body.rsplit("= ", 1)[-1]) == env.answer
        observation, _, terminated, _, info = env.step(answer)
        assert (observation, terminated, info["failure_mode"]) == ("CORRECT", True, "success")
    finally:
        env.close()


# ---- through the rollout runner ------------------------------------------------------------


def run(renderer, seeds, **env_kwargs):
    config = EnvRolloutConfig(env_id="mcptest/Units-v0", env_kwargs=env_kwargs, group_size=1, max_turns=4)
    return RolloutRunner(OraclePolicy(renderer), renderer, config).run(seeds)


def test_the_oracle_through_the_rollout_runner(renderer):
    trajectories = run(renderer, [0, 1, 2, 3], tool_format="json")
    for t in trajectories:
        assert t.stop_reason == StopReason.ANSWERED and t.error is None, t.error
        assert t.transitions[-1].info["failure_mode"] == "success"
        env = gymnasium.make("mcptest/Units-v0")
        env.reset(seed=t.task_seed)
        assert t.transitions[0].info["tool_results"] == [str(env.unwrapped.answer)]
        env.close()
    assert batch_metrics(trajectories)["rollout/accuracy"] == 1.0


@pytest.mark.parametrize(
    ("fault", "stderr"),
    [
        ("crash", "units server: crashing on purpose"),
        ("hang", "units server: hanging for 3600.0 s"),
        ("malformed", "units server: sending a malformed result"),
    ],
)
def test_a_failing_server_loses_only_its_own_episode(renderer, fault, stderr):
    trajectories = run(renderer, [0, 1, 2], tool_format="json", fault=fault, fault_seeds=[1], timeout_s=1.0)
    by_seed = {t.task_seed: t for t in trajectories}
    failed = by_seed[1]
    assert failed.stop_reason == StopReason.ENV_ERROR
    assert failed.error.startswith("MCPServerError: MCP server `") and stderr in failed.error
    for seed in (0, 2):  # the one before and the one after (a restarted server, for crash and hang)
        assert by_seed[seed].stop_reason == StopReason.ANSWERED and by_seed[seed].error is None
    assert batch_metrics(trajectories)["rollout/errors/env_error:MCPServerError"] == 1.0


def test_a_crashed_server_is_restarted(server):
    before = pid_of(server)
    with pytest.raises(MCPServerError, match="exited during a call of crash") as crashed:
        server.call("crash")
    assert "units server: crashing on purpose" in str(crashed.value)
    after = pid_of(server)
    assert after != before and not alive(before)


# ---- lifetime -------------------------------------------------------------------------------


def test_env_close_stops_its_private_server():
    env = UnitsEnv(shared=False)
    pid = pid_of(env.server)
    assert alive(pid) and pid in server_children()
    env.close()
    assert not alive(pid) and pid not in server_children()
    with pytest.raises(MCPServerError, match="used after close"):
        env.tools["CONVERT"]({"value": 1, "unit": "km"})
    env.close()  # idempotent


def test_a_shared_server_lives_until_its_last_handle_closes():
    first, second = UnitsEnv(keep_alive_s=0), UnitsEnv(keep_alive_s=0)
    pid = pid_of(first.server)
    assert pid_of(second.server) == pid
    first.close()
    assert alive(pid) and second.tools["CONVERT"]({"value": 1, "unit": "km"}).content == "0.62"
    second.close()
    assert not alive(pid)


def test_a_server_that_cannot_start_is_an_mcp_server_error():
    with pytest.raises(MCPServerError, match="cannot start") as failed:
        MCPServer([sys.executable, "-c", "import sys; print('no such server', file=sys.stderr)"]).tools()
    assert "no such server" in str(failed.value)
    with pytest.raises(ValueError, match="exactly one"):
        MCPServer()


def test_no_server_outlives_the_interpreter(tmp_path):
    script = (
        f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
        "from mcp_units_env import SERVER_COMMAND\n"
        "from toolgym.envs import MCPServer\n"
        "server = MCPServer(SERVER_COMMAND)\n"
        "print(server.call('whoami'), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not alive(json.loads(done.stdout)["pid"])


@pytest.mark.slow
def test_a_streamable_http_server():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [*SERVER_COMMAND, "--http", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, "the HTTP server did not start"
                time.sleep(0.05)
        with MCPServer(url=f"http://127.0.0.1:{port}/mcp", timeout_s=0.5) as server:
            tools = {t.name: t for t in server.tools()}
            assert tools["convert"]({"value": 10, "unit": "mi"}).content == "16.09"
            with pytest.raises(MCPServerError, match=r"hang did not answer within 0\.5 s"):
                tools["hang"]({"seconds": 1.0})
            assert tools["convert"]({"value": 10, "unit": "km"}).content == "6.21"  # a new session
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.slow
def test_record_and_replay_through_the_cli(tmp_path):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "toolgym.configs.cli", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])},
        )

    out = tmp_path / "units.jsonl"
    record = cli(
        "record", "--env", "mcptest/Units-v0", "--env-module", "mcp_units_env", "--policy", "oracle",
        "--tasks", "3", "--group-size", "2", "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert record.returncode == 0, record.stdout + record.stderr
    assert "recorded 6 episodes" in record.stdout, record.stdout
    replay = cli("replay", str(out), "--verify", "--summary-only", "--env-module", "mcp_units_env")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "verify: 6/6 episodes replay exactly" in replay.stdout, replay.stdout


# ---- Tool.from_schema, no server ------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "title": "ignored",
    "properties": {
        "n": {"type": "integer"},
        "x": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "flag": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "point": {
            "type": "object",
            "properties": {"a": {"type": "number"}},
            "required": ["a"],
            "additionalProperties": False,
        },
        "mode": {"const": "fast"},
        "file-name": {"type": ["string", "null"]},
    },
    "required": ["n"],
    "additionalProperties": False,
}


def test_from_schema_checks_a_sound_subset_of_json_schema():
    echo = Tool.from_schema("echo", "Echo the arguments.", SCHEMA, lambda **kw: kw)
    assert "title" not in echo.parameters and echo.param_names[-1] == "file-name"
    given = {"n": 2.0, "x": None, "tags": ["a"], "point": {"a": 1}, "mode": "fast", "file-name": "f"}
    assert echo(given).content == {**given, "n": 2}  # an integral float is an integer
    lax = echo({"n": "3", "x": "1.5", "flag": "True"}, strict=False).content
    assert lax == {"n": 3, "x": 1.5, "flag": True}
    for arguments, message in [
        ({}, "missing argument `n`"),
        ({"n": 1, "zz": 0}, "unexpected argument `zz`"),
        ({"n": 1.5}, "argument `n`: expected `integer`, got `number`"),
        ({"n": True}, "argument `n`: expected `integer`, got `boolean`"),
        ({"n": 1, "x": "1"}, "argument `x`: matches none of its allowed forms"),
        ({"n": 1, "tags": ["a", 2]}, r"argument `tags\[1\]`: expected `string`, got `integer`"),
        ({"n": 1, "point": {}}, "argument `point`: missing field `a`"),
        ({"n": 1, "point": {"a": 1, "b": 2}}, "argument `point`: unexpected field `b`"),
        ({"n": 1, "mode": "slow"}, "argument `mode`: expected 'fast'"),
        ([1], "arguments must be a JSON object, got list"),
    ]:
        with pytest.raises(ToolCallError, match=message):
            echo(arguments)
    # Unknown keys pass where the schema allows them; keywords outside the subset are the callee's.
    assert check_arguments({"n": 1, "extra": {}}, {"properties": {"n": {"minimum": 5}}}) == {"n": 1, "extra": {}}
    with pytest.raises(ValueError, match="type object"):
        Tool.from_schema("bad", "Bad.", {"type": "array"}, lambda **kw: kw)


def test_from_schema_tools_work_in_a_tool_env():
    class Echo(ToolEnv):
        def __init__(self, **knobs):
            echo = Tool.from_schema("echo", "Echo the arguments.", SCHEMA, lambda **kw: json.dumps(kw))
            super().__init__(tools=[echo], instructions="Echo.", **knobs)

        def new_task(self):
            return Task("Echo 3.", 3, solution=[Call("echo", {"n": 3, "x": 0.5})])

    brackets, json_env = Echo(tool_format="brackets"), Echo(tool_format="json")
    assert "ECHO[n, x, flag, tags, point, mode, file-name]: Echo the arguments." in brackets.system_prompt
    for env in (brackets, json_env):
        env.reset(seed=0)
        call, answer = env.oracle_actions()
        observation, *_ = env.step(call)
        assert observation.endswith('{"n": 3, "x": 0.5}') or '{"n": 3, "x": 0.5}' in observation
        assert env.step(answer)[0] == "CORRECT"
