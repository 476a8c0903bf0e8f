"""`toolgym view`: the trace viewer, a local web page over a small JSON API (stdlib HTTP server).

The page (`static/`: one HTML file, one script, one stylesheet; plain JS, nothing fetched from
elsewhere) asks the server for pages of rows, so a 10,000-episode recording opens as fast as
its first 100 rows draw; each recording is indexed once, the first time it is asked for
(`RecordingIndex`). The server binds to 127.0.0.1 by default, reads only the files it was
given, and serves only its own static files.

API (GET, JSON; an error is {"error": text} with status 400 or 404):
    /api/recordings                     [{id, label, path}], the run's charts and their kind, and
                                        every metric a chart can show (metric_names)
    /api/recording?r=ID                 header, counts, what was skipped and why, filter values
    /api/episodes?r=ID&<filters>        a page of rows (RecordingIndex.query)
    /api/episode?r=ID&i=N               one episode, token by token (RecordingIndex.episode)
    /api/compare?a=ID&b=ID&changed=1    two recordings aligned by task seed (index.compare), and a
                                        warning when they hold different envs
    /api/series?name=METRIC             one metric's chart (any of /api/recordings' metric_names)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import msgspec

from ....agents.chat import ChatRenderer
from ....rollouts.endpoint.hosts import host_allowed
from .index import (
    RecordingIndex,
    compare,
    recording_metric_names,
    recording_metric_series,
    recording_series,
    run_metric_names,
    run_metric_series,
    run_series,
)

STATIC_FILES = {"index.html": "text/html", "viewer.js": "text/javascript", "viewer.css": "text/css"}


class ViewerData:
    """What one viewer serves: recordings (indexed lazily, once each), an optional metrics log
    (a run directory's records), and the renderer that decodes tokens (None: text only)."""

    def __init__(
        self,
        recordings: Sequence[str | os.PathLike],
        renderer: ChatRenderer | None = None,
        metrics: Sequence[Mapping[str, Any]] | None = None,
        title: str = "",
    ) -> None:
        self.paths = [Path(p) for p in recordings]
        labels = [p.name for p in self.paths]
        self.labels = [
            label if labels.count(label) == 1 else str(path)
            for label, path in zip(labels, self.paths, strict=True)
        ]
        self.renderer = renderer
        self.metrics = list(metrics) if metrics is not None else None
        self.title = title or (str(self.paths[0]) if len(self.paths) == 1 else "toolgym run")
        self._indexes: dict[int, RecordingIndex] = {}
        self._lock = threading.Lock()

    def index(self, rid: int) -> RecordingIndex:
        if not 0 <= rid < len(self.paths):
            raise LookupError(f"no recording {rid}")
        with self._lock:  # one reader per file, once
            if rid not in self._indexes:
                self._indexes[rid] = RecordingIndex(self.paths[rid], self.labels[rid])
            return self._indexes[rid]

    def _all(self) -> list[RecordingIndex]:
        return [self.index(i) for i in range(len(self.paths))]

    def recordings(self) -> dict[str, Any]:
        if self.metrics is not None:
            charts, kind, names = run_series(self.metrics), "run", run_metric_names(self.metrics)
        else:
            indexes = self._all()
            charts, kind, names = recording_series(indexes), "recordings", recording_metric_names(indexes)
        return {
            "title": self.title,
            "recordings": [
                {"id": i, "label": label, "path": str(path)}
                for i, (label, path) in enumerate(zip(self.labels, self.paths, strict=True))
            ],
            "charts": charts,
            "charts_kind": kind,
            "metric_names": names,
        }

    def series(self, name: str) -> dict[str, Any]:
        """One metric's chart: the run's (metrics records) or the recordings' (env metrics)."""
        if self.metrics is not None:
            if name not in run_metric_names(self.metrics):
                raise LookupError(f"the run logged no metric {name!r}")
            return {"name": name, "series": run_metric_series(self.metrics, name)}
        return {"name": name, "series": recording_metric_series(self._all(), name)}

    def answer(self, route: str, params: Mapping[str, str]) -> Any:
        """The JSON body of an API route. Raises LookupError (404) or ValueError (400)."""
        if route == "recordings":
            return self.recordings()
        if route == "recording":
            return self.index(_id(params, "r")).summary()
        if route == "episodes":
            return self.index(_id(params, "r")).query(params)
        if route == "episode":
            try:
                return self.index(_id(params, "r")).episode(_id(params, "i"), self.renderer)
            except IndexError as exc:
                raise LookupError(str(exc)) from None
        if route == "series":
            if not params.get("name"):
                raise ValueError("missing parameter 'name'")
            return self.series(params["name"])
        if route == "compare":
            return compare(self.index(_id(params, "a")), self.index(_id(params, "b")), params)
        raise LookupError(f"no API route {route!r}")


def _id(params: Mapping[str, str], name: str) -> int:
    try:
        return int(params[name])
    except KeyError:
        raise ValueError(f"missing parameter {name!r}") from None
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {params[name]!r}") from None


def _static(name: str) -> bytes:
    return resources.files(__name__.rpartition(".")[0]).joinpath("static", name).read_bytes()


class _Handler(BaseHTTPRequestHandler):
    data: ViewerData  # set on the subclass the server makes
    bind_host: str  # likewise: the Host names it answers (DNS rebinding, rollouts/endpoint/hosts.py)
    encoder = msgspec.json.Encoder()

    def do_GET(self) -> None:
        if not host_allowed(self.headers.get("Host"), self.bind_host):
            what = f"Host {self.headers.get('Host')!r} is not this server's (it answers {self.bind_host} and localhost)"
            self._send(HTTPStatus.BAD_REQUEST, self.encoder.encode({"error": what}), "application/json")
            return
        url = urlsplit(self.path)
        if url.path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, _static("index.html"), STATIC_FILES["index.html"])
        elif url.path.startswith("/static/") and url.path[8:] in STATIC_FILES:
            name = url.path[8:]
            self._send(HTTPStatus.OK, _static(name), STATIC_FILES[name])
        elif url.path.startswith("/api/"):
            params = dict(parse_qsl(url.query))
            try:
                body, status = self.data.answer(url.path[5:], params), HTTPStatus.OK
            except LookupError as exc:
                body, status = {"error": str(exc)}, HTTPStatus.NOT_FOUND
            except ValueError as exc:
                body, status = {"error": str(exc)}, HTTPStatus.BAD_REQUEST
            except Exception as exc:  # a bug must still show on the page, not as a blank one
                body, status = {"error": f"{type(exc).__name__}: {exc}"}, HTTPStatus.INTERNAL_SERVER_ERROR
            self._send(status, self.encoder.encode(body), "application/json")
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")

    def _send(self, status: HTTPStatus, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", f"{kind}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the page moved on mid-answer: nobody to tell
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the page is the log
        pass


class ViewerServer:
    """The viewer's HTTP server on `host:port` (port 0: any free port). `start()` serves from a
    background thread (tests, benchmarks); `serve_forever()` blocks (the CLI); `url` is the page."""

    def __init__(self, data: ViewerData, host: str = "127.0.0.1", port: int = 0) -> None:
        handler = type("ViewerHandler", (_Handler,), {"data": data, "bind_host": host})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> ViewerServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()

    def __enter__(self) -> ViewerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
