"""Tools from an MCP server: its tools listed, each one a `Tool`, each call a round trip.

Needs the official `mcp` SDK (the optional extra `toolgym[mcp]`). A server is a stdio command
(started as a subprocess, in its own process group) or a streamable-HTTP URL:

    class WeatherEnv(ToolEnv):
        def __init__(self, **knobs):
            self.server = MCPServer(["python", "weather_server.py"], shared=True)
            super().__init__(tools=self.server.tools(), instructions="...", **knobs)

        def close(self):
            self.server.close()
            super().close()

`server.tools()` lists the server's tools once (name, description, input JSON Schema) and makes
each a `Tool.from_schema`: arguments are checked against the schema before the call (a sound
subset of JSON Schema; the server rejects the rest), the tool's name is its MCP name with
characters other than letters, digits and `_` replaced by `_` (`prefix` namespaces them).

Results: the text of the result's content blocks (an embedded text resource by its text; other
blocks as a one-line placeholder), or the structured content as compact JSON when there is no
block. A result with `isError` is a `ToolError` (a tool_error observation); a JSON-RPC
invalid-params error is bad_arguments.

Failures: a server that cannot start, exits, answers nothing within `timeout_s`, or sends a
result the SDK cannot read raises `MCPServerError` (a RuntimeError, so the env does not turn it
into an observation: the rollout runner ends that one episode as `env_error`, named
`env_error:MCPServerError` in the metrics) whose message ends with the tail of the server's
stderr. A server that exited or hung is stopped (its process group killed if it ignores the end
of its stdin) and the next call starts a fresh one, so the next episode has a working server.

Lifetime: the server starts at the first `tools()` or call. `close()` stops a private server and
waits for its process to end; with `shared=True` the handles made with the same command,
environment, working directory and URL share one server (reference-counted: `close()` drops a
reference, the last one stops it after `keep_alive_s`, so episodes made one after another by the
rollout runner, one env each, reuse it). A handle that is garbage-collected drops its reference;
every server still running at interpreter exit is stopped. All servers run on one daemon thread's
event loop; a tool call blocks its caller until the round trip ends.
The round trip's cost against an in-process call: bench/RESULTS.md, "MCP tool call round trip".
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import os
import re
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from .event_loop import BackgroundLoop
from .typed import Tool, ToolCallError, ToolError, ToolServiceError

if TYPE_CHECKING:
    from mcp import Client
    from mcp.types import CallToolResult

__all__ = ["MCPServer", "MCPServerError"]

DEFAULT_CALL_TIMEOUT_S: Final = 30.0
DEFAULT_START_TIMEOUT_S: Final = 60.0
_STOP_TIMEOUT_S: Final = 10.0  # the SDK's own shutdown escalates to SIGKILL within about 4.5 s
_TAIL_LINES: Final = 20
_NOT_NAME = re.compile(r"[^A-Za-z0-9_]")


class MCPServerError(ToolServiceError):
    """The MCP server failed (could not start, exited, hung, sent an unreadable result): not the
    policy's mistake. The message names the server and ends with the tail of its stderr."""


def _import_mcp() -> Any:
    try:
        import mcp
    except ImportError as exc:
        raise ImportError(f"MCP tools need the `mcp` package (pip install 'toolgym[mcp]'): {exc}") from None
    return mcp


_Loop = BackgroundLoop("toolgym-mcp")  # every MCP connection lives on it


