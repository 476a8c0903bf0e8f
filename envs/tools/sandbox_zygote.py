"""The sandbox's zygote: a Python process, started once, that forks one bounded child per call.

Runs INSIDE the sandbox (bubblewrap, or a plain process in the rlimits-only mode), started by
envs/tools/sandbox.py as `python -I -c <this file's source> <settings JSON>`; stdlib only (the
sandbox holds only the interpreter's own prefix). Imports nothing from toolgym.

Protocol on stdin/stdout, each message a 4-byte big-endian length then a JSON object:
    in:  {"id": int, "code": str, "session": int (optional)}, or {"end": session id}
    out: {"id": int, "exit_code": int | null, "signal": int | null, "timed_out": bool,
          "stdout": base64, "stderr": base64, "stdout_bytes": int, "stderr_bytes": int,
          "wall_s": float, "started": bool, "lost": bool}
    first out: {"ready": true, "vm_bytes": int} once the zygote is up (the host waits for it
    before any call); vm_bytes: its address space, which every call's process starts with.
The zygote serves calls concurrently (one selector loop, no threads, so forking is safe). A
child: its own process group and, when the host gave it cgroup directories, a cgroup slot of
its own (pids, cpu, memory: `_Cgroups`); drops to `uid + offset` when a uid is set (the zygote runs as
root; the offset is the next of `uids` not in use); rlimits (CPU seconds, address space, file
size, open files, processes, no core files); a fresh working directory; stdout/stderr to pipes
the zygote reads (at most `output_bytes` kept per stream, the rest counted and discarded); the
code run as `__main__`. The zygote kills the child's process group at the wall-clock deadline and
once the child has exited (its leftovers), and, as PID 1 of its own PID namespace (bubblewrap),
sweeps every other process but the sessions' kernels when no call is running. Without cgroups
it counts each call's processes every `_POLICE_S` and kills a call whose processes reach the cap
(`Zygote.police`; as root it runs at `zygote_nice`, calls at 0). It exits when stdin closes,
killing what is left.

A call with a `session` runs in that session's kernel: a child forked and isolated as a call's
(its own uid and working directory), started by the session's first call (`started`), that runs
each code it is sent in one namespace and stays for the next call; only the kernel goes on after
a call (a process the code forked exits where the code ends). Per call: the wall-clock deadline
(it kills the kernel), the output caps, CPU seconds (a soft limit moved on before each call), and
the processes the call left in the kernel's group killed when it ends. A kernel that dies (a
timeout, a crash, `{"end"}`) ends its call with `lost`; the session's next call starts a new one.
"""

import base64
import contextlib
import fcntl
import json
import os
import resource
import selectors
import shutil
import signal
import struct
import sys
import time
import traceback

_HEADER = struct.Struct(">I")
_CHUNK = 65536
_POLICE_S = 0.05  # without cgroups: how often the calls' processes are counted (Zygote.police)
_STREAMS = []  # stdin, stdout, stderr over fds 0-2, made once by the zygote (see main)


def _streams():
    """Text streams over fds 0-2 (never closed: the process ends with them)."""
    return [
        open(0, encoding="utf-8", closefd=False),
        open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False),
        open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False),
    ]


def _isolate(settings, uid_offset, name, out_w, err_w, keep=(), cgroup=None):
    """In a forked child: its own process group, its cgroup slot `cgroup` (when the zygote has
    cgroups; every process it forks stays in it), stdin from /dev/null, stdout/stderr to the given
    pipes, the fds in `keep` moved to 3, 4, ... and every other fd closed, the call's uid (as
    root), a fresh working directory `name`, and the rlimits (CPU seconds left out: the caller
    sets them). Raises on failure (the caller exits 125)."""
    os.setpgid(0, 0)
    if cgroup is not None:
        for root in settings["cgroups"].values():
            fd = os.open(f"{root}/{cgroup}/cgroup.procs", os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in keep]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for i, fd in enumerate(moved):
        os.dup2(fd, 3 + i)
    os.closerange(3 + len(keep), 65536)
    if settings["zygote_nice"]:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    if settings["uid"] is not None:  # as root: a uid of the call's own among `uids` (no groups: main)
        uid = settings["uid"] + uid_offset
        os.setgid(uid)
        os.setuid(uid)
    workdir = os.path.join(settings["workdir"], name)
    os.mkdir(workdir, 0o700)
    os.chdir(workdir)
    os.environ["HOME"] = workdir
    os.environ["TMPDIR"] = workdir
    for which, value in settings["limits"]:
        resource.setrlimit(which, (value, value))
    # The call's streams over its fds 0-2: the zygote's unused ones (nothing buffered), so that a
    # call does not build them (allocating in a forked child costs copy-on-write faults).
    sys.stdin, sys.stdout, sys.stderr = _STREAMS or _streams()


