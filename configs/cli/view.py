"""`toolgym view`: the trace viewer (configs/cli/viewer/) over recordings or run directories."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from ...agents.chat import ChatRenderer
from ...agents.tokenizer import load_tokenizer
from ...trainers.metrics_log import read_metrics
from ..run_dir import RunDir
from .viewer.server import ViewerData, ViewerServer


def view_sources(paths: Sequence[str]) -> tuple[list[Path], list[dict[str, Any]] | None, Path | None]:
    """(recordings, the run's metrics records or None, the run's tokenizer.json or None) for the
    paths given to `toolgym view`: a run directory stands for its trajectories/*.jsonl (evals
    first, by step) and its metrics.jsonl."""
    recordings: list[Path] = []
    metrics, tokenizer = None, None
    for path in map(Path, paths):
        if not path.is_dir():
            recordings.append(path)
            continue
        run = RunDir(path)
        found = sorted(run.trajectories.glob("*.jsonl"), key=lambda p: (not p.name.startswith("eval_"), p.name))
        if not found:
            raise ValueError(f"{path}: no recordings in {run.trajectories}")
        recordings += found
        if metrics is None and run.metrics.is_file():
            metrics = read_metrics(run.metrics)
        if tokenizer is None and (run.final_model / "tokenizer.json").is_file():
            tokenizer = run.final_model / "tokenizer.json"
    return recordings, metrics, tokenizer


def view_command(
    console: Console,
    recordings: Sequence[str | os.PathLike],
    tokenizer_path: str | os.PathLike | None,
    metrics: Sequence[dict[str, Any]] | None = None,
    host: str = "127.0.0.1",
    port: int = 8765,
    title: str = "",
) -> int:
    """Serve the trace viewer (configs/cli/viewer/server.py) over `recordings` until interrupted;
    `metrics` (a run's metrics records) feed its charts. The first recording is read before the
    URL is printed, so the page opens at once. Raises ValueError for a path that is not a file
    or a port that cannot be had (before any file is read); a file that is damaged or not a
    recording still opens (the page says what it skipped)."""
    missing = [str(p) for p in recordings if not Path(p).is_file()]
    if not recordings or missing:
        raise ValueError(f"no such recording: {', '.join(missing) or '(none given)'}")
    renderer = ChatRenderer(load_tokenizer(tokenizer_path)) if tokenizer_path is not None else None
    data = ViewerData(recordings, renderer, metrics, title)
    server = bind_viewer(data, host, port)  # before reading anything: a taken port fails at once
    first = data.index(0)
    skipped = f", {first.skipped} lines skipped" if first.skipped else ""
    console.print(f"{first.label}: {len(first.rows)} episodes{skipped}", markup=False, highlight=False)
    for problem in first.problems[:5]:
        console.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"toolgym view: {len(data.paths)} recording(s) at {server.url}  (Ctrl-C stops)",
        markup=False,
        highlight=False,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def bind_viewer(data: ViewerData, host: str, port: int) -> ViewerServer:
    """The viewer's server bound to host:port. ValueError naming the address when it is taken or
    cannot be bound (the OS's words), with what to pass instead."""
    try:
        return ViewerServer(data, host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = f"port {port} on {host} is in use (another `toolgym view`?)"
        else:
            why = f"cannot serve on {host}:{port}: {exc.strerror or exc}"
        raise ValueError(f"{why}; pass --port N for another port, or --port 0 for any free one") from None
