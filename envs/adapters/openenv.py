"""OpenEnv environments as a toolgym env: `toolgym/OpenEnv-v0`.

    gymnasium.make("toolgym/OpenEnv-v0", url="http://127.0.0.1:8000")
    gymnasium.make("toolgym/OpenEnv-v0", command=["python", "my_env_server.py", "{port}"])

The env is a client of an OpenEnv server (openenv-core's `create_app`: FastAPI, one WebSocket
session per env on `/ws`), spoken to with openenv-core's own client (`GenericEnvClient`): each
env opens one session, `reset` sends the server's reset (with the seed) and `step` the server's
step. Either `url` names a running server, or `command` starts one: the env runs it as a
subprocess (its own process group) on a free 127.0.0.1 port (`{port}` in the command, and the
`PORT` environment variable), waits until its `/health` answers (or the process exits: an
error with the tail of its output), and stops it when the env closes. Servers started from the
same command, working directory and environment are shared by the envs that are open at once
(reference-counted, an env collected unclosed letting go of it too; the last close stops it
after `keep_alive_s`, so the episodes a run makes one after another reuse it; 0 stops it at
once); every server still running at interpreter exit is stopped. A server that exited is
started afresh by the next env or reset. The server must allow as many concurrent sessions as
the run plays episodes at once (its `max_concurrent_envs`; the run's
`rollout.max_concurrent_episodes` bounds those): a session it refuses fails that reset with an
error that says so.

Actions. An MCPEnvironment server (its tools listed with a `list_tools` action at the first
reset) has its tools as toolgym tools, described in the system prompt in `tool_format` and
called exactly as a ToolEnv's are (`NAME[arg]`, `<tool_call>{...}</tool_call>`, ...): the
arguments are checked against the tool's JSON Schema, then each call is one `call_tool` step,
and the observation shows each call's result as the format writes it (the text of the MCP
result's content, or its structured content as JSON). A call the server refuses (invalid
arguments, unknown tool, the tool's own error) is an error result the policy sees, counted in
metric `env_errors`. Any other action text (or all text, for a server without tools) is sent as the
server's action `{action_field: text, **action_extra}` (action_field "message" by default for a
server without tools; with tools, text outside a call is an error observation unless
`action_field` is given).

Observations are the server observation's fields as text: the fields other than done, reward
and metadata (which the server keeps to itself), in the server's order, or `observation_fields`
in that order; empty ones ("", null, [], {}) and the rubric field are left out. A single text
field is shown as it is; otherwise one `name: value` line per field (strings as they are, other
values as compact JSON). The reset observation is the question; `instructions` (with the tools'
description) is the system prompt.

Rewards and done are the server's: each step's reward is the sum of the rewards of the server
steps it made (None counts 0), and a server step with done=true terminates the episode (later
calls in the same action are not run; end_reason `answered`). `max_turns` steps without done
truncate it. Reward components (info `reward_components`, the episode so far): a server whose
observation has a field `components_field` (default `rubric_components`), a {name: number} of
its rubric's named parts' contributions to that step's reward (e.g. `{name: r.last_score for
name, r in self.rubric.named_rubrics()}`), gets one component per part (names with `/` written
with `.`), summed over the episode (the names a reset observation reports, their values
ignored, are listed from the start, as 0); what the parts leave of the reward is component `reward`, so
the components always sum to the episode's reward. Metrics: `server_reward` (the sum so far),
`tool_calls`, `env_errors` (as a ToolEnv counts them).

Failures: a server that cannot start, is down, does not answer within `timeout_s`, closes the
session, answers with an error, or sends what is no OpenEnv reply raises `OpenEnvServerError` (a
RuntimeError, one line naming the server and what went wrong) from reset or step: the rollout
runner ends that one episode as an env error (`env_error:OpenEnvServerError`) and the run goes
on. The env's session is dropped; the next reset opens a new one (restarting a started server
that exited).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Final

from openenv.core.generic_client import GenericEnvClient

from ..core.text_env import TextEnv
from ..tools.call_formats import CALLS, ParsedCall, get_format
from ..tools.event_loop import BackgroundLoop
from ..tools.typed import Tool, ToolCallError, ToolError, ToolServiceError, result_text

DEFAULT_TIMEOUT_S: Final = 30.0
DEFAULT_START_TIMEOUT_S: Final = 120.0
_STOP_TIMEOUT_S: Final = 10.0
_TAIL_CHARS: Final = 300
_HEALTH_POLL_S: Final = 0.1
_INSTRUCTIONS: Final = "You are acting in an environment. Reply with your action."
_FINISH: Final = "The episode ends when the environment says so."
_AT_CAPACITY: Final = "(code: CAPACITY_REACHED)"  # openenv-core's error for a session too many


class OpenEnvServerError(ToolServiceError):
    """The OpenEnv server failed (could not start, is down, hung, answered an error or garbage):
    not the policy's mistake. str() is one line."""