def _execute(code, namespace):
    """Run `code` in `namespace` as `__main__`; its exit status (a traceback on stderr is 1)."""
    status = 0
    try:
        exec(compile(code, "<code>", "exec"), namespace)
    except SystemExit as exit_:
        if exit_.code is None:
            status = 0
        elif isinstance(exit_.code, int):
            status = exit_.code & 0xFF
        else:
            print(exit_.code, file=sys.stderr)
            status = 1
    except BaseException as error:
        with contextlib.suppress(BaseException):  # the traceback from the code's own frames on
            traceback.print_exception(type(error), error, error.__traceback__ and error.__traceback__.tb_next)
        status = 1
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(BaseException):
            if stream is not None:
                stream.flush()
    return status


def _child(call_id, uid_offset, cgroup, code, settings, out_w, err_w):
    """In the forked child: isolate, limit, run `code`, exit. Never returns."""
    try:
        _isolate(settings, uid_offset, f"call-{call_id}", out_w, err_w, cgroup=cgroup)
        # SIGXCPU at the soft limit (reported as a timeout); SIGKILL a second later for code that
        # ignores it. Equal limits would make the kernel send SIGKILL alone, read as a crash.
        resource.setrlimit(resource.RLIMIT_CPU, (settings["cpu_s"], settings["cpu_s"] + 1))
    except BaseException:
        os._exit(125)
    os._exit(_execute(code, {"__name__": "__main__", "__builtins__": __builtins__}))


def _vm_bytes():
    """This process's address space (VmSize), which a forked call starts with; 0 if unknown."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _read_exactly(fd, size):
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _kernel(name, uid_offset, cgroup, settings, ctl_r, status_w, out_w, err_w):
    """A session's interpreter, in the forked child: isolated as a call is, then runs each code it
    is sent (fd 3: a 4-byte length and the code) in one namespace, and writes each call's exit
    status as a line on fd 4. CPU seconds: a soft limit moved on by `cpu_s` before each call (the
    wall clock bounds a call that ignores SIGXCPU). Exits when fd 3 closes. Never returns."""
    try:
        _isolate(settings, uid_offset, name, out_w, err_w, keep=(ctl_r, status_w), cgroup=cgroup)
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        limit, usage, read, write = resource.setrlimit, resource.getrusage, _read_exactly, os.write
        cpu, self_ = resource.RLIMIT_CPU, resource.RUSAGE_SELF
        me = os.getpid()
    except BaseException:
        os._exit(125)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    while True:
        header = read(3, _HEADER.size)
        code = read(3, _HEADER.unpack(header)[0]) if header is not None else None
        if code is None:
            os._exit(0)
        with contextlib.suppress(ChildProcessError):  # the last call's children, killed by the zygote
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        used = usage(self_)
        soft = int(used.ru_utime + used.ru_stime) + 1 + settings["cpu_s"]
        limit(cpu, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        status = _execute(code.decode("utf-8", "replace"), namespace)
        if os.getpid() != me:  # a process the code forked ran to the end: it is no interpreter
            os._exit(status)
        write(4, b"%d\n" % status)


class _Cgroups:
    """Per-call cgroups (v1): a slot is a directory `call-<n>` under each controller's directory
    the host made for this zygote (`settings["cgroups"]`: controller -> directory), with the
    per-call limits (`settings["cgroup_limits"]`: controller, file, value) written when it is
    made. A call's process joins its slot before its code runs, so everything it forks is counted
    (pids.max), scheduled (cpu: each call one share, however many processes it runs) and charged
    (memory) as one, and is found by `kill` even when it left the call's process group. A slot is
    reused only once empty; one with processes left is killed again each round (`drain`)."""

    def __init__(self, roots, limits):
        self.roots = roots
        self.limits = limits
        self.procs = next(iter(roots.values()))  # any hierarchy lists the slot's processes
        self.free = []
        self.draining = []
        self.made = 0
        self.ooms = {}  # slot -> its oom_kill count when taken

    def take(self):
        """A free slot (made when none is); None if one cannot be made (the call runs without)."""
        if self.free:
            name = self.free.pop()
        else:
            name = f"call-{self.made}"
            self.made += 1
            try:
                for controller, root in self.roots.items():
                    os.makedirs(f"{root}/{name}", exist_ok=True)
                    for which, filename, value in self.limits:
                        if which == controller:
                            with open(f"{root}/{name}/{filename}", "w") as limit:
                                limit.write(str(value))
            except OSError:
                return None
        self.ooms[name] = self.oom_kills(name)
        return name

    def oom_kills(self, name):
        """How many processes the kernel has killed in slot `name` for its memory limit."""
        if name is None or "memory" not in self.roots:
            return 0
        try:
            with open(f"{self.roots['memory']}/{name}/memory.oom_control", "rb") as control:
                for line in control:
                    if line.startswith(b"oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def out_of_memory(self, name):
        """Whether the kernel killed a process of slot `name` for its memory limit since it was taken."""
        return name is not None and self.oom_kills(name) > self.ooms.get(name, 0)

    def kill(self, name):
        """SIGKILL every process in slot `name`; True if it was empty."""
        try:
            with open(f"{self.procs}/{name}/cgroup.procs", "rb") as procs:
                pids = procs.read().split()
        except OSError:
            return True
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
        return not pids

    def release(self, name):
        """The slot's call ended: kill what is left in it; free it once empty."""
        if name is None:
            return
        if self.kill(name):
            self.free.append(name)
        else:
            self.draining.append(name)

    def drain(self):
        for name in list(self.draining):
            if self.kill(name):
                self.draining.remove(name)
                self.free.append(name)


