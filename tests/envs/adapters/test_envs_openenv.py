"""toolgym/OpenEnv-v0 against real OpenEnv servers: openenv-core's own server code (create_app,
uvicorn) serving the two environments of openenv_servers.py, started as subprocesses on
127.0.0.1 by the env itself (or reached by URL)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

pytest.importorskip("openenv")

from openenv_servers import MAX_SESSIONS

from toolgym.configs.cli.main import main as cli_main
from toolgym.envs import list_envs
from toolgym.envs.adapters.openenv import OpenEnvEnv, OpenEnvServerError
from toolgym.trainers.metrics_log import read_metrics

ENV_ID = "toolgym/OpenEnv-v0"
SERVERS = str(Path(__file__).with_name("openenv_servers.py"))
GUESS = [sys.executable, SERVERS, "guess", "{port}"]
TOOLS = [sys.executable, SERVERS, "tools", "{port}"]

pytestmark = pytest.mark.slow  # each server takes seconds to start


def _children() -> set[int]:
    me = str(os.getpid())
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                    found.add(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


def make(command=GUESS, **kwargs) -> OpenEnvEnv:
    env = gymnasium.make(ENV_ID, command=command, keep_alive_s=0, **kwargs)
    assert isinstance(env.unwrapped, OpenEnvEnv)
    return env.unwrapped


@pytest.fixture(scope="module")
def guess():
    """An env holding the guess server for the module (others with the same command share it)."""
    before = _children()
    holder = make(GUESS)
    holder.reset(seed=0)
    yield holder
    holder.close()
    assert _children() <= before  # the server and its process group are gone


@pytest.fixture(scope="module")
def tools():
    before = _children()
    holder = make(TOOLS, tool_format="json")
    holder.reset(seed=0)
    yield holder
    holder.close()
    assert _children() <= before


def test_registered_when_installed():
    assert ENV_ID in list_envs()


def _play_guess(env: OpenEnvEnv, seed: int) -> list[tuple]:
    question, info = env.reset(seed=seed)
    assert question.startswith("prompt: Guess my number from 1 to 8.") and info["question"] == question
    steps = [env.step("abc")]
    for n in range(1, 9):
        steps.append(env.step(str(n)))
        if steps[-1][2]:
            break
    return steps


def test_text_game_round_trip_rewards_done_and_rubric_parts(guess):
    env = make(GUESS)
    steps = _play_guess(env, seed=3)
    observation, reward, terminated, truncated, info = steps[0]
    assert observation == "feedback: That is not a number.\nguesses: 1"
    assert reward == pytest.approx(-0.1) and not terminated and not truncated
    assert info["reward_components"] == pytest.approx({"correct": 0.0, "valid": -0.1, "reward": 0.0})
    for observation, reward, terminated, _, _ in steps[1:-1]:
        assert observation.split("\n")[0] in ("feedback: Higher.", "feedback: Lower.")
        assert reward == 0.0 and not terminated
    observation, reward, terminated, truncated, info = steps[-1]
    assert observation.startswith("feedback: Correct!") and reward == 1.0 and terminated and not truncated
    assert info["end_reason"] == "answered"
    assert info["reward_components"] == pytest.approx({"correct": 1.0, "valid": -0.1, "reward": 0.0})
    assert sum(info["reward_components"].values()) == pytest.approx(sum(s[1] for s in steps))
    assert info["metrics"]["server_reward"] == pytest.approx(0.9)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("1")
    # the same seed is the same game; the env's session serves the next episode
    assert [s[:3] for s in _play_guess(env, seed=3)] == [s[:3] for s in steps]
    env.close()


def test_max_turns_truncates(guess):
    env = make(GUESS, max_turns=2)
    env.reset(seed=1)
    assert env.step("x")[2:4] == (False, False)
    _, _, terminated, truncated, info = env.step("y")
    assert (terminated, truncated, info["end_reason"]) == (False, True, "max_turns")
    env.close()


def test_check_env(guess):
    env = make(GUESS)
    check_env(env)
    env.close()


def test_mcp_tools_are_tools_in_the_env_format_and_calls_go_through(tools):
    env = make(TOOLS, tool_format="json")
    question, info = env.reset(seed=5)
    a, b = map(int, re.findall(r"\d+", question))
    assert question == f"What is {a} + {b}? Use the tools; submit the sum."
    assert env.tools is not None and sorted(env.tools) == ["ADD", "SUBMIT"]
    assert {t["function"]["name"] for t in info["tools"]} == {"add", "submit"}
    assert info["tools"][0]["function"]["parameters"]["properties"] == {
        "a": {"type": "integer"},
        "b": {"type": "integer"},
    }
    assert "add" in info["system_prompt"] and "<tool_call>" in info["system_prompt"]

    def call(name, **arguments):
        return env.step(f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>")

    observation, reward, terminated, _, info = call("add", a=a, b=b)
    assert info["tool_results"] == [str(a + b)] and str(a + b) in observation
    assert reward == 0.0 and not terminated and info["metrics"]["tool_calls"] == 1.0
    # refused before the call (the schema), by the server, and text outside a call: errors
    _, _, _, _, info = call("add", a="x", b=1)
    assert "integer" in info["tool_results"][0]
    _, _, _, _, info = call("nosuch")
    assert "unknown tool" in info["tool_results"][0]
    observation, _, terminated, _, info = env.step("the answer is 3")
    assert observation.startswith("ERROR: no tool call") and not terminated
    assert info["metrics"]["env_errors"] == 3.0
    observation, reward, terminated, _, info = call("submit", answer=a + b)
    assert observation.endswith(f"submitted {a + b}") or f"submitted {a + b}" in observation
    assert reward == 1.0 and terminated and info["end_reason"] == "answered"
    assert info["reward_components"] == {"reward": 1.0}
    # a wrong sum: the server's reward 0, still done
    env.reset(seed=6)
    assert call("submit", answer=-1)[1:3] == (0.0, True)
    env.close()


def test_brackets_format_calls_the_same_tools(tools):
    env = make(TOOLS)
    question, info = env.reset(seed=7)
    a, b = map(int, re.findall(r"\d+", question))
    assert "ADD[a, b]: Add two integers." in info["system_prompt"]
    observation, reward, terminated, _, _ = env.step(f"ADD[{a}, {b}]")
    assert observation == f"ADD[{a}, {b}] = {a + b}" and reward == 0.0 and not terminated
    assert env.step(f"SUBMIT[{a + b}]")[1:3] == (1.0, True)
    env.close()


def test_a_killed_server_ends_the_episode_in_one_line_and_the_next_episode_is_fine():
    before = _children()
    command = [*GUESS[:-1], "{port}"]
    env = make(command, env={"TOOLGYM_TEST_SERVER": "killed"})  # a server of its own
    env.reset(seed=0)
    env.step("1")
    server = env._server
    assert server is not None
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
    with pytest.raises(OpenEnvServerError) as raised:
        env.step("2")
    message = str(raised.value)
    assert "\n" not in message and "session is lost" in message and "exited with code -9" in message
    # the next episode starts the server afresh and plays through
    steps = _play_guess(env, seed=0)
    assert steps[-1][2] and steps[-1][1] == 1.0
    assert env._server is not server and env._server is not None and env._server.alive
    env.close()
    assert _children() <= before


def test_a_slow_server_times_out_in_one_line_and_the_next_episode_is_fine(guess):
    assert guess._server is not None
    env = gymnasium.make(ENV_ID, url=guess._server.url, timeout_s=1.0).unwrapped
    env.reset(seed=0)
    with pytest.raises(OpenEnvServerError) as raised:
        env.step("hang")  # the server never answers it
    assert "\n" not in str(raised.value) and "did not answer a step within 1 s" in str(raised.value)
    steps = _play_guess(env, seed=0)  # a new session
    assert steps[-1][2]
    env.close()


def test_a_session_past_the_servers_capacity_is_a_one_line_error_and_frees_with_a_close():
    before = _children()
    held = [make(GUESS, env={"TOOLGYM_TEST_SERVER": "capacity"}) for _ in range(MAX_SESSIONS + 1)]
    try:
        for env in held[:MAX_SESSIONS]:
            env.reset(seed=0)
        extra = held[-1]
        with pytest.raises(OpenEnvServerError) as raised:
            extra.reset(seed=0)  # refused at its first message (list_tools), not taken for "no tools"
        message = str(raised.value)
        assert "\n" not in message and "max_concurrent_envs" in message and "CAPACITY_REACHED" in message
        assert extra.tools is None  # the tools are still to be listed
        held[0].close()
        assert _play_guess(extra, seed=3)[-1][2]  # a session is free again
    finally:
        for env in held:
            env.close()
    assert _children() <= before


class _Garbage(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"\x00 no websocket here \xff")

    def log_message(self, *args):
        pass


def test_a_down_or_garbage_server_or_one_that_cannot_start_is_a_one_line_error():
    before = _children()
    down = gymnasium.make(ENV_ID, url="http://127.0.0.1:9", timeout_s=2.0)
    with pytest.raises(OpenEnvServerError, match="cannot open a session") as raised:
        down.reset(seed=0)
    assert "\n" not in str(raised.value)
    down.close()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        garbage = gymnasium.make(ENV_ID, url=f"http://127.0.0.1:{server.server_address[1]}", timeout_s=2.0)
        with pytest.raises(OpenEnvServerError) as raised:
            garbage.reset(seed=0)
        assert "\n" not in str(raised.value)
        garbage.close()
    finally:
        server.shutdown()
        server.server_close()
    failing = [sys.executable, "-c", "import sys; print('no such environment'); sys.exit(4)"]
    with pytest.raises(OpenEnvServerError) as raised:
        make(failing).reset(seed=0)
    message = str(raised.value)
    assert "\n" not in message and "exited with code 4" in message and "no such environment" in message
    assert _children() <= before


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        ("not json at all", "list_tools failed (JSONDecodeError"),
        ('{"type": "observation", "data": {"observation": "text", "done": false}}', "unreadable observation"),
        ('{"type": "state", "data": {}}', "with no observation"),
    ],
)
def test_a_session_that_answers_garbage_is_a_one_line_error(reply, said):
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.server import serve

    def answer(websocket):
        with contextlib.suppress(ConnectionClosed):  # the client's close
            for _ in websocket:
                websocket.send(reply)

    with serve(answer, "127.0.0.1", 0) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        env = gymnasium.make(ENV_ID, url=f"http://127.0.0.1:{server.socket.getsockname()[1]}", timeout_s=2.0)
        with pytest.raises(OpenEnvServerError) as raised:
            env.reset(seed=0)
        assert "\n" not in str(raised.value) and said in str(raised.value)
        env.close()
        server.shutdown()


def test_a_short_training_run_through_the_cli(tmp_path, guess):
    """The env made per episode by the runner shares the module's server; the rubric's parts (named
    at reset) are logged as reward components. The random tiny model's turns end at the token
    limit: `cut_turn = "step"` gives them to the server all the same, whose rubric scores them."""
    before = _children()
    run_dir = tmp_path / "run"
    command = json.dumps(GUESS)
    overrides = [
        f"run.run_dir={run_dir}", "run.steps=2", "run.export_hf=false", "run.plot=false",
        "model.name=test", "model.overrides.vocab_size=1024",
        f"env.id={ENV_ID}", f"env.kwargs={{command = {command}, keep_alive_s = 0, max_turns = 2}}",
        "sft.enabled=false", "policy.max_seq_len=256",
        "rollout.group_size=2", "rollout.max_turns=2", "rollout.max_tokens_per_turn=4",
        "rollout.max_tokens_per_episode=16", "rollout.cut_turn=step", "batch.groups_per_batch=1", "batch.dynamic_sampling=false",
        "eval.num_tasks=2", "eval.samples_per_task=1", "logging.progress_bar=false",
    ]  # fmt: skip
    assert cli_main(["train", "--no-progress", *(a for o in overrides for a in ("--set", o))]) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all("rollout/reward/correct" in r and "rollout/reward/valid" in r for r in train)
    assert all(r["rollout/reward/valid"] <= 0.0 and r["rollout/stop_reason/env_error"] == 0.0 for r in train)
    assert any(r["rollout/reward/valid"] < 0.0 for r in train)  # stepped: random text is no number
    assert all("rollout/reward_mean" in r and "rollout/server_reward" in r for r in train)
    assert _children() <= before
