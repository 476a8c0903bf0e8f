"""The code sandbox: model-written Python run isolated, bounded and fast, as a typed tool.

Any env gets it in one line:

    ToolEnv(tools=[python_tool()], ...)          # or python_tool(SandboxConfig(timeout_s=2))

The tool `python(code)` runs `code` as a fresh `__main__` and returns what it printed. Behind it
is a `Sandbox`: a pool of warm zygotes (envs/tools/sandbox_zygote.py), each a Python process
started once inside bubblewrap that forks one child per call, so a call costs a fork, not an
interpreter start (bench/sandbox_calls.py; figures in bench/RESULTS.md). Calls are concurrent:
`Sandbox.run` (blocking, any thread), `Sandbox.arun` (awaitable, any event loop).

A persistent interpreter, as in a notebook: `python_tool(config, persistent=True)`, or
`Sandbox.session()` directly (`SandboxSession`). What one call defines (variables, imports,
functions, files) the session's next call sees; the interpreter is a child of the zygote, isolated
as a call's process is, and every call keeps the per-call limits. A ToolEnv ends it when the
episode ends (`Tool.per_env`, `Tool.end_episode`), so no two episodes share one.

Isolation (`isolation="bubblewrap"`, the default): new PID, network (loopback only, nothing
reachable), IPC and UTS namespaces; read-only binds of /usr, /lib*, /bin and the interpreter's
own prefix (and `ro_binds`), no /etc but the loader cache, nothing of the home, the work tree or
the run directory; a private size-bounded tmpfs at /tmp holding each call's working directory;
a cleared environment (PATH, LANG, HOME); `--die-with-parent`, `--new-session`. The zygote is
PID 1 of its namespace (a call cannot kill it, and it sweeps leftover processes when idle). As
root, the user namespace is left out and each call (and each session's interpreter) drops to a
uid of its own (`sandbox_uid` + the next of `sandbox_uids` offsets not in use), with no capabilities: the process limit then holds per
call (it does not for uid 0) and a call can signal neither the zygote nor another call.
Elsewhere bubblewrap's `--unshare-all` applies and calls keep the caller's uid (and share it).

Limits, set in each call's process: CPU seconds, address space, file size, open files, processes
(RLIMIT_NPROC counts per uid: per call as root, else shared), no core files; a wall-clock
timeout that kills the call's whole process group.

Calls do not starve each other. Where cgroup v1 pids, cpu and memory hierarchies are writable (as
root), each zygote gets a cgroup directory per controller under this process's own, and each call
a slot in them that its process joins before its code runs: whatever it forks is capped together
(pids.max = `processes`), scheduled as one (a fork bomb gets one call's share of the CPU, not one
per process) and charged together (memory.limit_in_bytes = `memory_mb`), and is killed with the
call even when it left the process group. Elsewhere (a one-time RuntimeWarning says so) the zygote
counts each call's processes many times a second and kills a call, all its processes at once, when they
reach the cap (as root: each call's uid, killed by kill(-1) from that uid; otherwise by process
group, at half the cap the calls share), and as root it runs at nice -10 so that a fork bomb's
processes cannot starve it; such a call is a `sandbox_crash` saying so. Output: at most `max_output_chars` of stdout
and of stderr each, with a visible truncation marker; invalid UTF-8 is replaced, NUL shown as
`\\x00`.

Results: a clean exit is the tool's result (stdout, and stderr when there is any); anything else
is an error observation (`ToolCallError`, counted in the env's `error_counts` under its kind and
as an env metric of that name): `sandbox_error` (nonzero exit status, e.g. a traceback),
`sandbox_timeout` (wall clock or CPU time), `sandbox_oom` (MemoryError, the address-space
limit, or the call's cgroup memory limit), `sandbox_crash` (killed by a signal, or at the process
cap without cgroups), `sandbox_failure` (the sandbox itself failed; it is
restarted). `sandbox_output_truncated` counts calls whose output was cut. Never an exception in
the env.

`isolation="rlimits"` runs the zygote as a plain process (rlimits and the timeout only: the code
sees the host's files and network) and warns when it starts; when bubblewrap is missing or
cannot make its namespaces, the default refuses to start with `SandboxUnavailable`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Final, Literal

import msgspec

from .typed import Tool, ToolCallError, ToolResult

_HEADER: Final = struct.Struct(">I")
_ZYGOTE_SOURCE: Final = Path(__file__).with_name("sandbox_zygote.py")
_SANDBOX_TMP: Final = "/tmp"
_START_TIMEOUT_S: Final = 30.0
_RUN_HEADROOM_MB: Final = 16  # beyond the interpreter's address space at start, for a call to run
_HOST_GRACE_S: Final = 10.0  # beyond the call's own timeout, before the host gives up on a zygote
_SYSTEM_DIRS: Final = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ROOT_CAPS: Final = ("CAP_SETUID", "CAP_SETGID", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SYS_NICE")
_ZYGOTE_NICE: Final = -10  # without cgroups, as root: the zygote outranks a fork bomb's processes
_CGROUP_ROOT: Final = "/sys/fs/cgroup"
_CGROUP_CONTROLLERS: Final = ("pids", "cpu", "memory")
_CGROUP_INSIDE: Final = "/.cgroup"  # where the zygote's cgroup directories are bound in bubblewrap
_CGROUP_NOTED: list[str] = []  # the one-time note that cgroups are not used, once given
_PRELOAD: Final = (
    "math", "cmath", "decimal", "fractions", "statistics", "random", "itertools", "functools",
    "collections", "operator", "string", "re", "json", "datetime", "heapq", "bisect", "typing",
)  # fmt: skip

TIMEOUT, OOM, CRASH, ERROR, FAILURE = (
    "sandbox_timeout",
    "sandbox_oom",
    "sandbox_crash",
    "sandbox_error",
    "sandbox_failure",
)
TRUNCATED: Final = "sandbox_output_truncated"
_LOST: Final = "the interpreter is gone with its variables; the next call starts a fresh one"
_FRESH: Final = "a fresh interpreter: the variables, imports and functions of earlier calls are gone"


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start (bubblewrap missing, namespaces refused); str() is one line."""


class SandboxConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How calls are isolated and bounded (see the module doc).

        isolation: "bubblewrap" (refuses to start without it) or "rlimits" (no isolation; warns).
        timeout_s: wall clock per call; cpu_s: CPU seconds per process; memory_mb: address space per
        process (at least the interpreter's at start plus 16 MB, checked when the sandbox starts); file_size_mb: largest file a call may write; tmpfs_mb: the sandbox's /tmp (all the
        calls' working directories); open_files; processes (per call: its cgroup's pids.max and its
    uid's RLIMIT_NPROC as root; without cgroups a call is killed when its processes reach it);
        max_output_chars: shown per stream; pool_size: zygotes (each serves calls concurrently);
        python: the interpreter inside ("" = this interpreter's base one); ro_binds: more host paths
        bound read-only at the same place (e.g. a site-packages); sandbox_uid, sandbox_uids: when the
        host process is root, each call runs as a uid `sandbox_uid + n`, n < sandbox_uids (a range no host
        user should own; a session's interpreter holds one for its life)."""

    isolation: Literal["bubblewrap", "rlimits"] = "bubblewrap"
    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_size_mb: int = 16
    tmpfs_mb: int = 64
    open_files: int = 64
    processes: int = 64
    max_output_chars: int = 4000
    pool_size: int = 1
    python: str = ""
    ro_binds: tuple[str, ...] = ()
    sandbox_uid: int = 1_500_000_000
    sandbox_uids: int = 4096

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, int | float) and 0 < self.timeout_s <= 3600):
            raise ValueError(f"timeout_s must be in (0, 3600], got {self.timeout_s!r}")
        for name in (
            "cpu_s",
            "memory_mb",
            "file_size_mb",
            "tmpfs_mb",
            "open_files",
            "processes",
            "pool_size",
            "sandbox_uids",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.open_files < 16:
            raise ValueError(f"open_files must be >= 16 (the interpreter needs a few), got {self.open_files}")
        if self.max_output_chars < 16:
            raise ValueError(f"max_output_chars must be >= 16, got {self.max_output_chars}")
        for path in self.ro_binds:
            if not os.path.isabs(path):
                raise ValueError(f"ro_binds are absolute host paths, got {path!r}")


class SandboxResult(msgspec.Struct, frozen=True):
    """One call's outcome. stdout/stderr: the text shown (capped, marked when cut); exit_code
    (None when killed), signal (the killing signal), timed_out; kind: None for a clean exit, else
    the error kind (module doc); truncated: some output was cut; wall_s: the call's run time."""

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    kind: str | None = None
    truncated: bool = False
    wall_s: float = 0.0
    message: str = ""  # what went wrong, for the error kinds
    started: bool = False  # a session's call that started a fresh interpreter
    note: str = ""  # shown first: a session's interpreter restarted, its earlier state lost

    def observation(self) -> str:
        """What the policy sees: the note, stdout; then stderr and the failure, when there are any."""
        parts = [f"[{self.note}]"] if self.note else []
        parts += [self.stdout] if self.stdout else []
        if self.stderr:
            parts.append(f"[stderr]\n{self.stderr}")
        if self.message:
            parts.append(f"[{self.message}]")
        elif not parts:
            parts.append("[no output]")
        return "\n".join(part.rstrip("\n") for part in parts)


class _Request(msgspec.Struct, omit_defaults=True):
    id: int
    code: str
    session: int | None = None


class _End(msgspec.Struct):
    end: int  # the session whose interpreter to end


class _Reply(msgspec.Struct):
    id: int
    exit_code: int | None
    signal: int | None
    timed_out: bool
    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    stderr_bytes: int
    wall_s: float
    started: bool = False  # the session's interpreter started with this call
    lost: bool = False  # the session's interpreter ended with this call (crash, timeout, ...)
    capped: bool = False  # killed, all its processes, for reaching the process cap (no cgroups)
    oom: bool = False  # a process of it killed by the kernel for its cgroup's memory limit


class _Ready(msgspec.Struct):
    ready: bool
    vm_bytes: int = 0  # the zygote's address space: what every call's process starts with


def _shown(data: bytes, total: int, cap: int) -> tuple[str, bool]:
    """The output as text: invalid UTF-8 replaced, NUL visible, at most `cap` characters."""
    text = data.decode("utf-8", "replace").replace("\x00", "\\x00")
    cut = total > len(data) or len(text) > cap
    if cut:
        text = f"{text[:cap]}\n... [output truncated: {total} bytes in all]"
    return text, cut


def _failure(message: str) -> SandboxResult:
    return SandboxResult("", "", None, kind=FAILURE, message=message)


def _result(reply: _Reply, config: SandboxConfig) -> SandboxResult:
    cap = config.max_output_chars
    stdout, cut_out = _shown(reply.stdout, reply.stdout_bytes, cap)
    stderr, cut_err = _shown(reply.stderr, reply.stderr_bytes, cap)
    kind, message = None, ""
    last_line = stderr.rstrip().rpartition("\n")[2]
    if reply.timed_out:
        kind, message = TIMEOUT, f"killed: timed out after {config.timeout_s:g} s"
    elif reply.oom and reply.exit_code != 0:  # a clean exit is a result, whatever its children met
        kind, message = OOM, f"out of memory (limit {config.memory_mb} MB for the call's processes together)"
    elif reply.capped:
        kind, message = CRASH, f"killed: its processes reached the limit of {config.processes}"
    elif reply.signal == signal.SIGXCPU:
        kind, message = TIMEOUT, f"killed: CPU time limit of {config.cpu_s} s"
    elif last_line.startswith("MemoryError"):
        kind, message = OOM, f"out of memory (limit {config.memory_mb} MB)"
    elif reply.signal is not None:
        kind, message = CRASH, f"killed by signal {reply.signal} ({signal.Signals(reply.signal).name})"
    elif reply.exit_code == 125:
        kind, message = FAILURE, "the sandbox could not set up the call"
    elif reply.exit_code:
        kind, message = ERROR, f"exit status {reply.exit_code}"
    if reply.lost:
        kind = kind or ERROR
        message = f"{message or 'the interpreter exited'}; {_LOST}"
    return SandboxResult(
        stdout,
        stderr,
        reply.exit_code,
        reply.signal,
        reply.timed_out,
        kind,
        cut_out or cut_err,
        reply.wall_s,
        message,
        reply.started,
    )


def _interpreter(config: SandboxConfig) -> str:
    """The interpreter to run inside: the configured one, else this one's base interpreter (a
    venv's python is a link into a tree the sandbox does not hold)."""
    if config.python:
        return config.python
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for name in (f"python{version}", "python3"):
        candidate = Path(sys.base_prefix, "bin", name)
        if candidate.exists():
            return str(candidate.resolve())
    return os.path.realpath(sys.executable)


def bwrap_argv(config: SandboxConfig, python: str | None = None) -> list[str]:
    """The bubblewrap command line (up to the command) the zygote runs under (module doc)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed: install it (apt-get install bubblewrap) or set "
            "isolation='rlimits' to run code without isolation"
        )
    python = python or _interpreter(config)
    argv = [bwrap]
    if os.geteuid() == 0:
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        argv += ["--cap-drop", "ALL", *itertools.chain.from_iterable(("--cap-add", c) for c in _ROOT_CAPS)]
    else:
        argv += ["--unshare-all"]
    argv += ["--die-with-parent", "--new-session", "--as-pid-1", "--clearenv", "--hostname", "sandbox"]
    argv += ["--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8"]
    argv += ["--setenv", "HOME", _SANDBOX_TMP]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    prefixes = {os.path.realpath(sys.base_prefix), str(Path(python).resolve().parent.parent)}
    made: set[str] = set()
    for path in sorted(prefixes | set(config.ro_binds)):
        if not any(path == d or path.startswith(d + "/") for d in _SYSTEM_DIRS if not os.path.islink(d)):
            # Its parents as plain traversable directories (bubblewrap would copy a private
            # /root's mode, and the calls' uid could not reach the prefix).
            for parent in reversed(Path(path).parents[:-1]):
                if str(parent) not in made:
                    made.add(str(parent))
                    argv += ["--perms", "0755", "--dir", str(parent)]
            argv += ["--ro-bind", path, path]
    argv += ["--perms", "0755", "--dir", "/etc", "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--size", str(config.tmpfs_mb * 2**20), "--tmpfs", _SANDBOX_TMP, "--chdir", _SANDBOX_TMP]
    return argv


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path in each cgroup v1 hierarchy, by controller."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as lines:
        for line in lines:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(","):
                if controller:
                    paths[controller] = path
    return paths


def _make_cgroups() -> dict[str, str]:
    """A fresh cgroup directory per controller (pids, cpu, memory, v1) under this process's own,
    for one zygote's calls; {} where they cannot be made (not root, no cgroup v1, read-only),
    with a one-time note (RuntimeWarning) saying so and what the calls lose."""
    own, made = _own_cgroups(), {}
    name = f"toolgym-sandbox-{os.getpid()}-{next(_CGROUP_IDS)}"
    try:
        if os.geteuid() != 0:
            raise OSError("not root")
        for controller in _CGROUP_CONTROLLERS:
            mount = Path(_CGROUP_ROOT, controller)
            if controller not in own or not (mount / "cgroup.procs").exists():
                raise OSError(f"no cgroup v1 {controller} hierarchy at {mount}")
            parent = mount / own[controller].lstrip("/")
            _remove_stale_cgroups(parent)
            path = parent / name
            path.mkdir()
            made[controller] = str(path)
    except OSError as exc:
        _remove_cgroups(made)
        if not _CGROUP_NOTED:
            _CGROUP_NOTED.append(str(exc))
            warnings.warn(
                f"the code sandbox runs without per-call cgroups ({exc}): a call's processes are "
                "bounded by rlimits and its process cap only, and share the CPU with every other "
                "call's; as root with cgroup v1 pids, cpu and memory hierarchies writable under "
                f"{_CGROUP_ROOT}, each call gets its own",
                RuntimeWarning,
                stacklevel=4,
            )
        return {}
    return made


def _remove_stale_cgroups(parent: Path) -> None:
    """Remove the empty cgroup directories left by sandboxes of processes that are gone (killed
    before they could close)."""
    with contextlib.suppress(OSError):
        for path in parent.glob("toolgym-sandbox-*-*"):
            owner = path.name.split("-")[2]
            if owner.isdigit() and not Path("/proc", owner).exists():
                with contextlib.suppress(OSError):
                    for slot in path.glob("call-*"):
                        slot.rmdir()
                    path.rmdir()


def _remove_cgroups(made: Mapping[str, str]) -> None:
    """Remove a zygote's cgroup directories (its slots first), killing what is left in them."""
    for path in made.values():
        root = Path(path)
        slots = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
        for directory in [*slots, root]:
            for _ in range(200):  # processes killed with their PID namespace take a moment to go
                with contextlib.suppress(OSError):
                    for pid in (directory / "cgroup.procs").read_text().split():
                        with contextlib.suppress(OSError):
                            os.kill(int(pid), signal.SIGKILL)
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


_CGROUP_IDS = itertools.count()


class _Zygote:
    """One zygote process, its pending calls, and the thread that reads its replies."""

    def __init__(self, config: SandboxConfig):
        self.config = config
        self.pending: dict[int, concurrent.futures.Future[SandboxResult]] = {}
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.dead = False
        self.workdir: str | None = None
        python = _interpreter(config)
        bubblewrap = config.isolation == "bubblewrap"
        self.cgroups: dict[str, str] = {}
        if bubblewrap:
            prefix, workdir = bwrap_argv(config, python), f"{_SANDBOX_TMP}/calls"
            self.cgroups = _make_cgroups()
            uid = config.sandbox_uid if os.geteuid() == 0 else None
            cgroups = {c: f"{_CGROUP_INSIDE}/{c}" for c in self.cgroups}
            for controller, path in self.cgroups.items():
                prefix += ["--bind", path, cgroups[controller]]
        else:
            prefix, workdir, uid = [], tempfile.mkdtemp(prefix="toolgym-sandbox-"), None
            self.workdir = workdir
            self.cgroups = _make_cgroups()
            cgroups = dict(self.cgroups)
        settings = {
            "timeout_s": config.timeout_s,
            "cpu_s": config.cpu_s,
            "memory_bytes": config.memory_mb * 2**20,
            "file_size_bytes": config.file_size_mb * 2**20,
            "open_files": config.open_files,
            "processes": config.processes,
            "output_bytes": 4 * config.max_output_chars + 4,
            "uid": uid,
            "uids": config.sandbox_uids,
            "workdir": workdir,
            "preload": _PRELOAD,
            "cgroups": cgroups,
            "zygote_nice": _ZYGOTE_NICE if not cgroups and os.geteuid() == 0 else 0,
            "cgroup_limits": [
                ("pids", "pids.max", config.processes),
                ("memory", "memory.limit_in_bytes", config.memory_mb * 2**20),
            ],
        }
        argv = [
            *prefix,
            python,
            "-I",
            "-c",
            _ZYGOTE_SOURCE.read_text(),
            msgspec.json.encode(settings).decode(),
        ]
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 (the zygote's stderr, closed in kill())
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.errors,
                cwd=workdir if not bubblewrap else "/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,
            )
        except OSError as exc:
            _remove_cgroups(self.cgroups)
            raise SandboxUnavailable(f"cannot start the sandbox: {exc}") from None
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        ready, _, _ = select.select([self.stdout], [], [], _START_TIMEOUT_S)
        frame = self._read_frame() if ready else None
        started = msgspec.json.decode(frame, type=_Ready) if frame is not None else None
        if started is None or not started.ready:
            message = self._start_error(bubblewrap)
            self.kill()
            raise SandboxUnavailable(message)
        at_start_mb = -(-started.vm_bytes // 2**20)
        self.min_memory_mb = at_start_mb + _RUN_HEADROOM_MB
        if config.memory_mb < self.min_memory_mb:
            self.kill()
            raise ValueError(
                f"sandbox memory_mb={config.memory_mb} is too small: under the address-space limit a "
                f"call's interpreter needs at least {self.min_memory_mb} MB ({at_start_mb} MB it starts "
                f"with, {_RUN_HEADROOM_MB} MB to run code); set memory_mb >= {self.min_memory_mb}"
            )
        self.reader = threading.Thread(target=self._read_replies, name="toolgym-sandbox-reader", daemon=True)
        self.reader.start()

    def _start_error(self, bubblewrap: bool) -> str:
        self.errors.seek(0)
        lines = [line for line in self.errors.read().decode("utf-8", "replace").splitlines() if line.strip()]
        said = lines[-1].strip() if lines else "it exited without a word"
        if bubblewrap:
            return (
                f"bubblewrap cannot start the sandbox ({said}); allow user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1) or set isolation='rlimits' to run code "
                "without isolation"
            )
        return f"cannot start the sandbox: {said}"

    def _read_frame(self) -> bytes | None:
        header = self.stdout.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack(header)
        data = self.stdout.read(size)
        return data if len(data) == size else None

    def _read_replies(self) -> None:
        decoder = msgspec.json.Decoder(_Reply)
        while (frame := self._read_frame()) is not None:
            reply = decoder.decode(frame)
            with self.lock:
                future = self.pending.pop(reply.id, None)
            if future is not None and not future.done():
                future.set_result(_result(reply, self.config))
        self._died("the sandbox process died during the call")

    def _died(self, message: str) -> None:
        with self.lock:
            self.dead = True
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_result(_failure(message))

    def submit(self, code: str, session: int | None = None) -> concurrent.futures.Future[SandboxResult]:
        """Start a call: in a fresh process, or in session `session`'s interpreter."""
        future: concurrent.futures.Future[SandboxResult] = concurrent.futures.Future()
        with self.lock:
            if self.dead:
                future.set_result(_failure("the sandbox process died"))
                return future
            call_id = next(self.ids)
            self.pending[call_id] = future
            if not self._send(_Request(call_id, code, session)):
                self.pending.pop(call_id, None)
                future.set_result(_failure("the sandbox process died"))
        return future

    def end(self, session: int) -> None:
        """End session `session`'s interpreter (killed with its processes; no reply)."""
        with self.lock:
            if not self.dead:
                self._send(_End(session))

    def _send(self, message: msgspec.Struct) -> bool:
        """Write one message (under the lock); False, and the zygote marked dead, if it cannot."""
        data = msgspec.json.encode(message)
        try:
            self.stdin.write(_HEADER.pack(len(data)) + data)
            self.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.dead = True
            return False
        return True

    @property
    def load(self) -> int:
        return len(self.pending)

    def kill(self) -> None:
        """End the zygote and everything under it (its session; its PID namespace with it)."""
        self.dead = True
        with contextlib.suppress(OSError, ValueError):
            self.stdin.close()
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        reader = getattr(self, "reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=_HOST_GRACE_S)  # it reads to the end of the dead zygote's output
        self.stdout.close()
        self.errors.close()
        _remove_cgroups(self.cgroups)
        self._died("the sandbox was closed")
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


class Sandbox:
    """A pool of `pool_size` warm zygotes under one SandboxConfig; thread-safe; calls concurrent.

    Starting raises SandboxUnavailable (bubblewrap isolation that cannot start), and ValueError
    naming `memory_mb` when it is below what a call's interpreter needs under the address-space
    limit (`min_memory_mb`: the zygote's address space, measured at start, plus 16 MB to run
    code); rlimits-only isolation warns. A zygote that dies (or stops answering) fails its calls with a
    `sandbox_failure` result and is replaced on the next call. `close()` ends every process."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        if self.config.isolation == "rlimits":
            warnings.warn(
                "the code sandbox runs with isolation='rlimits': rlimits and a timeout only; the code "
                "can read the host's files and reach its network",
                RuntimeWarning,
                stacklevel=2,
            )
        self._lock = threading.Lock()
        self._closed = False
        self._session_ids = itertools.count()
        self._zygotes: list[_Zygote] = []
        try:
            for _ in range(self.config.pool_size):
                self._zygotes.append(_Zygote(self.config))
        except BaseException:
            for zygote in self._zygotes:
                zygote.kill()
            raise

    def submit(self, code: str) -> concurrent.futures.Future[SandboxResult]:
        """Start a call; the future's result is its SandboxResult (never an exception)."""
        zygote = self._pick()
        if isinstance(zygote, SandboxResult):
            return _done(zygote)
        return zygote.submit(code)

    def _pick(self, prefer: _Zygote | None = None) -> _Zygote | SandboxResult:
        """The zygote for a call (`prefer` while it lives, else the least loaded), dead ones
        replaced first; a failure result when one cannot restart."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the sandbox is closed")
            for i, zygote in enumerate(self._zygotes):
                if zygote.dead:
                    zygote.kill()
                    try:
                        self._zygotes[i] = _Zygote(self.config)
                    except (SandboxUnavailable, ValueError) as exc:
                        return _failure(f"the sandbox cannot restart: {exc}")
            if prefer is not None and prefer in self._zygotes:
                return prefer
            return min(self._zygotes, key=lambda z: z.load)

    def session(self) -> SandboxSession:
        """A persistent interpreter in this sandbox (see SandboxSession); started by its first call."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the sandbox is closed")
            return SandboxSession(self, next(self._session_ids))

    def _gave_up(self, future: concurrent.futures.Future[SandboxResult]) -> SandboxResult:
        """A call the zygote did not answer in time: the zygote is stuck; replace it."""
        with self._lock:
            for zygote in self._zygotes:
                if future in zygote.pending.values():
                    zygote.kill()
        return _failure("the sandbox stopped answering")

    def run(self, code: str) -> SandboxResult:
        """Run `code` in a fresh sandboxed process; blocks the calling thread."""
        return self._wait(self.submit(code))

    def _wait(self, future: concurrent.futures.Future[SandboxResult]) -> SandboxResult:
        try:
            return future.result(timeout=self.config.timeout_s + _HOST_GRACE_S)
        except concurrent.futures.TimeoutError:
            return self._gave_up(future)

    async def arun(self, code: str) -> SandboxResult:
        """`run`, awaitable from any event loop."""
        future = self.submit(code)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.config.timeout_s + _HOST_GRACE_S)
        except TimeoutError:
            return self._gave_up(future)

    @property
    def min_memory_mb(self) -> int:
        """The least `memory_mb` a call can run under (measured when the pool started)."""
        return max(z.min_memory_mb for z in self._zygotes)

    @property
    def cgroups(self) -> list[dict[str, str]]:
        """Per zygote, its calls' cgroup directories on the host by controller (pids, cpu,
        memory; each call a `call-<n>` slot in them); {} where cgroups are not used."""
        return [dict(z.cgroups) for z in self._zygotes if not z.dead]

    @property
    def pids(self) -> list[int]:
        """The zygotes' host process ids (bubblewrap's, or the zygote's own)."""
        return [z.proc.pid for z in self._zygotes if not z.dead]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for zygote in self._zygotes:
                zygote.kill()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _done(result: SandboxResult) -> concurrent.futures.Future[SandboxResult]:
    future: concurrent.futures.Future[SandboxResult] = concurrent.futures.Future()
    future.set_result(result)
    return future


def _end_session(where: list[_Zygote | None], session: int) -> None:
    zygote, where[0] = where[0], None
    if zygote is not None:
        zygote.end(session)


class SandboxSession:
    """A persistent interpreter in a Sandbox, as in a notebook (`Sandbox.session()`): the
    variables, imports and functions one call defines are there for the next call of the same
    session, and no other session sees them.

    The interpreter is a process of its own, forked from a zygote as a call's process is (the same
    isolation, its own uid as root) and started by the session's first call; every call in it
    keeps the per-call limits (wall clock, memory, output caps, processes; CPU seconds per call)
    and whatever processes a call leaves are killed when it ends. A call that kills the
    interpreter (a timeout, a crash, os._exit) is an error saying the state is gone; the next
    call starts a fresh interpreter and its result says so (`note`). Calls in one session run one
    at a time. `reset()` ends the interpreter (the next call starts a fresh one, with no note);
    `close()` ends it for good; a session that is garbage collected ends its interpreter too."""

    def __init__(self, sandbox: Sandbox, session_id: int):
        self.sandbox = sandbox
        self.id = session_id
        self._lock = threading.Lock()
        self._where: list[_Zygote | None] = [None]  # the zygote holding the interpreter
        self._calls = 0  # calls run in the current interpreter
        self._closed = False
        self._finalizer = weakref.finalize(self, _end_session, self._where, session_id)

    def run(self, code: str) -> SandboxResult:
        """Run `code` in the session's interpreter; blocks the calling thread."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the sandbox session is closed")
            zygote = self.sandbox._pick(self._where[0])
            if isinstance(zygote, SandboxResult):
                return zygote
            self._where[0] = zygote
            result = self.sandbox._wait(zygote.submit(code, self.id))
            if result.started:
                if self._calls:
                    result = msgspec.structs.replace(result, note=_FRESH)
                self._calls = 0
            self._calls += 1
            return result

    def reset(self) -> None:
        """End the interpreter and its state; the next call starts a fresh one."""
        with self._lock:
            _end_session(self._where, self.id)
            self._calls = 0

    def close(self) -> None:
        """End the interpreter; the session takes no more calls."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SHARED: dict[tuple[int, SandboxConfig], Sandbox] = {}
_SHARED_LOCK = threading.Lock()


def sandbox_config(value: SandboxConfig | Mapping[str, object] | None) -> SandboxConfig:
    """An env's `sandbox` knob as a SandboxConfig: one already, None (the defaults), or a mapping
    of its fields (a TOML table); ValueError naming the field for a mapping that does not fit."""
    if isinstance(value, SandboxConfig) or value is None:
        return value or SandboxConfig()
    try:
        return msgspec.convert(dict(value), SandboxConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"sandbox: {exc}") from None


def shared_sandbox(config: SandboxConfig | None = None) -> Sandbox:
    """The process's one Sandbox for `config` (started on first use, closed at exit), so every
    env made with the same config shares one warm pool."""
    config = config or SandboxConfig()
    key = (os.getpid(), config)  # a forked process starts its own
    with _SHARED_LOCK:
        sandbox = _SHARED.get(key)
        if sandbox is None or sandbox._closed:
            sandbox = _SHARED[key] = Sandbox(config)
        return sandbox


@atexit.register
def _close_shared() -> None:
    for (pid, _), sandbox in list(_SHARED.items()):
        if pid == os.getpid():
            sandbox.close()


def python_tool(
    config: SandboxConfig | None = None, *, name: str = "python", persistent: bool = False
) -> Tool:
    """The `python(code)` tool over the shared sandbox for `config` (started now, so a missing
    bubblewrap is refused when the env is made). A clean exit is the result; every other outcome
    a ToolCallError of its kind (module doc); both carry the kinds as metrics.

    persistent: each call runs in the episode's own interpreter (a SandboxSession), as in a
    notebook: what one call defines, the next call of the episode sees. A ToolEnv makes its own
    copy of the tool (`Tool.per_env`) and ends the interpreter when an episode ends, at reset and
    at close (`Tool.end_episode`), so no two episodes, concurrent or not, share state."""
    sandbox = shared_sandbox(config)
    timeout_s = sandbox.config.timeout_s + 2 * _HOST_GRACE_S

    def result(outcome: SandboxResult) -> ToolResult:
        metrics = {TRUNCATED: 1.0} if outcome.truncated else {}
        if outcome.kind is not None:
            raise ToolCallError(outcome.kind, outcome.observation(), {**metrics, outcome.kind: 1.0})
        return ToolResult(outcome.observation(), metrics=metrics)

    if not persistent:

        def python(code: str) -> ToolResult:
            """Run Python code in a fresh sandboxed process and see what it prints (use print()).

            Args:
                code: a Python program; its stdout (and stderr) is the result.
            """
            return result(sandbox.run(code))

        return Tool.from_function(python, name=name, timeout_s=timeout_s, waits=True)

    session = sandbox.session()

    def python_session(code: str) -> ToolResult:
        """Run Python code in your sandboxed interpreter and see what it prints (use print());
        variables, imports and functions stay for your next calls.

        Args:
            code: Python code; its stdout (and stderr) is the result.
        """
        return result(session.run(code))

    return Tool.from_function(
        python_session,
        name=name,
        timeout_s=timeout_s,
        waits=True,
        per_env=lambda: python_tool(config, name=name, persistent=True),
        end_episode=session.reset,
    )
