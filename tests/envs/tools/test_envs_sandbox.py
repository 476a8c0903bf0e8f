"""The code sandbox under attack: every attack ends as a result or an error observation, the test
process lives, nothing is left running in the sandbox, the host's files are untouched.

Skipped when bubblewrap cannot run here, unless TOOLGYM_REQUIRE_SANDBOX is set."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import re
import signal
import socket
import time
from pathlib import Path

import msgspec
import pytest
from sandbox_testlib import sandbox_missing, start_sandbox

import toolgym.envs.tools.sandbox as sandbox_module
from toolgym.envs import Sandbox, SandboxConfig, SandboxUnavailable, python_tool
from toolgym.envs.tools.typed import ToolCallError

CONFIG = SandboxConfig(timeout_s=2.0, cpu_s=2, memory_mb=512, max_output_chars=2000, pool_size=2)


@pytest.fixture(scope="module")
def sandbox():
    box = start_sandbox(CONFIG)
    yield box
    pids = {pid for top in box.pids for pid in (top, *_descendants(top))}
    assert len(pids) == 2 * CONFIG.pool_size  # bubblewrap and its zygote, each
    box.close()
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _descendants(pid: int) -> set[int]:
    """Every live process under `pid` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _only_zygotes_left(box: Sandbox) -> None:
    """Each zygote's tree is bubblewrap's one sandboxed process, the zygote (PID 1) itself."""
    deadline = time.monotonic() + 5
    while True:
        trees = {pid: _descendants(pid) for pid in box.pids}
        if all(len(tree) <= 1 for tree in trees.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(len(tree) == 1 for tree in trees.values()), trees


def _attack(box: Sandbox, code: str):
    result = box.run(code)
    _only_zygotes_left(box)
    return result


def test_a_clean_call_prints_and_the_next_one_starts_fresh(sandbox):
    first = sandbox.run("x = 41\nprint(x + 1)")
    assert (first.stdout, first.kind, first.exit_code, first.observation()) == ("42\n", None, 0, "42")
    second = sandbox.run("print('x' in globals())")
    assert second.stdout == "False\n"
    assert sandbox.run("pass").observation() == "[no output]"


def test_an_infinite_loop_times_out_and_its_process_group_is_killed(sandbox):
    start = time.monotonic()
    result = _attack(sandbox, "import os\nos.fork()\nwhile True: pass")
    assert result.kind == "sandbox_timeout" and result.exit_code is None
    assert time.monotonic() - start < CONFIG.timeout_s + 3


def test_cpu_past_the_limit_is_a_timeout_naming_the_cpu_limit():
    # SIGXCPU at cpu_s (a timeout), not the SIGKILL that equal soft and hard limits would send
    box = start_sandbox(msgspec.structs.replace(CONFIG, timeout_s=10.0, cpu_s=1, pool_size=1))
    try:
        result = box.run("while True: pass")
    finally:
        box.close()
    assert (result.kind, result.exit_code) == ("sandbox_timeout", None)
    assert "CPU time limit of 1 s" in result.message


def test_a_fork_bomb_hits_the_process_limit(sandbox):
    result = _attack(sandbox, "import os\nwhile True:\n    os.fork()")
    assert result.kind in ("sandbox_error", "sandbox_timeout", "sandbox_crash")
    if result.kind == "sandbox_error":
        assert "BlockingIOError" in result.stderr
    if result.kind == "sandbox_crash":  # without cgroups: killed when its processes reach the cap
        assert "processes reached the limit" in result.message


def test_a_20_gb_allocation_is_out_of_memory(sandbox):
    result = _attack(sandbox, "x = bytearray(20 * 10**9)")
    assert result.kind == "sandbox_oom" and "MemoryError" in result.stderr
    assert "512 MB" in result.observation()


def test_a_10_gb_file_stops_at_the_file_size_limit(sandbox):
    code = "with open('big', 'wb') as f:\n    for _ in range(10**4):\n        f.write(b'x' * 10**6)"
    result = _attack(sandbox, code)
    assert result.kind == "sandbox_error" and "File too large" in result.stderr


def test_the_host_files_are_out_of_reach(sandbox, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("host data")
    before = hashlib.sha256(canary.read_bytes()).hexdigest()
    targets = [canary, Path.cwd() / "pyproject.toml", Path.home() / ".ssh", Path("/etc/shadow"), Path("/etc/passwd")]
    for target in targets:
        result = _attack(sandbox, f"print(open({str(target)!r}).read())")
        assert result.kind == "sandbox_error" and "FileNotFoundError" in result.stderr, (target, result)
    result = _attack(sandbox, f"open({str(canary)!r}, 'w').write('pwned')")
    assert result.kind == "sandbox_error"
    assert hashlib.sha256(canary.read_bytes()).hexdigest() == before
    listing = sandbox.run("import os\nprint(sorted(os.listdir('/')))\nprint(os.listdir('/etc'))").stdout
    assert "work" not in listing and "home" not in listing and "'ld.so.cache'" in listing


def test_a_socket_to_a_host_server_reaches_nothing(sandbox):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).send(b'hi')"
        result = _attack(sandbox, code)
        assert result.kind == "sandbox_error" and "ConnectionRefusedError" in result.stderr
        with pytest.raises(TimeoutError):
            server.accept()


def test_killing_the_parent_fails_and_the_zygote_serves_on(sandbox):
    pids = sandbox.pids
    result = _attack(sandbox, "import os\nos.kill(os.getppid(), 9)\nos.kill(1, 9)")
    assert result.kind == "sandbox_error"
    assert sandbox.pids == pids and sandbox.run("print(7)").stdout == "7\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="calls have uids of their own only when the host process is root")
def test_a_call_cannot_kill_another_call():
    with start_sandbox(SandboxConfig(timeout_s=5.0)) as box:
        victim = box.submit("import time\ntime.sleep(0.5)\nprint('alive')")
        time.sleep(0.1)
        attacker = box.run("import os\nos.kill(-1, 9)\nprint('sent')")  # to every process it may signal
        assert attacker.stdout == "sent\n"
        assert victim.result(timeout=10).stdout == "alive\n"


def test_a_segfault_is_a_crash(sandbox):
    result = _attack(sandbox, "import ctypes\nctypes.string_at(0)")
    assert (result.kind, result.signal) == ("sandbox_crash", signal.SIGSEGV)
    assert "SIGSEGV" in result.observation()


def test_sys_exit_is_an_exit_status(sandbox):
    result = _attack(sandbox, "print('bye')\nimport sys\nsys.exit(3)")
    assert (result.kind, result.exit_code, result.stdout) == ("sandbox_error", 3, "bye\n")
    assert result.observation() == "bye\n[exit status 3]"


def test_a_100_mb_print_is_cut_with_a_marker(sandbox):
    start = time.monotonic()
    result = _attack(sandbox, "print('a' * 10**8)")
    assert result.kind is None and result.truncated
    assert result.stdout.startswith("a" * 2000) and result.stdout.endswith("[output truncated: 100000001 bytes in all]")
    assert len(result.observation()) < 2100 and time.monotonic() - start < 10


def test_nul_bytes_and_invalid_utf8_are_shown_visibly(sandbox):
    result = sandbox.run("import sys\nsys.stdout.buffer.write(b'a\\x00b\\xff\\xfec')\nprint('\\udcff')")
    assert result.kind is None
    assert result.stdout.startswith("a\\x00b\ufffd\ufffdc") and "\\udcff" in result.stdout


def test_64_concurrent_calls_from_threads_and_an_event_loop(sandbox):
    codes = [f"import time\ntime.sleep(0.2)\nprint({i} * {i})" for i in range(64)]
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(sandbox.run, codes))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(64)]
    assert time.monotonic() - start < 5  # concurrent, not 64 x 0.2 s in a row

    async def gather():
        return await asyncio.gather(*(sandbox.arun(code) for code in codes))

    assert [r.stdout for r in asyncio.run(gather())] == [f"{i * i}\n" for i in range(64)]
    _only_zygotes_left(sandbox)