class _Process:
    """One start of the server: its client session, the task that owns it, its stderr file."""

    def __init__(self, capture_stderr: bool) -> None:
        self.client: Client | None = None
        self.stderr = tempfile.TemporaryFile() if capture_stderr else None  # noqa: SIM115 (closed in stop)
        self.dead = False
        self.closing = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.stopped: asyncio.Task[None] | None = None

    def tail(self, chars: int) -> str:
        """The last lines of the server's stderr (at most `chars` characters), or ""."""
        if self.stderr is None or self.stderr.closed:
            return ""
        fd = self.stderr.fileno()
        size = os.fstat(fd).st_size
        data = os.pread(fd, 4 * chars, max(0, size - 4 * chars)).decode("utf-8", "replace")
        lines = [line.rstrip() for line in data.splitlines() if line.strip()]
        text = "\n".join(lines[-_TAIL_LINES:])
        return text[-chars:]

    def stop(self) -> asyncio.Task[None]:
        """Stop it (once), in the background: the task that ends when the process has."""
        self.dead = True
        if self.stopped is None:
            self.stopped = asyncio.ensure_future(self._stop())
        return self.stopped

    async def _stop(self) -> None:
        self.closing.set()
        task = self.task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), _STOP_TIMEOUT_S)
            except (TimeoutError, asyncio.CancelledError, Exception):
                task.cancel()
        if self.stderr is not None:
            self.stderr.close()


