"""The sandbox's zygote: a Python process, started once, that forks one bounded child per call.

Runs INSIDE the sandbox (bubblewrap, or a plain process in the rlimits-only mode), started by
envs/tools/sandbox.py as `python -I -c <this file's source> <settings JSON>`; stdlib only (the
sandbox holds only the interpreter's own prefix). Imports nothing from toolgym.

Protocol on stdin/stdout, each message a 4-byte big-endian length then a JSON object:
    in:  {"id": int, "code": str}
    out: {"id": int, "exit_code": int | null, "signal": int | null, "timed_out": bool,
          "stdout": base64, "stderr": base64, "stdout_bytes": int, "stderr_bytes": int,
          "wall_s": float}
    first out: {"ready": true} once the zygote is up (the host waits for it before any call).
The zygote serves calls concurrently (one selector loop, no threads, so forking is safe). A
child: its own process group; drops to `uid + id % uids` when a uid is set (the zygote runs as
root); rlimits
(CPU seconds, address space, file size, open files, processes, no core files); a fresh working
directory; stdout/stderr to pipes the zygote reads (at most `output_bytes` kept per stream, the
rest counted and discarded); the code run as `__main__`. The zygote kills the child's process
group at the wall-clock deadline and once the child has exited (its leftovers), and, as PID 1 of
its own PID namespace (bubblewrap), sweeps every other process when no call is running. It exits
when stdin closes, killing what is left.
"""

import base64
import contextlib
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


def _child(call_id, code, settings, out_w, err_w, protocol_fds):
    """In the forked child: isolate, limit, run `code`, exit. Never returns."""
    try:
        os.setpgid(0, 0)
        for fd in protocol_fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 65536)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file-size limit raises
        if settings["uid"] is not None:  # as root: a uid of the call's own among `uids`
            uid = settings["uid"] + call_id % settings["uids"]
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        workdir = os.path.join(settings["workdir"], f"call-{call_id}")
        os.mkdir(workdir, 0o700)
        os.chdir(workdir)
        os.environ["HOME"] = workdir
        os.environ["TMPDIR"] = workdir
        limits = (
            (resource.RLIMIT_CPU, settings["cpu_s"]),
            (resource.RLIMIT_AS, settings["memory_bytes"]),
            (resource.RLIMIT_FSIZE, settings["file_size_bytes"]),
            (resource.RLIMIT_NOFILE, settings["open_files"]),
            (resource.RLIMIT_NPROC, settings["processes"]),
            (resource.RLIMIT_CORE, 0),
        )
        for which, value in limits:
            resource.setrlimit(which, (value, value))
        # The call's own streams over fds 0-2 (never closed: the process ends with them).
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    except BaseException:
        os._exit(125)
    status = 0
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
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
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(status)


class _Call:
    __slots__ = ("deadline", "id", "open", "out", "pid", "pidfd", "sizes", "started", "status", "timed_out")

    def __init__(self, call_id, pid, pidfd, deadline):
        self.id, self.pid, self.pidfd, self.deadline = call_id, pid, pidfd, deadline
        self.started = time.monotonic()
        self.out = {1: bytearray(), 2: bytearray()}
        self.sizes = {1: 0, 2: 0}
        self.open = 2
        self.status = None
        self.timed_out = False


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
        self.statuses = {}
        self.pid1 = os.getpid() == 1
        os.makedirs(settings["workdir"], exist_ok=True)
        os.chmod(settings["workdir"], 0o1777)

    def send(self, message):
        data = json.dumps(message).encode()
        view = memoryview(_HEADER.pack(len(data)) + data)
        while view:
            view = view[os.write(self.outp, view) :]

    def start(self, call_id, code):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child(call_id, code, self.settings, out_w, err_w, (self.inp, self.outp, out_r, err_r))
        os.close(out_w)
        os.close(err_w)
        call = _Call(call_id, pid, os.pidfd_open(pid), time.monotonic() + self.settings["timeout_s"])
        self.calls[pid] = call
        for fd, stream in ((out_r, 1), (err_r, 2)):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, ("pipe", (call, stream)))
        self.selector.register(call.pidfd, selectors.EVENT_READ, ("exit", call))

    def read_pipe(self, fd, call, stream):
        cap = self.settings["output_bytes"]
        while True:
            try:
                chunk = os.read(fd, _CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                self.selector.unregister(fd)
                os.close(fd)
                call.open -= 1
                return
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

    def reap(self):
        """Collect every exited child (orphans too, as PID 1), keeping our calls' statuses."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.calls:
                self.statuses[pid] = status

    def exited(self, call):
        self.selector.unregister(call.pidfd)
        os.close(call.pidfd)
        if call.pid not in self.statuses:
            _, self.statuses[call.pid] = os.waitpid(call.pid, 0)
        call.status = self.statuses.pop(call.pid)
        self.kill_group(call)  # what it left behind in its group
        # Drain what is already in the pipes; a writer left behind (escaped its group) is not waited for.
        for key in list(self.selector.get_map().values()):
            kind, payload = key.data
            if kind == "pipe" and payload[0] is call:
                self.read_pipe(key.fd, *payload)
                if key.fd in self.selector.get_map():
                    self.selector.unregister(key.fd)
                    os.close(key.fd)
        self.finish(call)

    def finish(self, call):
        """Reply for an ended call, after its directory and (when idle) every leftover is gone."""
        del self.calls[call.pid]
        status = call.status
        reply = {
            "id": call.id,
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": call.timed_out,
            "stdout": base64.b64encode(bytes(call.out[1])).decode(),
            "stderr": base64.b64encode(bytes(call.out[2])).decode(),
            "stdout_bytes": call.sizes[1],
            "stderr_bytes": call.sizes[2],
            "wall_s": time.monotonic() - call.started,
        }
        shutil.rmtree(os.path.join(self.settings["workdir"], f"call-{call.id}"), ignore_errors=True)
        if not self.calls and self.pid1:
            self.sweep()
        self.send(reply)

    def sweep(self):
        """As PID 1 with no call running: kill every other process in the namespace."""
        with contextlib.suppress(OSError):
            os.kill(-1, signal.SIGKILL)
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
            self.start(request["id"], request["code"])
        return True

    def run(self):
        self.send({"ready": True})
        while True:
            now = time.monotonic()
            deadlines = [c.deadline for c in self.calls.values() if not c.timed_out]
            wait = max(0.0, min(deadlines) - now) if deadlines else None
            events = self.selector.select(wait if wait is None else min(wait, 1.0))
            self.reap()
            for key, _ in events:
                kind, payload = key.data
                if kind == "stdin":
                    if not self.read_requests():
                        return
                elif kind == "pipe":
                    if key.fd in self.selector.get_map():
                        self.read_pipe(key.fd, *payload)
                elif kind == "exit" and payload.pid in self.calls and payload.status is None:
                    self.exited(payload)
            now = time.monotonic()
            for call in list(self.calls.values()):
                if not call.timed_out and now >= call.deadline:
                    call.timed_out = True
                    self.kill_group(call)

    def close(self):
        for call in list(self.calls.values()):
            self.kill_group(call)
        if self.pid1:
            self.sweep()


def main():
    settings = json.loads(sys.argv[1])
    for name in settings["preload"]:  # imported once here, so a call's `import` costs nothing
        with contextlib.suppress(ImportError):
            __import__(name)
    zygote = Zygote(settings)
    try:
        zygote.run()
    finally:
        zygote.close()


if __name__ == "__main__":
    main()