def test_a_dead_zygote_fails_its_call_and_is_replaced():
    with start_sandbox(SandboxConfig(timeout_s=5.0)) as box:
        (pid,) = box.pids
        future = box.submit("import time\ntime.sleep(3)")
        time.sleep(0.3)
        os.killpg(pid, signal.SIGKILL)
        assert future.result(timeout=5).kind == "sandbox_failure"
        assert box.run("print(1)").stdout == "1\n" and box.pids != [pid]


def test_the_tool_reports_errors_as_tool_call_errors_with_metrics(sandbox, monkeypatch):
    monkeypatch.setattr(sandbox_module, "shared_sandbox", lambda config=None: sandbox)
    tool = python_tool()
    assert tool.spec["function"]["parameters"]["required"] == ["code"]
    assert tool({"code": "print(2 ** 10)"}).content == "1024"
    with pytest.raises(ToolCallError) as refused:
        tool({"code": "1 / 0"})
    assert refused.value.kind == "sandbox_error" and refused.value.metrics == {"sandbox_error": 1.0}
    assert "ZeroDivisionError" in str(refused.value)
    assert tool({"code": "print('y' * 5000)"}).metrics == {"sandbox_output_truncated": 1.0}


def test_without_bubblewrap_it_refuses_to_start_in_one_line(monkeypatch):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="bubblewrap") as refused:
        Sandbox(SandboxConfig())
    assert "\n" not in str(refused.value) and "isolation='rlimits'" in str(refused.value)


