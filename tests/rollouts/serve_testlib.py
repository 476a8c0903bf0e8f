"""`toolgym serve` as a real process on 127.0.0.1, for the tests that need an endpoint another
thread or process can block on (an endpoint teacher's requests are synchronous)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Bounds only a shutdown that never comes; the tests wait for conditions, not for time.
PATIENCE_S = 300.0


@contextmanager
def toolgym_serve(checkpoint: Path, *args: str) -> Iterator[str]:
    """`toolgym serve --policy checkpoint --port 0 *args` until the block ends (Ctrl+C, as a
    user stops it); yields its base URL once it prints that it serves (the port is bound)."""
    command = [sys.executable, "-m", "toolgym.configs.cli", "serve", "--policy", str(checkpoint)]
    proc = subprocess.Popen(
        [*command, "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        seen = []
        line = proc.stdout.readline()
        while line and not line.startswith("serving "):
            seen.append(line)
            line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"toolgym serve exited before serving (code {proc.wait()}): {''.join(seen)}")
        yield line.split(" at ", 1)[1].split()[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=PATIENCE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
