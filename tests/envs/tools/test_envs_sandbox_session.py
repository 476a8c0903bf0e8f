"""The sandbox's persistent interpreter (SandboxSession, `python_tool(persistent=True)`): state
lives for one episode and no longer, is never shared, keeps the per-call limits, and leaves
nothing running. Also the ToolEnv's tool lifetimes (Tool.per_env, Tool.end_episode), which need
no sandbox.

The sandbox tests skip when bubblewrap cannot run here, unless TOOLGYM_REQUIRE_SANDBOX is set."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from sandbox_testlib import start_sandbox
from test_envs_sandbox import _descendants

import toolgym.envs.tools.sandbox as sandbox_module
from toolgym.envs import Call, SandboxConfig, Task, Tool, ToolEnv, python_tool

CONFIG = SandboxConfig(timeout_s=2.0, cpu_s=1, memory_mb=512, max_output_chars=2000, processes=64)


@pytest.fixture(scope="module")
def sandbox():
    box = start_sandbox(CONFIG)
    yield box
    box.close()


def _only_the_zygote_left(box) -> None:
    """Each zygote's tree is its one sandboxed process (the zygote, PID 1): no interpreter, no
    call, no leftover."""
    deadline = time.monotonic() + 5
    while any(len(_descendants(pid)) > 1 for pid in box.pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(len(_descendants(pid)) == 1 for pid in box.pids), {p: _descendants(p) for p in box.pids}


def test_variables_imports_and_functions_survive_to_the_next_call(sandbox):
    with sandbox.session() as session:
        first = session.run("import fractions\nx = 41\ndef inc(v):\n    return v + 1\nprint(inc(x))")
        assert (first.stdout, first.kind, first.started, first.note) == ("42\n", None, True, "")
        second = session.run("print(inc(x), fractions.Fraction(1, 3))")
        assert (second.stdout, second.started, second.note) == ("42 1/3\n", False, "")
        assert session.run("open('notes.txt', 'w').write('kept')").kind is None  # its files too
        assert session.run("print(open('notes.txt').read())").stdout == "kept\n"
        assert sandbox.run("print('x' in globals())").stdout == "False\n"  # a plain call: fresh
    _only_the_zygote_left(sandbox)


def test_concurrent_sessions_never_see_each_other(sandbox):
    sessions = [sandbox.session() for _ in range(4)]

    def episode(i: int) -> list[str]:
        session = sessions[i]
        seen = [session.run(f"secret = {i}\nprint(sorted(k for k in globals() if k == 'secret'))").stdout]
        for _ in range(5):
            seen.append(
                session.run("secret = secret * 10 + 1 if secret < 10**4 else secret\nprint(secret)").stdout
            )
        return seen

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(episode, range(4)))
    for i, seen in enumerate(results):
        expected, value = ["['secret']\n"], i
        for _ in range(5):
            value = value * 10 + 1 if value < 10**4 else value
            expected.append(f"{value}\n")
        assert seen == expected
    for session in sessions:
        session.close()
    _only_the_zygote_left(sandbox)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        ("while True: pass", "sandbox_timeout"),
        ("import ctypes\nctypes.string_at(0)", "sandbox_crash"),
        ("import os\nos._exit(0)", "sandbox_error"),
    ],
)
def test_a_call_that_ends_the_interpreter_loses_the_state_and_says_so(sandbox, code, kind):
    with sandbox.session() as session:
        assert session.run("x = 1").kind is None
        start = time.monotonic()
        ended = session.run(code)
        assert ended.kind == kind and time.monotonic() - start < CONFIG.timeout_s + 3
        assert "the interpreter is gone" in ended.observation()
        fresh = session.run("print('x' in globals())")
        assert (fresh.stdout, fresh.started, fresh.kind) == ("False\n", True, None)
        assert fresh.observation().startswith("[a fresh interpreter: the variables")
        assert session.run("print(2)").observation() == "2"  # said once
    _only_the_zygote_left(sandbox)


def test_the_limits_hold_per_call_and_the_state_survives_what_the_interpreter_survives(sandbox):
    with sandbox.session() as session:
        session.run("x = 7")
        oom = session.run("y = bytearray(20 * 10**9)")
        assert oom.kind == "sandbox_oom" and "512 MB" in oom.observation()
        big = session.run("print('a' * 10**8)")
        assert big.truncated and big.stdout.endswith("[output truncated: 100000001 bytes in all]")
        exited = session.run("import sys\nsys.exit(3)")
        assert (exited.kind, exited.exit_code) == ("sandbox_error", 3)
        bomb = session.run("import os\nwhile True:\n    os.fork()")
        assert bomb.kind in ("sandbox_error", "sandbox_timeout")
        # CPU seconds are per call: two calls of 0.6 s each pass a 1 s limit.
        spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\nprint(x)"
        if bomb.kind == "sandbox_error":  # the interpreter outlived the bomb: its state too
            assert session.run(spin).stdout == "7\n" and session.run(spin).stdout == "7\n"
        assert session.run("while True: pass").kind == "sandbox_timeout"  # the 1 s CPU limit
    _only_the_zygote_left(sandbox)


def test_what_a_call_leaves_running_is_killed_when_it_ends(sandbox):
    with sandbox.session() as session:
        started = session.run("import subprocess, sys\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid)")
        pid = int(started.stdout)
        assert session.run(f"import os\nprint(os.path.exists('/proc/{pid}'))").stdout == "False\n"
        session.run("import subprocess\nsubprocess.Popen(['sleep', '60'])")
    _only_the_zygote_left(sandbox)


def test_reset_ends_the_state_without_a_note(sandbox):
    session = sandbox.session()
    session.run("x = 1")
    session.reset()
    _only_the_zygote_left(sandbox)
    fresh = session.run("print('x' in globals())")
    assert (fresh.stdout, fresh.note) == ("False\n", "")
    session.close()
    with pytest.raises(RuntimeError, match="closed"):
        session.run("1")
    _only_the_zygote_left(sandbox)


class _CalcEnv(ToolEnv):
    def __init__(self, tools, **knobs):
        super().__init__(tools=tools, instructions="Compute.", tool_format="json", **knobs)

    def new_task(self) -> Task:
        return Task("What is 6 * 7?", 42, [Call("python", {"code": "print(6 * 7)"})])

    def call(self, code: str) -> str:
        """Run one python call as a step; its result text."""
        tool = self.tools["PYTHON"]
        *_, info = self.step(self.format.render_call(tool, Call("python", {"code": code})))
        return info["tool_results"][0]


def test_a_tool_env_gives_each_episode_its_own_interpreter(sandbox, monkeypatch):
    monkeypatch.setattr(sandbox_module, "shared_sandbox", lambda config=None: sandbox)
    tool = python_tool(persistent=True)
    assert "stay for your next calls" in tool.description
    one, two = _CalcEnv([tool]), _CalcEnv([tool])  # one tool given to two envs: each its own copy
    assert one.tools["PYTHON"] is not two.tools["PYTHON"]
    one.reset(seed=0)
    two.reset(seed=0)
    assert one.call("x = 6 * 7\nprint(x)") == "42"
    assert two.call("print('x' in globals())") == "False"  # a concurrent episode
    assert one.call("print(x)") == "42"
    one.reset(seed=1)  # the next episode
    assert one.call("print('x' in globals())") == "False"  # and no note: a new episode
    assert one.call("x = 1") == "[no output]"
    _, _, terminated, _, _ = one.step(one.answer_action(42))
    assert terminated
    two.close()
    _only_the_zygote_left(sandbox)  # both episodes' interpreters are gone
    one.reset(seed=2)
    assert one.call("print('x' in globals())") == "False"
    one.close()
    _only_the_zygote_left(sandbox)


def test_a_tool_env_ends_its_tools_episodes_and_copies_them_per_env():
    """Tool.per_env and Tool.end_episode, with a plain counter as the episode's state."""
    ended: list[int] = []

    def counting_tool() -> Tool:
        count = [0]

        def python(code: str) -> int:
            """Count the calls of this episode."""
            count[0] += 1
            return count[0]

        def end() -> None:
            ended.append(count[0])
            count[0] = 0

        return Tool.from_function(python, per_env=counting_tool, end_episode=end)

    template = counting_tool()
    env = _CalcEnv([template])
    env.reset(seed=0)
    assert ended == [0]
    assert (env.call("a"), env.call("b")) == ("1", "2")
    env.reset(seed=0)  # a new episode: the last one's state is gone
    assert ended == [0, 2] and env.call("c") == "1"
    env.step(env.answer_action(42))  # the episode ends: its state is let go at once
    assert ended == [0, 2, 1]
    env.close()
    assert ended == [0, 2, 1, 0]
    assert template.fn("x") == 1  # the env used a copy, never the tool it was given