def test_when_bubblewrap_cannot_make_its_namespaces_it_refuses_to_start(monkeypatch):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: "/bin/false")
    with pytest.raises(SandboxUnavailable, match="bubblewrap cannot start the sandbox") as refused:
        Sandbox(SandboxConfig())
    assert "\n" not in str(refused.value)


def test_the_rlimits_mode_warns_and_still_bounds_the_call():
    with pytest.warns(RuntimeWarning, match="rlimits"):
        box = Sandbox(SandboxConfig(isolation="rlimits", timeout_s=1.0))
    with box:
        assert box.run("print(6 * 7)").stdout == "42\n"
        assert box.run("while True: pass").kind == "sandbox_timeout"
        assert box.run("x = bytearray(20 * 10**9)").kind == "sandbox_oom"


def test_the_config_is_checked():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match="pool_size"):
        SandboxConfig(pool_size=0)
    with pytest.raises(ValueError, match="absolute"):
        SandboxConfig(ro_binds=("site-packages",))


def test_a_memory_limit_below_what_the_interpreter_needs_is_refused_when_the_sandbox_starts():
    try:
        Sandbox(SandboxConfig(memory_mb=8, timeout_s=5.0))
    except SandboxUnavailable as exc:
        sandbox_missing(str(exc))
    except ValueError as exc:
        found = re.search(r"memory_mb=8 is too small: .* at least (\d+) MB", str(exc))
        assert found, str(exc)
        minimum = int(found[1])
    else:
        pytest.fail("memory_mb=8 was accepted")
    assert minimum > 16
    # The interpreter's address space can differ by a page between starts (the rounding to MB).
    with pytest.raises(ValueError, match=f"memory_mb={minimum - 2} is too small"):
        Sandbox(SandboxConfig(memory_mb=minimum - 2, timeout_s=5.0))
    with Sandbox(SandboxConfig(memory_mb=minimum + 1, timeout_s=5.0)) as box:  # the minimum runs code
        assert box.min_memory_mb <= minimum + 1
        result = box.run("data = bytearray(8 * 2**20)\nprint(len(data))")
        assert (result.kind, result.stdout) == (None, f"{8 * 2**20}\n"), result
