"""The sandbox as an unprivileged user: the path every non-root machine takes (bubblewrap's own
user namespace, `--unshare-all`, calls sharing the user's uid), run here from root by dropping to
uid/gid 65534 with `setpriv` in a subprocess with a scratch HOME.

Skips, saying why, when this process is not root (then the other sandbox tests already take the
non-root path), when `setpriv` is missing, when no Python of this version with toolgym's
packages can run as that user, or when unprivileged user namespaces are unavailable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

NOBODY = 65534
_SCRIPT = r"""
import json, os, site, sys, time
site.addsitedir(sys.argv[1])
from toolgym.envs import Sandbox, SandboxConfig

def tree(pid):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found

def settled(box):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(len(tree(pid)) > 1 for pid in box.pids):
        time.sleep(0.05)
    return [len(tree(pid)) for pid in box.pids]

home = sys.argv[2]
out = {}
open(home + "/host_ok", "w").write("the user writes its home outside the sandbox")
with Sandbox(SandboxConfig(timeout_s=3.0, processes=64)) as box:
    out["host_uid"] = os.getuid()
    out["call"] = box.run("import os\nprint(6 * 7, os.getuid())").stdout
    out["write_usr"] = box.run("open('/usr/pwned', 'w').write('x')").stderr.strip().rpartition("\n")[2]
    out["write_home"] = box.run(f"open({home + '/pwned'!r}, 'w').write('x')").stderr.strip().rpartition("\n")[2]
    out["read_canary"] = box.run(f"print(open({home + '/canary'!r}).read())").kind
    out["write_tmp"] = box.run("open('here', 'w').write('ok')\nprint(open('here').read())").stdout
    bomb = box.run("import os\nwhile True:\n    os.fork()")
    out["bomb"] = bomb.kind
    out["after_bomb"] = settled(box)
    out["after_bomb_call"] = box.run("print('alive')").stdout
    with box.session() as session:
        session.run("x = 41")
        out["session"] = session.run("print(x + 1)").stdout
    out["after_session"] = settled(box)
print(json.dumps(out))
"""


def _user_python() -> tuple[str, str]:
    """(a Python of this version the unprivileged user can run, this venv's site-packages)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    site_dir = sysconfig.get_paths()["purelib"]
    candidates = [str(Path(sys.base_prefix, "bin", f"python{version}")), f"/usr/bin/python{version}"]
    probe = "import site, sys; site.addsitedir(sys.argv[1]); import msgspec, toolgym.envs.tools.sandbox"
    tried = []
    for python in dict.fromkeys(candidates):
        if not os.path.exists(python):
            tried.append(f"{python}: missing")
            continue
        done = _as_nobody([python, "-I", "-c", probe, site_dir], cwd="/", env=_env("/"), timeout=120)
        if done.returncode == 0:
            return python, site_dir
        tried.append(
            f"{python}: {(done.stderr.strip().splitlines() or ['exit ' + str(done.returncode)])[-1]}"
        )
    pytest.skip(f"no Python {version} with toolgym's packages runs as uid {NOBODY} ({'; '.join(tried)})")


def _env(home: str) -> dict[str, str]:
    return {"HOME": home, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def _as_nobody(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    command = [
        "setpriv",
        f"--reuid={NOBODY}",
        f"--regid={NOBODY}",
        "--clear-groups",
        "--inh-caps=-all",
        *argv,
    ]
    return subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)


def _processes_of(uid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (
                    entry.stat().st_uid == uid
                    and "Z" not in (entry / "stat").read_text().rpartition(")")[2][:3]
                ):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.skipif(os.geteuid() != 0, reason="not root: the other sandbox tests already run unprivileged")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_the_sandbox_isolates_and_bounds_calls_as_an_unprivileged_user():
    userns = _as_nobody(["bwrap", "--unshare-all", "--ro-bind", "/", "/", "true"], timeout=60)
    if userns.returncode != 0:
        pytest.skip(f"unprivileged user namespaces are unavailable: bwrap says {userns.stderr.strip()!r}")
    python, site_dir = _user_python()
    home = Path(tempfile.mkdtemp(prefix="toolgym-nobody-home-"))  # in /tmp: reachable by the user
    try:
        (home / "canary").write_text("host data")
        os.chown(home, NOBODY, NOBODY)
        os.chown(home / "canary", NOBODY, NOBODY)
        before = set(_processes_of(NOBODY))
        done = _as_nobody(
            [python, "-I", "-c", _SCRIPT, site_dir, str(home)],
            cwd=str(home),
            env=_env(str(home)),
            timeout=300,
        )
        listing = sorted(p.name for p in home.iterdir())
        canary = (home / "canary").read_text()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["host_uid"] == NOBODY
    assert out["call"] == f"42 {NOBODY}\n"
    assert out["write_usr"].startswith("OSError: [Errno 30] Read-only file system")
    assert out["write_home"].startswith(("FileNotFoundError", "PermissionError", "OSError: [Errno 30]"))
    assert out["read_canary"] == "sandbox_error"  # the home directory is not in the sandbox
    assert out["write_tmp"] == "ok\n"
    assert out["bomb"] in ("sandbox_error", "sandbox_timeout", "sandbox_crash")  # crash: killed at the cap
    assert out["after_bomb"] == [1] and out["after_bomb_call"] == "alive\n"
    assert out["session"] == "42\n" and out["after_session"] == [1]
    assert listing == ["canary", "host_ok"] and canary == "host data"
    assert set(_processes_of(NOBODY)) <= before  # nothing left running as that user