def _one_line(text: str, limit: int = 500) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---- the event loop every client lives on ------------------------------------------------------


_Loop = BackgroundLoop("toolgym-openenv")  # every OpenEnv client lives on it


async def _exchange(client: GenericEnvClient, message: dict[str, Any]) -> Any:
    """openenv-core's send-and-receive (an error reply raises "Server error: ... (code: ...)"),
    except that a session the server closed before reading the message (one it refused) still
    gives the reason the server sent before closing."""
    try:
        await client._send(message)
    except Exception as unsent:
        try:
            reply = await client._receive()
        except Exception:
            raise unsent from None
    else:
        reply = await client._receive()
    if isinstance(reply, dict) and reply.get("type") == "error":
        data = reply.get("data")
        data = data if isinstance(data, dict) else {}
        raise RuntimeError(
            f"Server error: {data.get('message', 'Unknown error')} (code: {data.get('code', 'UNKNOWN')})"
        )
    return reply


# ---- servers started from a command ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _healthy(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{url}/health", timeout=2.0) as reply:
            return reply.status == 200
    except Exception:
        return False


class _Server:
    """One start of a server command: its process (own process group), port and output file."""

    def __init__(
        self, argv: Sequence[str], cwd: str | None, env: Mapping[str, str] | None, start_timeout_s: float
    ):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.label = " ".join(argv)
        args = [a.replace("{port}", str(self.port)) for a in argv]
        environ = {**os.environ, **(env or {}), "PORT": str(self.port)}
        self.output = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop)
        try:
            self.process = subprocess.Popen(
                args, cwd=cwd, env=environ, stdin=subprocess.DEVNULL, stdout=self.output,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            self.output.close()
            raise OpenEnvServerError(f"OpenEnv server `{self.label}` cannot start: {exc}") from None
        deadline = time.monotonic() + start_timeout_s
        while not _healthy(self.url):  # waits on the server's answer or its exit
            if self.process.poll() is not None:
                tail = self.tail()
                self.stop()
                raise OpenEnvServerError(
                    f"OpenEnv server `{self.label}` exited with code {self.process.returncode} before "
                    f"it answered{f'; its output ends: {tail}' if tail else ''}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise OpenEnvServerError(
                    f"OpenEnv server `{self.label}` did not answer {self.url}/health within {start_timeout_s:g} s"
                )
            time.sleep(_HEALTH_POLL_S)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self) -> str:
        if self.output.closed:
            return ""
        size = os.fstat(self.output.fileno()).st_size
        data = os.pread(self.output.fileno(), 4 * _TAIL_CHARS, max(0, size - 4 * _TAIL_CHARS))
        return _one_line(data.decode("utf-8", "replace")[-_TAIL_CHARS:], _TAIL_CHARS)

    def stop(self) -> None:
        """Stop the process group (SIGTERM, then SIGKILL) and wait for the process."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        else:  # exited on its own: its group may hold children still
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.output.close()


class _Shared:
    """A command's server and the envs holding it."""

    def __init__(self) -> None:
        self.server: _Server | None = None
        self.refs = 0
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None


_POOL: dict[tuple[Any, ...], _Shared] = {}
_POOL_LOCK = threading.Lock()
_EXIT_HOOKED = False


def _acquire(key: tuple[Any, ...]) -> _Shared:
    global _EXIT_HOOKED
    with _POOL_LOCK:
        shared = _POOL.setdefault(key, _Shared())
        shared.refs += 1
        if shared.timer is not None:
            shared.timer.cancel()
            shared.timer = None
        if not _EXIT_HOOKED:
            atexit.register(_stop_all)
            _EXIT_HOOKED = True
    return shared


def _running(shared: _Shared, key: tuple[Any, ...], start_timeout_s: float) -> _Server:
    """The shared server, started (or restarted after it exited) when there is none."""
    with shared.lock:
        if shared.server is not None and not shared.server.alive:
            shared.server.stop()
            shared.server = None
        if shared.server is None:
            argv, cwd, env = key
            shared.server = _Server(argv, cwd, dict(env), start_timeout_s)
        return shared.server


