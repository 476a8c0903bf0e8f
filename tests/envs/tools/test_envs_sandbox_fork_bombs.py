"""Fork bombs among harmless calls: every harmless call answers correctly, with per-call cgroups
(each call's processes counted, scheduled and charged as one) and without them (the fallback: a
call whose processes reach the cap is killed at once, all of them, and the zygote outranks them).

Waits on conditions only: the calls' timeout is far beyond what any call here needs, and the
bombs are ended by the process cap (fallback) or by closing the sandbox (cgroups) once every
harmless call has answered. Skipped when bubblewrap cannot run here (see sandbox_testlib)."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest
from sandbox_testlib import start_sandbox

import toolgym.envs.tools.sandbox as sandbox_module
from toolgym.envs import SandboxConfig

# A bomb that keeps forking past every failure: it holds the cap until it is killed.
BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
HARMLESS = "print(6 * 7)"
CONFIG = SandboxConfig(timeout_s=300.0, processes=32)
BOMBS, CALLS = 3, 24

pytestmark = pytest.mark.slow


def _answered(results) -> list[tuple[str | None, str]]:
    return [(r.kind, r.stdout) for r in results if (r.kind, r.stdout) != (None, "42\n")]


def _slots_at_cap(cgroups: dict[str, str]) -> int:
    """How many call slots hold the cap's worth of processes (less one: the cap counts threads)."""
    count = 0
    for slot in Path(cgroups["pids"]).glob("call-*"):
        try:
            count += int((slot / "pids.current").read_text()) >= CONFIG.processes - 1
        except (OSError, ValueError):
            continue
    return count


def test_fork_bombs_with_per_call_cgroups_leave_every_harmless_call_its_answer():
    box = start_sandbox(CONFIG)
    try:
        (cgroups,) = box.cgroups
        if not cgroups:
            pytest.skip("per-call cgroups are not available here (not root, or no writable cgroup v1)")
        bombs = [box.submit(BOMB) for _ in range(BOMBS)]
        while _slots_at_cap(cgroups) < BOMBS:  # every bomb at its cap, and so still running
            assert not any(bomb.done() for bomb in bombs), [bomb.result() for bomb in bombs if bomb.done()]
            time.sleep(0.01)
        with concurrent.futures.ThreadPoolExecutor(CALLS) as pool:
            results = list(pool.map(box.run, [HARMLESS] * CALLS))
        assert _answered(results) == []
        assert not any(bomb.done() for bomb in bombs)  # the bombs ran beside every harmless call
    finally:
        box.close()
    assert {bomb.result().kind for bomb in bombs} == {"sandbox_failure"}  # ended by the close
    assert not any(Path(path).exists() for path in cgroups.values())


def test_fork_bombs_without_cgroups_are_killed_at_the_cap_and_every_harmless_call_answers(monkeypatch):
    monkeypatch.setattr(sandbox_module, "_make_cgroups", dict)  # as where cgroups cannot be written
    box = start_sandbox(CONFIG)
    try:
        assert box.cgroups == [{}]
        codes = [HARMLESS] * CALLS
        for i in range(BOMBS):  # spread among the harmless calls
            codes.insert(i * (CALLS + BOMBS) // BOMBS, BOMB)
        with concurrent.futures.ThreadPoolExecutor(len(codes)) as pool:
            results = list(pool.map(box.run, codes))
        bombs = [r for code, r in zip(codes, results, strict=True) if code == BOMB]
        harmless = [r for code, r in zip(codes, results, strict=True) if code == HARMLESS]
        assert len(bombs) == BOMBS and _answered(harmless) == []
        for bomb in bombs:
            assert bomb.kind == "sandbox_crash", bomb
            assert bomb.message == f"killed: its processes reached the limit of {CONFIG.processes}"
        assert box.run(HARMLESS).stdout == "42\n"
    finally:
        box.close()


def test_a_calls_processes_together_past_memory_mb_are_out_of_memory_with_cgroups():
    box = start_sandbox(SandboxConfig(timeout_s=300.0, memory_mb=200))
    try:
        if box.cgroups == [{}]:
            pytest.skip("per-call cgroups are not available here (not root, or no writable cgroup v1)")
        code = (  # each child within the address-space limit; the four together past memory_mb
            "import os, sys\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
            "        data = bytearray(150 * 2**20)\n        for i in range(0, len(data), 4096):\n"
            "            data[i] = 1\n        os.read(os.open('/dev/zero', os.O_RDONLY), 1)\n"
            "        os.kill(os.getpid(), 19)\n        os._exit(0)\n    kids.append(pid)\n"
            "statuses = [os.waitpid(pid, os.WUNTRACED)[1] for pid in kids]\n"
            "sys.exit(1 if any(os.WIFSIGNALED(s) for s in statuses) else 0)"
        )
        result = box.run(code)
        assert result.kind == "sandbox_oom", result
        assert result.message == "out of memory (limit 200 MB for the call's processes together)"
        assert box.run(HARMLESS).stdout == "42\n"
    finally:
        box.close()