class _Connection:
    """A server (command or URL), started on demand and restarted after a failure; the
    reference count of the handles that share it."""

    def __init__(self, key: tuple[Any, ...], spec: dict[str, Any], start_timeout_s: float, tail_chars: int):
        self.key = key
        self.spec = spec
        self.label = " ".join(spec["command"]) if spec["command"] else str(spec["url"])
        self.start_timeout_s = start_timeout_s
        self.tail_chars = tail_chars
        self.refs = 0
        self.closed = False
        self.listing: list[Any] | None = None
        self.current: _Process | None = None
        self.stopping: set[asyncio.Task[None]] = set()
        self._lock: asyncio.Lock | None = None

    # ---- on the loop ---------------------------------------------------------------------

    def error(self, process: _Process | None, why: str) -> MCPServerError:
        tail = process.tail(self.tail_chars) if process is not None else ""
        readable = process is not None and process.stderr is not None and not process.stderr.closed
        shown = (
            f"; its stderr ends:\n{tail}" if tail else ("; it wrote nothing to stderr" if readable else "")
        )
        return MCPServerError(f"MCP server `{self.label}`: {why}{shown}")

    def fail(self, process: _Process, why: str) -> MCPServerError:
        """The error for a process that exited or hung, which is stopped (the next call starts
        a fresh one)."""
        error = self.error(process, why)
        self.stop(process)
        return error

    def stop(self, process: _Process) -> None:
        task = process.stop()
        self.stopping.add(task)
        task.add_done_callback(self.stopping.discard)

    async def process(self) -> _Process:
        """The running process, started (or restarted) when there is none."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.closed:
                raise MCPServerError(f"MCP server `{self.label}`: used after close()")
            if self.current is not None and not self.current.dead:
                return self.current
            if self.current is not None:
                self.stop(self.current)
            self.current = process = _Process(capture_stderr=bool(self.spec["command"]))
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            process.task = asyncio.ensure_future(self._serve(process, ready))
            try:
                await asyncio.wait_for(asyncio.shield(ready), self.start_timeout_s)
            except TimeoutError:
                raise self.fail(process, f"did not start within {self.start_timeout_s:g} s") from None
            except Exception as exc:
                raise self.fail(process, f"cannot start ({type(exc).__name__}: {exc})") from None
            return process

    async def _serve(self, process: _Process, ready: asyncio.Future[None]) -> None:
        """Own the client session (the SDK's contexts are entered and left in one task) until
        the process is stopped."""
        mcp = _import_mcp()
        from mcp.client.stdio import stdio_client

        spec = self.spec
        try:
            if spec["command"]:
                command, *args = spec["command"]
                parameters = mcp.StdioServerParameters(
                    command=command, args=args, env=spec["env"], cwd=spec["cwd"]
                )
                server: Any = stdio_client(parameters, errlog=process.stderr)  # type: ignore[arg-type]
            else:
                server = spec["url"]
            async with mcp.Client(server, cache=None) as client:
                process.client = client
                if not ready.done():
                    ready.set_result(None)
                await process.closing.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if not isinstance(exc, Exception):
                raise
        finally:
            process.dead = True
            process.client = None
            if not ready.done():
                ready.set_exception(RuntimeError("the session ended during the handshake"))

    async def tools(self) -> list[Any]:
        if self.listing is None:
            process = await self.process()
            client = process.client
            assert client is not None
            listed: list[Any] = []
            cursor = None
            try:
                while True:
                    page = await asyncio.wait_for(client.list_tools(cursor=cursor), self.start_timeout_s)
                    listed += page.tools
                    cursor = page.next_cursor
                    if not cursor:
                        break
            except TimeoutError:
                raise self.fail(
                    process, f"did not list its tools within {self.start_timeout_s:g} s"
                ) from None
            except Exception as exc:
                raise self.fail(process, f"cannot list its tools ({type(exc).__name__}: {exc})") from None
            self.listing = listed
        return self.listing

    async def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> CallToolResult:
        mcp = _import_mcp()
        from mcp.types import CONNECTION_CLOSED, INVALID_PARAMS

        process = await self.process()
        client = process.client
        if client is None or process.dead:
            raise self.fail(process, "exited before the call")
        try:
            return await asyncio.wait_for(client.call_tool(name, arguments), timeout_s)
        except TimeoutError:
            raise self.fail(process, f"{name} did not answer within {timeout_s:g} s") from None
        except mcp.MCPError as exc:
            if exc.code == INVALID_PARAMS:
                raise ToolCallError("bad_arguments", exc.message) from None
            if exc.code == CONNECTION_CLOSED or process.dead:
                raise self.fail(process, f"exited during a call of {name} ({exc.message})") from None
            raise self.error(
                process, f"{name} failed with JSON-RPC error {exc.code}: {exc.message}"
            ) from None
        except (ValueError, RuntimeError) as exc:  # pydantic's ValidationError, a bad structured result
            if process.dead:
                raise self.fail(process, f"exited during a call of {name} ({exc})") from None
            message = f"{name} sent a result the client cannot read ({type(exc).__name__}: {exc})"
            raise self.error(process, message[:2000]) from None
        except Exception as exc:  # the transport broke (closed streams, a lost connection): restart
            raise self.fail(process, f"lost during a call of {name} ({type(exc).__name__}: {exc})") from None

    async def close(self) -> None:
        """Stop the server and wait until every process it started has ended."""
        self.closed = True
        tasks = set(self.stopping)
        if self.current is not None:
            tasks.add(self.current.stop())
        await asyncio.gather(*tasks, return_exceptions=True)


_POOL: dict[tuple[Any, ...], _Connection] = {}  # shared servers by key
_LIVE: set[_Connection] = set()  # every connection not yet closed, for interpreter exit
_POOL_LOCK = threading.Lock()
_EXIT_HOOKED = False


_BACKGROUND: set[asyncio.Task[None]] = set()  # closes started without a waiter


def _background(coroutine: Any) -> None:
    task = asyncio.ensure_future(coroutine)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


def _forget(connection: _Connection) -> None:
    """Take the connection out of the pool (under _POOL_LOCK): no handle can get it again."""
    _LIVE.discard(connection)
    if _POOL.get(connection.key) is connection:
        del _POOL[connection.key]


def _stop(connection: _Connection, wait: bool) -> None:
    if wait:
        _Loop.run(connection.close(), _STOP_TIMEOUT_S + 5)
    else:
        _Loop.get().call_soon_threadsafe(lambda: _background(connection.close()))


def _release(connection: _Connection, keep_alive_s: float, wait: bool) -> None:
    """Drop one reference; the last one stops the server (after keep_alive_s)."""
    with _POOL_LOCK:
        connection.refs -= 1
        if connection.refs > 0:
            return
        if keep_alive_s <= 0:
            _forget(connection)
    if keep_alive_s <= 0:
        _stop(connection, wait)
        return

    def expire() -> None:  # on the loop
        with _POOL_LOCK:
            if connection.refs > 0 or connection not in _LIVE:
                return
            _forget(connection)
        _background(connection.close())

    _Loop.get().call_soon_threadsafe(lambda: asyncio.get_running_loop().call_later(keep_alive_s, expire))


def _close_all() -> None:
    """At interpreter exit: stop every server still running."""
    with _POOL_LOCK:
        live = list(_LIVE)
        for connection in live:
            _forget(connection)
    for connection in live:
        with contextlib.suppress(Exception):  # exiting anyway
            _stop(connection, wait=True)


def _tool_name(prefix: str, name: str) -> str:
    cleaned = _NOT_NAME.sub("_", prefix + name)
    return f"_{cleaned}" if not cleaned or cleaned[0].isdigit() else cleaned


def _one_line(description: str | None, fallback: str) -> str:
    paragraph = (description or "").strip().split("\n\n")[0]
    return " ".join(paragraph.split()) or fallback


class MCPServer:
    """A handle on an MCP server whose tools become `Tool`s (see the module doc).

    command: the stdio server's command and arguments (a list, or one string split on
    whitespace); or url: a streamable-HTTP endpoint. env: extra environment variables (over the
    SDK's safe defaults: HOME, PATH, ...). cwd: its working directory. timeout_s: per call (a
    call past it is a hang: MCPServerError, server restarted). start_timeout_s: to start and to
    list tools. shared: share one server with the other shared handles of the same command,
    env, cwd and URL (reference-counted); keep_alive_s: how long the last shared handle's
    server outlives its close(). prefix: put before every tool's name. stderr_tail_chars: how
    much of the server's stderr an MCPServerError shows.
    """

    def __init__(
        self,
        command: str | Sequence[str] | None = None,
        *,
        url: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        shared: bool = False,
        keep_alive_s: float = 5.0,
        prefix: str = "",
        stderr_tail_chars: int = 2000,
    ):
        _import_mcp()
        if (command is None) == (url is None):
            raise ValueError("MCPServer takes a command (stdio) or a url (streamable HTTP), exactly one")
        argv = tuple(command.split() if isinstance(command, str) else command or ())
        if command is not None and (not argv or not all(isinstance(a, str) and a for a in argv)):
            raise ValueError(f"MCPServer command must be a non-empty list of strings, got {command!r}")
        for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"MCPServer {name} must be a positive number, got {value!r}")
        if not isinstance(keep_alive_s, int | float) or keep_alive_s < 0:
            raise ValueError(f"MCPServer keep_alive_s must be >= 0, got {keep_alive_s!r}")
        environment = dict(env) if env is not None else None
        directory = os.fspath(cwd) if cwd is not None else None
        spec = {"command": argv, "url": url, "env": environment, "cwd": directory}
        key = (argv, url, tuple(sorted((environment or {}).items())), directory)
        self.timeout_s = float(timeout_s)
        self.prefix = prefix
        self.shared = shared
        self.keep_alive_s = float(keep_alive_s) if shared else 0.0
        global _EXIT_HOOKED
        with _POOL_LOCK:
            connection = _POOL.get(key) if shared else None
            if connection is None:
                connection = _Connection(key, spec, float(start_timeout_s), stderr_tail_chars)
                if shared:
                    _POOL[key] = connection
                _LIVE.add(connection)
            connection.refs += 1
            if not _EXIT_HOOKED:
                atexit.register(_close_all)
                _EXIT_HOOKED = True
        self._connection = connection
        self._tools: list[tuple[str, Tool]] | None = None  # (the server's name, the Tool)
        self._release = weakref.finalize(self, _release, connection, self.keep_alive_s, False)
        self._release.atexit = False  # at exit, _close_all stops every server and waits for it

    @property
    def label(self) -> str:
        """The command line or URL, as error messages name the server."""
        return self._connection.label

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def start(self) -> None:
        """Start the server now (otherwise the first `tools()` or call does). Raises
        MCPServerError when it cannot."""
        self._check_open()
        connection = self._connection
        _Loop.run(connection.process(), connection.start_timeout_s + 5)

    def tools(self, include: Sequence[str] | None = None) -> list[Tool]:
        """The server's tools as Tools (listed once per server), or only those named in
        `include` (their MCP names). Raises MCPServerError when the server cannot list them,
        ValueError for a name clash (after cleaning) or a schema that is not an object's."""
        self._check_open()
        if self._tools is None:
            connection = self._connection
            listed = _Loop.run(connection.tools(), 2 * connection.start_timeout_s + 5)
            tools: list[tuple[str, Tool]] = []
            for spec in listed:
                name = _tool_name(self.prefix, spec.name)
                if name.upper() == "ANSWER":
                    raise ValueError(
                        f"MCP server `{self.label}`: tool {spec.name!r} would be named ANSWER, which is "
                        "reserved; pass a prefix"
                    )
                description = _one_line(spec.description, f"The {spec.name} tool of an MCP server.")
                try:
                    made = Tool.from_schema(
                        name,
                        description,
                        spec.input_schema,
                        self._caller(spec.name),
                        timeout_s=self.timeout_s,
                    )
                    tools.append((spec.name, made))
                except ValueError as exc:
                    raise ValueError(f"MCP server `{self.label}`: {exc}") from None
            seen: dict[str, str] = {}
            for remote, made in tools:
                if made.name.upper() in seen:
                    raise ValueError(
                        f"MCP server `{self.label}`: tools {seen[made.name.upper()]!r} and {remote!r} "
                        f"both become {made.name!r}"
                    )
                seen[made.name.upper()] = remote
            self._tools = tools
        if include is None:
            return [made for _, made in self._tools]
        unknown = set(include) - {remote for remote, _ in self._tools}
        if unknown:
            raise ValueError(f"MCP server `{self.label}` has no tool named {sorted(unknown)}")
        return [made for remote, made in self._tools if remote in include]

    def call(self, name: str, arguments: Mapping[str, Any] | None = None) -> str:
        """Call the tool the server calls `name` (no argument check): its result text. Raises
        ToolError for an `isError` result, MCPServerError when the server fails."""
        return self._caller(name)(**dict(arguments or {}))

    def _caller(self, remote: str) -> _Call:
        return _Call(self, remote)

    def _check_open(self) -> None:
        if self.closed:
            raise MCPServerError(f"MCP server `{self.label}`: used after close()")

    def close(self, wait: bool = True) -> None:
        """Drop this handle: a private server is stopped (wait: until its process has ended); a
        shared one when its last handle closes, after keep_alive_s. Idempotent."""
        if self._release.alive:
            self._release.detach()
            _release(self._connection, self.keep_alive_s, wait)

    def __enter__(self) -> MCPServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("shared" if self.shared else "private")
        return f"MCPServer({self.label!r}, {state})"