def _release(key: tuple[Any, ...], shared: _Shared, keep_alive_s: float) -> None:
    with _POOL_LOCK:
        shared.refs -= 1
        if shared.refs > 0:
            return
        if keep_alive_s > 0:
            shared.timer = threading.Timer(keep_alive_s, _expire, (key, shared))
            shared.timer.daemon = True
            shared.timer.start()
            return
        if _POOL.get(key) is shared:
            del _POOL[key]
    _stop(shared)


def _expire(key: tuple[Any, ...], shared: _Shared) -> None:
    with _POOL_LOCK:
        if shared.refs > 0 or _POOL.get(key) is not shared:
            return
        del _POOL[key]
    _stop(shared)


def _stop(shared: _Shared) -> None:
    with shared.lock:
        if shared.server is not None:
            shared.server.stop()
            shared.server = None


def _stop_all() -> None:
    with _POOL_LOCK:
        pool = list(_POOL.values())
        _POOL.clear()
    for shared in pool:
        if shared.timer is not None:
            shared.timer.cancel()
        with contextlib.suppress(Exception):
            _stop(shared)


# ---- observations as text ----------------------------------------------------------------------


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, str | list | dict) and not value)


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _call_result_text(result: Any) -> str:
    """An MCP CallToolResult (as the server serialised it) as text: its content blocks' text, else
    its structured content (or the value itself) as JSON."""
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        parts = []
        for block in result["content"]:
            if isinstance(block, dict) and block.get("type") == "text":
                parts.append(str(block.get("text", "")))
            elif isinstance(block, dict):
                parts.append(f"[{block.get('type', 'unknown')} content]")
        if parts:
            return "\n".join(parts)
        if result.get("structured_content") is not None:
            return _shown(result["structured_content"])
        return ""
    return _shown(result) if result is not None else ""