class _Call:
    __slots__ = (
        "capped", "cgroup", "deadline", "id", "oom", "open", "out", "pid", "pidfd", "session",
        "sizes", "started", "status", "timed_out", "uid_offset",
    )  # fmt: skip

    def __init__(self, call_id, pid, pidfd, deadline, session=None):
        self.id, self.pid, self.pidfd, self.deadline = call_id, pid, pidfd, deadline
        self.session = session
        self.uid_offset = None
        self.cgroup: str | None = None
        self.started = time.monotonic()
        self.out = {1: bytearray(), 2: bytearray()}
        self.sizes = {1: 0, 2: 0}
        self.open = 2
        self.status: int | None = None  # a wait status
        self.timed_out = False
        self.capped = False  # killed for reaching the process cap (no cgroups: Zygote.police)
        self.oom = False  # a process of it killed for the memory limit of its cgroup slot


class _Session:
    """A persistent interpreter (a kernel): its process, its pipes, and the call it is running."""

    __slots__ = (
        "call", "cgroup", "ctl", "fresh", "id", "pending", "pid", "pidfd", "status_buffer", "uid_offset",
        "workdir",
    )  # fmt: skip

    def __init__(self, session_id, pid, pidfd, ctl, uid_offset, workdir, cgroup=None):
        self.id, self.pid, self.pidfd, self.ctl, self.uid_offset = session_id, pid, pidfd, ctl, uid_offset
        self.workdir = workdir
        self.cgroup = cgroup
        self.call: _Call | None = None
        self.fresh = True  # no call has run in it yet
        self.pending = bytearray()  # code not yet written to its control pipe
        self.status_buffer = bytearray()