class _Call:
    """The call of one of a server's tools. It holds the handle, so that the server lives as long
    as its tools do."""

    __slots__ = ("handle", "remote")

    def __init__(self, handle: MCPServer, remote: str):
        self.handle, self.remote = handle, remote

    def __call__(self, **arguments: Any) -> str:
        connection, remote = self.handle._connection, self.remote
        timeout_s = self.handle.timeout_s
        if connection.closed or self.handle.closed:
            raise MCPServerError(f"MCP server `{connection.label}`: used after close()")
        try:
            result = _Loop.run(
                connection.call(remote, arguments, timeout_s), connection.start_timeout_s + timeout_s + 10
            )
        except concurrent.futures.TimeoutError:
            raise MCPServerError(f"MCP server `{connection.label}`: its event loop did not answer") from None
        try:
            text = _result_text(result)
        except Exception as exc:
            raise MCPServerError(
                f"MCP server `{connection.label}`: {remote} sent an unreadable result ({exc})"
            ) from None
        if result.is_error:
            raise ToolError(text or f"{remote} failed")
        return text


def _result_text(result: Any) -> str:
    """A CallToolResult as the text the policy sees (see the module doc)."""
    parts: list[str] = []
    for block in result.content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource":
            resource = block.resource
            text = getattr(resource, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource {resource.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        else:
            mime = getattr(block, "mime_type", None)
            parts.append(f"[{kind} content{f' ({mime})' if mime else ''}]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False, separators=(",", ":"))
    return "\n".join(parts)