class OpenEnvEnv(TextEnv):
    """`gymnasium.make("toolgym/OpenEnv-v0", url=... | command=...)`; see the module doc.

    Knobs: url or command (a list, or one string split on whitespace; `{port}` is replaced),
    cwd and env (the command's working directory and extra environment), timeout_s (per
    server reply), start_timeout_s, keep_alive_s, action_field and action_extra (the text
    action), tool_format, instructions, observation_fields, components_field, max_turns,
    reset_kwargs (extra fields of the reset message)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        command: str | Sequence[str] | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        keep_alive_s: float = 10.0,
        action_field: str | None = None,
        action_extra: Mapping[str, Any] | None = None,
        tool_format: str = "brackets",
        instructions: str = _INSTRUCTIONS,
        observation_fields: Sequence[str] | None = None,
        components_field: str = "rubric_components",
        max_turns: int = 20,
        reset_kwargs: Mapping[str, Any] | None = None,
        max_action_chars: int = 4096,
        max_observation_chars: int = 8192,
        render_mode: str | None = None,
    ):
        super().__init__(max_action_chars=max_action_chars, max_observation_chars=max_observation_chars)
        if render_mode is not None:
            raise ValueError(f"OpenEnvEnv has no render modes, got render_mode={render_mode!r}")
        if (url is None) == (command is None):
            raise ValueError("OpenEnvEnv takes a server's url or a command that starts one, exactly one")
        argv = tuple(command.split() if isinstance(command, str) else command or ())
        if command is not None and (not argv or not all(isinstance(a, str) and a for a in argv)):
            raise ValueError(f"OpenEnvEnv command must be a non-empty list of strings, got {command!r}")
        for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"OpenEnvEnv {name} must be a positive number, got {value!r}")
        if not isinstance(keep_alive_s, int | float) or keep_alive_s < 0:
            raise ValueError(f"OpenEnvEnv keep_alive_s must be >= 0, got {keep_alive_s!r}")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        self.format = get_format(tool_format)
        self.url = url
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.keep_alive_s = float(keep_alive_s)
        self.action_field = action_field
        self.action_extra = dict(action_extra or {})
        self.instructions = instructions
        self.observation_fields = list(observation_fields) if observation_fields is not None else None
        self.components_field = components_field
        self.max_turns = max_turns
        self.reset_kwargs = dict(reset_kwargs or {})
        self._max_action_chars, self._max_observation_chars = max_action_chars, max_observation_chars
        self._key: tuple[Any, ...] | None = None
        self._shared: _Shared | None = None
        self._finalizer: weakref.finalize | None = None
        if argv:
            self._key = (argv, cwd, tuple(sorted((env or {}).items())))
            self._shared = _acquire(self._key)
            # an env dropped without close() lets go of the server when it is collected
            self._finalizer = weakref.finalize(self, _release, self._key, self._shared, self.keep_alive_s)
            self._finalizer.atexit = False  # at exit, _stop_all stops every server
        self.label = " ".join(argv) if argv else str(url)
        self._client: GenericEnvClient | None = None
        self._server: _Server | None = None
        self.tools: dict[str, Tool] | None = None  # listed at the first reset (None: not yet)
        self._system_prompt = ""
        self._question = ""
        self._done = True
        self._closed = False

    # ---- the session -------------------------------------------------------------------------

    def _error(self, what: str, exc: BaseException | None = None) -> OpenEnvServerError:
        why = ""
        if exc is not None:
            why = (
                f" ({type(exc).__name__}: {_one_line(str(exc), 300)})"
                if str(exc)
                else f" ({type(exc).__name__})"
            )
        if self._server is not None and not self._server.alive:
            why += f"; the server exited with code {self._server.process.returncode}"
        return OpenEnvServerError(_one_line(f"OpenEnv server `{self.label}`: {what}{why}", 1000))

    def _at_capacity(self, exc: BaseException) -> OpenEnvServerError:
        return self._error(
            "refused a session: it has as many open as it allows (its max_concurrent_envs); run at "
            "most that many episodes at once (rollout.max_concurrent_episodes) or let it allow more",
            exc,
        )

    def _drop_session(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                _Loop.run(client.close(), 5.0)

    def _session(self, fresh: bool = True) -> GenericEnvClient:
        """The env's session; with `fresh` (a reset) one is opened (starting the server when it
        is not running) if there is none, else its loss mid-episode is an error."""
        if self._closed:
            raise RuntimeError("OpenEnvEnv: used after close()")
        if self._client is not None and (self._server is None or self._server.alive):
            return self._client
        if not fresh:
            lost = self._client is not None
            self._drop_session()
            raise self._error("the episode's session is lost" if lost else "the episode has no session")
        self._drop_session()
        if self._shared is not None and self._key is not None:
            self._server = _running(self._shared, self._key, self.start_timeout_s)
            url = self._server.url
        else:
            url = str(self.url)
        client = GenericEnvClient(url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s)
        try:
            _Loop.run(client.connect(), self.timeout_s + 5)
        except TimeoutError:
            raise self._error(f"no session opened within {self.timeout_s:g} s") from None
        except Exception as exc:
            raise self._error("cannot open a session", exc) from None
        self._client = client
        return client

    def _request(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """One message of the session and its checked reply: {observation, reward, done}."""
        client = self._session(fresh=kind == "reset")
        try:
            reply = _Loop.run(_exchange(client, {"type": kind, "data": data}), self.timeout_s + 5)
        except TimeoutError:
            self._drop_session()
            raise self._error(f"did not answer a {kind} within {self.timeout_s:g} s") from None
        except Exception as exc:
            self._drop_session()
            if _AT_CAPACITY in str(exc):
                raise self._at_capacity(exc) from None
            raise self._error(f"{kind} failed", exc) from None
        payload = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(reply, dict) or reply.get("type") != "observation" or not isinstance(payload, dict):
            self._drop_session()
            raise self._error(f"answered a {kind} with no observation: {_one_line(repr(reply), 200)}")
        observation, reward, done = payload.get("observation"), payload.get("reward"), payload.get("done")
        reward_ok = reward is None or (
            isinstance(reward, int | float) and not isinstance(reward, bool) and math.isfinite(reward)
        )
        if not isinstance(observation, dict) or not reward_ok or not isinstance(done, bool):
            self._drop_session()
            raise self._error(
                f"answered a {kind} with an unreadable observation: {_one_line(repr(payload), 200)}"
            )
        return payload

    def _list_tools(self) -> dict[str, Tool]:
        """The server's MCP tools as Tools ({} for a server without them)."""
        client = self._session()
        try:
            reply = _Loop.run(
                _exchange(client, {"type": "step", "data": {"type": "list_tools"}}), self.timeout_s + 5
            )
        except RuntimeError as exc:
            if _AT_CAPACITY in str(exc):
                self._drop_session()
                raise self._at_capacity(exc) from None
            if str(exc).startswith("Server error"):  # the server's action type is no MCP action
                return {}
            self._drop_session()
            raise self._error("list_tools failed", exc) from None
        except TimeoutError:
            self._drop_session()
            raise self._error(f"did not answer list_tools within {self.timeout_s:g} s") from None
        except Exception as exc:
            self._drop_session()
            raise self._error("list_tools failed", exc) from None
        observation = (reply.get("data") or {}).get("observation") if isinstance(reply, dict) else None
        listed = observation.get("tools") if isinstance(observation, dict) else None
        if not isinstance(listed, list):
            return {}
        tools: dict[str, Tool] = {}
        for spec in listed:
            try:
                name = str(spec["name"])
                description = " ".join(str(spec.get("description") or "").split("\n\n")[0].split())
                schema = spec.get("input_schema") or spec.get("inputSchema") or {"type": "object"}
                tool = Tool.from_schema(
                    name,
                    description or f"The {name} tool.",
                    schema,
                    _Caller(self, name),
                    timeout_s=self.timeout_s,
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise self._error(
                    f"listed a tool toolgym cannot take ({_one_line(repr(spec), 200)})", exc
                ) from None
            tools[tool.name.upper()] = tool
        return tools

    # ---- TextEnv -----------------------------------------------------------------------------

    @property
    def system_prompt(self) -> str:
        return self._system_prompt

    @property
    def question(self) -> str:
        return self._question

    @property
    def answer(self) -> Any:
        return None

    @property
    def step_waits(self) -> bool:
        return True  # every step is a round trip to the server

    def oracle_actions(self) -> list[str]:
        raise NotImplementedError(
            "an OpenEnv server keeps no reference solution; record it with a model policy"
        )

    def malformed_action(self, action: str) -> str | None:
        return self.format.malformed(action) if self.tools else None

    def answer_action(self, answer: Any, tagged: bool = True) -> str:
        return str(answer)

    def mistaken_actions(self) -> tuple[str, ...]:
        return self.format.mistakes(list(self.tools.values())) if self.tools else ("",)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if options:
            raise ValueError(f"OpenEnvEnv.reset takes no options, got {sorted(options)}")
        self._done = True
        if self.tools is None:
            self.tools = self._list_tools()
            lines = [self.instructions.strip()]
            if self.tools:
                lines += self.format.describe(list(self.tools.values()), _FINISH)
            self._system_prompt = "\n".join(line for line in lines if line)
        data = {**self.reset_kwargs, "seed": int(self.np_random.integers(2**31))}
        payload = self._request("reset", data)
        self._question = self._text(payload["observation"])[: self._max_observation_chars]
        self._turn = 0
        self._tool_calls = 0
        self._errors = 0
        self._reward = 0.0
        self._parts = dict.fromkeys(self._reported_parts(payload["observation"]), 0.0)
        self._done = bool(payload["done"])
        info: dict[str, Any] = {"system_prompt": self._system_prompt}
        if self.tools and self.format.template_tools:
            info.update(
                instructions="\n".join([self.instructions.strip(), _FINISH]),
                tools=[t.spec for t in self.tools.values()],
            )
        info.update(question=self._question, answer=None, max_turns=self.max_turns)
        return self._question, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("OpenEnvEnv: step() after the episode ended (or before reset()); call reset()")
        if not isinstance(action, str):
            raise TypeError(f"action must be a str, got {type(action).__name__}")
        action = action[: self._max_action_chars]
        self._turn += 1
        self._step_reward = 0.0
        self._server_done = False
        info: dict[str, Any] = {}
        parsed = self.format.parse(action, None) if self.tools else None
        if parsed is not None and parsed.kind == CALLS:
            parts, results = [], []
            for call in parsed.calls or []:
                text = self._call(call)
                parts.append(self.format.result(call.name, call, text))
                results.append(text)
                if self._server_done:
                    break
            observation = self.format.join(parts)
            info["tool_results"] = results
        elif self.action_field is not None or not self.tools:
            payload = self._request("step", {**self.action_extra, (self.action_field or "message"): action})
            self._take(payload)
            observation = self._text(payload["observation"])
        else:
            self._errors += 1
            names = ", ".join(t.name for t in self.tools.values())
            reason = f" ({parsed.reason})" if parsed is not None and parsed.reason else ""
            observation = f"ERROR: no tool call{reason}. Call one of the tools: {names}."
        terminated = self._server_done
        truncated = not terminated and self._turn >= self.max_turns
        if terminated:
            info["end_reason"] = "answered"
        elif truncated:
            info["end_reason"] = "max_turns"
        self._done = terminated or truncated
        info.update(self._info())
        return observation[: self._max_observation_chars], self._step_reward, terminated, truncated, info

    def _call(self, call: ParsedCall) -> str:
        """One tool call: checked, sent as a call_tool step; its result or error as text."""
        self._tool_calls += 1
        assert self.tools is not None
        tool = self.tools.get(call.name.upper()) if call.error is None else None
        if call.error is not None:
            self._errors += 1
            return call.message or f"ERROR: {call.error}"
        if tool is None:
            self._errors += 1
            return self.format.unknown_tool_text(call, list(self.tools.values()))
        try:
            arguments, strict = self.format.arguments(tool, call)
            return result_text(tool(arguments, strict=strict).content)
        except ValueError as wrong:
            self._errors += 1
            return f"ERROR: {wrong}"
        except ToolCallError as refused:
            self._errors += 1
            return str(refused)

    def _remote_call(self, name: str, arguments: dict[str, Any]) -> str:
        payload = self._request("step", {"type": "call_tool", "tool_name": name, "arguments": arguments})
        self._take(payload)
        observation = payload["observation"]
        error = observation.get("error")
        if isinstance(error, dict) and error:
            kind = {"invalid_args": "bad_arguments", "timeout": "tool_timeout"}.get(
                str(error.get("error_type"))
            )
            raise ToolCallError(kind or "tool_error", f"ERROR: {error.get('message', 'the call failed')}")
        result = observation.get("result")
        text = _call_result_text(result)
        if isinstance(result, dict) and result.get("is_error"):
            raise ToolError(text or f"{name} failed")
        return text

    def _take(self, payload: dict[str, Any]) -> None:
        """A server step's reward, done and rubric parts."""
        reward = float(payload["reward"] or 0.0)
        self._step_reward += reward
        self._reward += reward
        self._server_done = self._server_done or payload["done"]
        for name, value in self._reported_parts(payload["observation"]).items():
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                self._parts[name] = self._parts.get(name, 0.0) + float(value)

    def _reported_parts(self, observation: dict[str, Any]) -> dict[str, Any]:
        """The rubric parts an observation reports, by component name."""
        parts = observation.get(self.components_field)
        if not isinstance(parts, dict):
            return {}
        return {str(name).replace("/", ".") or "part": value for name, value in parts.items()}

    def _info(self) -> dict[str, Any]:
        components = dict(self._parts)
        components["reward"] = components.get("reward", 0.0) + self._reward - sum(self._parts.values())
        return {
            "reward_components": components,
            "turn": self._turn,
            "metrics": {
                "server_reward": self._reward,
                "tool_calls": float(self._tool_calls),
                "env_errors": float(self._errors),
            },
        }

    def _text(self, observation: dict[str, Any]) -> str:
        names = self.observation_fields if self.observation_fields is not None else list(observation)
        fields = [
            (name, observation.get(name))
            for name in names
            if name != self.components_field and not _empty(observation.get(name))
        ]
        if "tool_name" in observation and "result" in observation:  # an MCP observation
            fields = [
                (n, _call_result_text(v) if n == "result" else v) for n, v in fields if n != "tool_name"
            ]
        if len(fields) == 1 and isinstance(fields[0][1], str):
            return fields[0][1]
        return "\n".join(f"{name}: {_shown(value)}" for name, value in fields)

    def abandon(self) -> tuple[float, dict[str, Any]]:
        """The runner stopped the episode: nothing more to add (the server's rewards are in)."""
        if self._done:
            raise RuntimeError("OpenEnvEnv: abandon() after the episode ended (or before reset())")
        self._done = True
        return 0.0, self._info()

    def close(self) -> None:
        """End the session; a started server is released (stopped after keep_alive_s when no
        other env holds it)."""
        if self._closed:
            return
        self._closed = True
        self._drop_session()
        if self._shared is not None:
            self._shared = None
            if self._finalizer is not None:
                self._finalizer()  # _release, once
        super().close()


class _Caller:
    """A tool's call: one call_tool step of its env's session."""

    __slots__ = ("env", "name")

    def __init__(self, env: OpenEnvEnv, name: str):
        self.env, self.name = env, name

    def __call__(self, **arguments: Any) -> str:
        return self.env._remote_call(self.name, arguments)