class Zygote:
    def __init__(self, settings):
        self.settings = settings
        # The protocol moves to high fds; 0 and 1 point at /dev/null so nothing else writes there.
        self.inp = os.dup(0)
        self.outp = os.dup(1)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.set_blocking(self.inp, False)
        self.buffer = bytearray()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.inp, selectors.EVENT_READ, ("stdin", None))
        self.calls = {}
        self.sessions = {}  # session id -> _Session
        self.kernels = {}  # kernel pid -> _Session
        self.statuses = {}
        self.uids_in_use = set()
        self.next_uid = 0
        self.kernels_started = 0
        self.pid1 = os.getpid() == 1
        self.cgroups = (
            _Cgroups(settings["cgroups"], settings["cgroup_limits"]) if settings["cgroups"] else None
        )
        self.policed = 0.0  # when police() last looked
        os.makedirs(settings["workdir"], exist_ok=True)
        os.chmod(settings["workdir"], 0o1777)

    def send(self, message):
        data = json.dumps(message).encode()
        view = memoryview(_HEADER.pack(len(data)) + data)
        while view:
            view = view[os.write(self.outp, view) :]

    def take_uid(self):
        """The next uid offset not in use (round robin, so a uid is reused as late as possible)."""
        uids = self.settings["uids"]
        for _ in range(uids):
            offset = self.next_uid % uids
            self.next_uid += 1
            if offset not in self.uids_in_use:
                self.uids_in_use.add(offset)
                return offset
        return self.next_uid % uids  # every uid is in use: share one

    def start(self, call_id, code):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        uid_offset = self.take_uid()
        cgroup = self.cgroups.take() if self.cgroups else None
        pid = os.fork()
        if pid == 0:
            _child(call_id, uid_offset, cgroup, code, self.settings, out_w, err_w)
        os.close(out_w)
        os.close(err_w)
        call = _Call(call_id, pid, os.pidfd_open(pid), time.monotonic() + self.settings["timeout_s"])
        call.uid_offset = uid_offset
        call.cgroup = cgroup
        self.calls[pid] = call
        self.watch_output(out_r, err_r, call)
        self.selector.register(call.pidfd, selectors.EVENT_READ, ("exit", call))

    def watch_output(self, out_r, err_r, owner):
        for fd, stream in ((out_r, 1), (err_r, 2)):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, ("pipe", (owner, stream)))

    # ---- sessions: a persistent interpreter per session id ----------------------------------

    def start_kernel(self, session_id):
        ctl_r, ctl_w = os.pipe()
        status_r, status_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        uid_offset = self.take_uid()
        # Named per kernel: a session's next kernel may start before this one is gone.
        workdir = f"kernel-{self.kernels_started}"
        self.kernels_started += 1
        cgroup = self.cgroups.take() if self.cgroups else None
        pid = os.fork()
        if pid == 0:
            _kernel(workdir, uid_offset, cgroup, self.settings, ctl_r, status_w, out_w, err_w)
        for fd in (ctl_r, status_w, out_w, err_w):
            os.close(fd)
        os.set_blocking(ctl_w, False)
        os.set_blocking(status_r, False)
        session = _Session(session_id, pid, os.pidfd_open(pid), ctl_w, uid_offset, workdir, cgroup)
        self.sessions[session_id] = self.kernels[pid] = session
        self.watch_output(out_r, err_r, session)
        self.selector.register(status_r, selectors.EVENT_READ, ("status", session))
        self.selector.register(session.pidfd, selectors.EVENT_READ, ("kexit", session))
        return session

    def start_in_session(self, call_id, code, session_id):
        session = self.sessions.get(session_id)
        if session is None:
            session = self.start_kernel(session_id)
        call = _Call(call_id, session.pid, None, time.monotonic() + self.settings["timeout_s"], session)
        if session.call is not None:  # one call at a time in an interpreter (the host serializes)
            call.status = 125 << 8
            self.reply(call, started=False, lost=False)
            return
        session.call = call
        self.calls[session.pid] = call
        data = code.encode("utf-8", "surrogateescape")
        session.pending += _HEADER.pack(len(data)) + data
        self.write_code(session)

    def write_code(self, session):
        """As much of the pending code as the kernel's control pipe takes now; the rest when it is
        writable (a kernel that stops reading cannot block the zygote)."""
        try:
            written = os.write(session.ctl, session.pending)
        except BlockingIOError:
            written = 0
        except OSError:  # the kernel is gone; its exit event ends the call
            written = len(session.pending)
        del session.pending[:written]
        registered = session.ctl in self.selector.get_map()
        if session.pending and not registered:
            self.selector.register(session.ctl, selectors.EVENT_WRITE, ("ctl", session))
        elif not session.pending and registered:
            self.selector.unregister(session.ctl)

    def read_status(self, fd, session):
        """The kernel's status lines: one per finished call; anything else ends the kernel."""
        try:
            chunk = os.read(fd, 64)
        except BlockingIOError:
            return
        if not chunk:
            self.end_session(session)
            return
        session.status_buffer += chunk
        while b"\n" in session.status_buffer:
            line, _, rest = bytes(session.status_buffer).partition(b"\n")
            session.status_buffer[:] = rest
            call = session.call
            if call is None or call.timed_out or not line.isdigit() or int(line) > 255:
                self.end_session(session)
                return
            call.status = int(line) << 8
            self.call_done(session, call)
        if len(session.status_buffer) > 16:
            self.end_session(session)

    def call_done(self, session, call):
        """A session's call finished and its interpreter lives on: its output so far, its
        leftover processes killed, the reply."""
        for key in list(self.selector.get_map().values()):
            kind, payload = key.data
            if kind == "pipe" and payload[0] is session:
                self.read_pipe(key.fd, *payload)
        self.kill_leftovers(session)
        session.call = None
        del self.calls[session.pid]
        started, session.fresh = session.fresh, False
        self.reply(call, started=started, lost=False)

    def kill_leftovers(self, session):
        """Kill every process in the kernel's process group but the kernel (what the call left)."""
        for _ in range(100):
            found = False
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) == session.pid:
                    continue
                try:
                    with open(f"/proc/{name}/stat", "rb") as stat:
                        fields = stat.read().rpartition(b")")[2].split()
                except OSError:
                    continue
                if int(fields[2]) == session.pid and fields[0] != b"Z":
                    found = True
                    with contextlib.suppress(OSError):
                        os.kill(int(name), signal.SIGKILL)
            if not found:
                return
            self.reap()

    def end_session(self, session):
        """Kill a kernel and its process group; its exit event cleans up (kernel_exited). The
        session's next call starts a new kernel."""
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
        for target in (
            lambda: os.killpg(session.pid, signal.SIGKILL),
            lambda: os.kill(session.pid, signal.SIGKILL),
        ):
            with contextlib.suppress(OSError):
                target()

    def kernel_exited(self, session):
        """The kernel is gone (killed, crashed, timed out or ended): its call, if any, ends with
        the interpreter lost; its pipes, directory and uid are released."""
        self.selector.unregister(session.pidfd)
        os.close(session.pidfd)
        if session.pid not in self.statuses:
            with contextlib.suppress(ChildProcessError):
                self.statuses[session.pid] = os.waitpid(session.pid, 0)[1]
        status = self.statuses.pop(session.pid, 0)
        self.end_session(session)  # what it left behind in its group
        call = session.call
        if call is not None and self.cgroups is not None:
            call.oom = self.cgroups.out_of_memory(session.cgroup)
        for key in list(self.selector.get_map().values()):
            kind, payload = key.data
            mine = (kind == "pipe" and payload[0] is session) or (
                kind in ("status", "ctl") and payload is session
            )
            if mine:
                if kind == "pipe" and call is not None:
                    self.read_pipe(key.fd, *payload)
                if key.fd in self.selector.get_map():
                    self.selector.unregister(key.fd)
                    os.close(key.fd)
        with contextlib.suppress(OSError):
            os.close(session.ctl)
        del self.kernels[session.pid]
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
        self.uids_in_use.discard(session.uid_offset)
        if self.cgroups:
            self.cgroups.release(session.cgroup)
        shutil.rmtree(os.path.join(self.settings["workdir"], session.workdir), ignore_errors=True)
        if call is not None:
            session.call = None
            del self.calls[session.pid]
            call.status = status
            self.reply(call, started=session.fresh, lost=True)
        elif not self.calls and self.pid1:
            self.sweep()

    # ---- calls -------------------------------------------------------------------------------

    def read_pipe(self, fd, owner, stream):
        """Read what is in a call's (or a session's) output pipe; a session's output between
        calls is dropped."""
        cap = self.settings["output_bytes"]
        while True:
            try:
                chunk = os.read(fd, _CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                self.selector.unregister(fd)
                os.close(fd)
                if isinstance(owner, _Call):
                    owner.open -= 1
                return
            call = owner if isinstance(owner, _Call) else owner.call
            if call is None:
                continue
            call.sizes[stream] += len(chunk)
            kept = call.out[stream]
            if len(kept) < cap:
                kept += chunk[: cap - len(kept)]

    def kill_group(self, call):
        for target in (
            lambda: os.killpg(call.pid, signal.SIGKILL),
            lambda: os.kill(call.pid, signal.SIGKILL),
        ):
            with contextlib.suppress(OSError):
                target()
        cgroup = call.cgroup if call.session is None else call.session.cgroup
        if self.cgroups and cgroup is not None:
            self.cgroups.kill(cgroup)  # what left the group (setsid) is still in the cgroup

    def reap(self):
        """Collect every exited child (orphans too, as PID 1), keeping our calls' and kernels'
        statuses."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.calls or pid in self.kernels:
                self.statuses[pid] = status

    def exited(self, call):
        self.selector.unregister(call.pidfd)
        os.close(call.pidfd)
        if call.pid not in self.statuses:
            _, self.statuses[call.pid] = os.waitpid(call.pid, 0)
        call.status = self.statuses.pop(call.pid)
        self.kill_group(call)  # what it left behind in its group
        call.oom = self.cgroups is not None and self.cgroups.out_of_memory(call.cgroup)
        # Drain what is already in the pipes; a writer left behind (escaped its group) is not waited for.
        for key in list(self.selector.get_map().values()):
            kind, payload = key.data
            if kind == "pipe" and payload[0] is call:
                self.read_pipe(key.fd, *payload)
                if key.fd in self.selector.get_map():
                    self.selector.unregister(key.fd)
                    os.close(key.fd)
        del self.calls[call.pid]
        self.reply(call)
        # After the reply, before the next request is read: the call's directory and uid, and as
        # PID 1 with no call running, every leftover.
        shutil.rmtree(os.path.join(self.settings["workdir"], f"call-{call.id}"), ignore_errors=True)
        self.uids_in_use.discard(call.uid_offset)
        if self.cgroups:
            self.cgroups.release(call.cgroup)
        if not self.calls and self.pid1:
            self.sweep()

    def reply(self, call, started=False, lost=False):
        """Reply for an ended call."""
        status = call.status
        self.send(
            {
                "id": call.id,
                "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                "timed_out": call.timed_out,
                "capped": call.capped,
                "oom": call.oom,
                "stdout": base64.b64encode(bytes(call.out[1])).decode(),
                "stderr": base64.b64encode(bytes(call.out[2])).decode(),
                "stdout_bytes": call.sizes[1],
                "stderr_bytes": call.sizes[2],
                "wall_s": time.monotonic() - call.started,
                "started": started,
                "lost": lost,
            }
        )

    def police(self):
        """Without cgroups: a call whose processes reach the process cap is killed at once, all of
        them (so a fork bomb neither takes the CPU from the other calls until its timeout nor
        keeps the cap's worth of processes spinning). Its processes are counted by uid as root
        (each call has its own: a helper of that uid kills them all with kill(-1), which no fork
        can outrun), killed at the cap less one; otherwise by process group, killed at half the
        cap (the calls share the uid and its cap). Looks only when the namespace holds that many."""
        base = self.settings["uid"]
        cap = self.settings["processes"] - 1 if base is not None else max(2, self.settings["processes"] // 2)
        names = [name for name in os.listdir("/proc") if name.isdigit()]
        if len(names) < cap:
            return
        owners = {}
        for call in self.calls.values():
            if not (call.timed_out or call.capped):
                holder = call if call.session is None else call.session
                owners[call.pid if base is None else base + holder.uid_offset] = call
        counts = {}
        for name in names:
            try:
                if base is not None:
                    key = os.stat(f"/proc/{name}").st_uid
                else:
                    with open(f"/proc/{name}/stat", "rb") as stat:
                        key = int(stat.read().rpartition(b")")[2].split()[2])
            except (OSError, ValueError, IndexError):
                continue
            if key in owners:
                counts[key] = counts.get(key, 0) + 1
        for key, count in counts.items():
            if count >= cap:
                call = owners[key]
                call.capped = True
                if base is not None:
                    self.kill_uid(key)
                self.kill_group(call)

    def kill_uid(self, uid):
        """Every process of `uid`, killed at once: by a helper of that uid, with kill(-1)."""
        pid = os.fork()
        if pid == 0:
            try:
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)

    def sweep(self):
        """As PID 1 with no call running: kill every other process in the namespace but the
        sessions' kernels."""
        if not self.kernels:
            with contextlib.suppress(OSError):
                os.kill(-1, signal.SIGKILL)
        else:
            for name in os.listdir("/proc"):
                if name.isdigit() and int(name) != 1 and int(name) not in self.kernels:
                    with contextlib.suppress(OSError):
                        os.kill(int(name), signal.SIGKILL)
        self.reap()

    def read_requests(self):
        while True:
            try:
                chunk = os.read(self.inp, _CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                return False
            self.buffer += chunk
        while len(self.buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buffer)
            if len(self.buffer) < _HEADER.size + size:
                break
            request = json.loads(bytes(self.buffer[_HEADER.size : _HEADER.size + size]))
            del self.buffer[: _HEADER.size + size]
            if "end" in request:
                session = self.sessions.get(request["end"])
                if session is not None:
                    self.end_session(session)
            elif request.get("session") is not None:
                self.start_in_session(request["id"], request["code"], request["session"])
            else:
                self.start(request["id"], request["code"])
        return True

    def run(self):
        self.send({"ready": True, "vm_bytes": _vm_bytes()})
        while True:
            now = time.monotonic()
            deadlines = [c.deadline for c in self.calls.values() if not c.timed_out]
            wait = max(0.0, min(deadlines) - now) if deadlines else None
            timeout = wait if wait is None else min(wait, 1.0)
            draining = self.cgroups is not None and self.cgroups.draining
            if draining:  # slots with processes left: killed again every _POLICE_S
                timeout = _POLICE_S if timeout is None else min(timeout, _POLICE_S)
            if self.cgroups is None and self.calls:  # the process cap, looked at every _POLICE_S
                next_look = self.policed + _POLICE_S - now
                timeout = max(0.0, min(_POLICE_S if timeout is None else timeout, next_look))
            events = self.selector.select(timeout)
            self.reap()
            if draining and self.cgroups is not None:
                self.cgroups.drain()
            for key, _ in events:
                kind, payload = key.data
                if self.selector.get_map().get(key.fd) is not key:
                    continue  # closed (or its number reused) by an earlier event of this round
                if kind == "stdin":
                    if not self.read_requests():
                        return
                elif kind == "pipe":
                    self.read_pipe(key.fd, *payload)
                elif kind == "exit" and payload.pid in self.calls and payload.status is None:
                    self.exited(payload)
                elif kind == "status":
                    self.read_status(key.fd, payload)
                elif kind == "ctl":
                    self.write_code(payload)
                elif kind == "kexit" and self.kernels.get(payload.pid) is payload:
                    self.kernel_exited(payload)
            now = time.monotonic()
            if self.cgroups is None and self.calls and now >= self.policed + _POLICE_S:
                self.policed = now
                self.police()
            for call in list(self.calls.values()):
                if not call.timed_out and now >= call.deadline:
                    call.timed_out = True
                    self.kill_group(call)  # a session's kernel with it: its exit ends the call

    def close(self):
        for call in list(self.calls.values()):
            self.kill_group(call)
        for session in list(self.sessions.values()):
            self.end_session(session)
        if self.pid1:
            self.sweep()


def main():
    settings = json.loads(sys.argv[1])
    for name in settings["preload"]:  # imported once here, so a call's `import` costs nothing
        with contextlib.suppress(ImportError):
            __import__(name)
    settings["limits"] = [  # set in each call's process (CPU seconds apart: per process or per call)
        (resource.RLIMIT_AS, settings["memory_bytes"]),
        (resource.RLIMIT_FSIZE, settings["file_size_bytes"]),
        (resource.RLIMIT_NOFILE, settings["open_files"]),
        (resource.RLIMIT_NPROC, settings["processes"]),
        (resource.RLIMIT_CORE, 0),
    ]
    # Inherited by every call: a write past the file-size limit raises instead of killing; no
    # supplementary groups (as root, before a call drops to its uid).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if settings["uid"] is not None:
        os.setgroups([])
    if settings["zygote_nice"]:  # a call's process goes back to 0 (_isolate)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, settings["zygote_nice"])
    zygote = Zygote(settings)
    _STREAMS[:] = _streams()  # never written here: a call's are these, over its own pipes
    try:
        zygote.run()
    finally:
        zygote.close()


if __name__ == "__main__":
    main()
