"""The OpenAI-compatible endpoint over a policy (torch engine or vLLM): FastAPI on uvicorn.

    POST /v1/chat/completions   messages, tools, tool_choice (auto | none), temperature, top_p,
                                max_tokens / max_completion_tokens, n, seed, stop, logprobs,
                                stream, stream_options.include_usage
    POST /v1/completions        a raw-text or token-id prompt; `prompt_logprobs: k` (vLLM's
                                extension, prompt_logprobs.py) adds each prompt position's
                                logprob, with max_tokens 0 for those alone
    GET  /v1/models             the one model served, with `toolgym.tokenizer_fingerprint` (an
                                endpoint teacher checks it is the student's tokenizer)
    POST /toolgym/conversations/{id}/end   {"reward": float, "components": {...}}: finish a
                                capture (the agent runner finishes its own in process)

`PolicyServer` is the in-process object: `async with PolicyServer(policy, renderer) as server:`
serves on 127.0.0.1 and a free port (`server.base_url` is what `openai.AsyncOpenAI(base_url=...)`
takes) from the caller's event loop, which is where the torch engine then computes; `run()`
serves until interrupted (`toolgym serve`). Every request is captured (rollouts/endpoint/capture.py)
under its conversation id: the `X-Conversation-Id` header, else the `conversation_id` body field
(the client's `extra_body`), else the API key; a request with none of them is served and not
kept.

Sampling: `EndpointConfig.sampling` fixes temperature/top_p/top_k for every request (training:
the trainer computes logprobs at the config's temperature, so an agent's own temperature would
make its ratio wrong); without it the request's values are used. Token limits: a request's
max_tokens is capped by `max_tokens_per_turn` (its default too), the conversation's
`max_tokens_per_episode` left and the context room; a prompt with no room is a 400
`context_length_exceeded`, a spent budget a 400 `token_budget_exhausted`. A registered
conversation's turns are seeded from its `CaptureInfo.sampling_seed` (and the request's seed), so
its G samples differ and a rerun repeats them.

Streaming (`stream=true`, chat only): the request takes the non-streamed path unchanged (render,
sample, cut, parse tool calls, capture) and its finished answer is then sent as SSE
`chat.completion.chunk` events (openai_api.stream_chunks), so a streamed call is captured exactly as
the same call non-streamed, and its deltas join to the same message. The deltas come once the
whole reply is sampled, not as tokens arrive: the Policy interface returns finished Completions
only. Errors are therefore plain HTTP errors before any event (a 400 `context_length_exceeded`
reaches the client as `BadRequestError` as without streaming). A client that hangs up once events
are flowing changes nothing: its turn is already captured and its conversation stays open (and is
recorded when it ends); one that hangs up while its reply is sampled is a disconnect as below.

A client that disconnects mid-generation cancels its request (the engine frees the slot) and
breaks its conversation's capture; generation errors do the same. Shutting down finishes every
open conversation as incomplete (recorded when a writer is set). Measurements of the endpoint's
overhead: bench/RESULTS.md, 'bench/serve.py'.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from ...agents.chat import Renderer
from ...agents.errors import ContextOverflowError
from ...agents.harmony import HarmonyRenderer
from ...agents.policy import Policy
from ...agents.tokenizer import RELEASE_GIL_CHARS, tokenizer_fingerprint
from ...agents.types import Completion, SamplingParams
from ..episode.config import sampling_seed
from ..recording.format import RecordingWriter
from ..types import PolicySampling, StopReason
from .capture import CaptureInfo, CaptureStore, Choice, Conversation, raw_tokens
from .hosts import host_allowed
from .openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_chat,
    check_common,
    check_tool_messages,
    decode_request,
    logprobs_json,
    normalise_messages,
    parse_reply,
    reply_message,
    requested_max_tokens,
    stop_strings,
    stream_chunks,
    tool_calls_json,
)
from .prompt_logprobs import MAX_PROMPT_LOGPROBS, PromptLogprobs, PromptScorer

CONVERSATION_HEADER = "x-conversation-id"
KEEP_ALIVE_S = 300  # longer than any client keeps an idle connection


class EndpointConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"  # loopback: the endpoint has no authentication
    port: int = 0  # 0: a free port
    model_name: str = "toolgym-policy"  # what /v1/models lists (any `model` is accepted)
    max_n: int = 16
    max_tokens_per_turn: int = 256
    max_tokens_per_episode: int | None = None
    context_length: int | None = None  # None: the policy's
    sampling: PolicySampling | None = None  # fixed sampling for every request (training)
    # Requests wait at a gate before they reach the policy: it opens once no request has arrived
    # for `gather_quiet_s` (or after `gather_max_s`), so that many agents' requests arriving in a
    # burst start in one prefill, as the env runner's do (bench/RESULTS.md, bench/serve.py).
    # 0 turns the gate off.
    gather_quiet_s: float = 0.001
    gather_max_s: float = 0.02

    def __post_init__(self) -> None:
        for name in ("max_n", "max_tokens_per_turn"):
            if getattr(self, name) < 1:
                raise ValueError(f"EndpointConfig.{name} must be >= 1, got {getattr(self, name)}")


class EndpointStats(msgspec.Struct):
    requests: int = 0
    errors: int = 0  # 4xx/5xx answers
    disconnects: int = 0  # clients gone mid-generation


class _KnownHostsOnly:
    """ASGI middleware: a request whose Host header is not this server's gets 400 (DNS
    rebinding, hosts.py). Plain ASGI, so an answered request pays one header lookup."""

    def __init__(self, app: Any, bind_host: str, stats: EndpointStats) -> None:
        self.app, self.bind_host, self.stats = app, bind_host, stats

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not host_allowed(host, self.bind_host):
                self.stats.errors += 1
                what = f"Host {host!r} is not this server's (it answers {self.bind_host} and localhost)"
                await JSONResponse(APIError(what, code="invalid_host").body(), 400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers (an in-process server leaves Ctrl+C to its
    host program)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _ForegroundServer(uvicorn.Server):
    """uvicorn's server for `toolgym serve`: Ctrl+C and SIGTERM stop it gracefully, and the
    command then ends normally (uvicorn would raise the signal again after shutting down)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class _EventStream(Response):
    """`stream=true`'s answer: the SSE events of a finished completion, each sent as its own body
    part. A client gone meanwhile loses the rest (uvicorn drops what is sent after a disconnect);
    nothing waits on it."""

    def __init__(self, events: list[bytes]) -> None:  # no Response.__init__: no content-length
        self.status_code, self.background, self.events = 200, None, events
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class PolicyServer:
    """An OpenAI-compatible endpoint over `policy`, capturing conversations (module doc)."""

    def __init__(
        self,
        policy: Policy,
        renderer: Renderer,
        config: EndpointConfig | None = None,
        writer: RecordingWriter | None = None,
        scorer: PromptScorer | None = None,
    ) -> None:
        """`scorer`: what answers `prompt_logprobs` (None: such requests are refused)."""
        if isinstance(renderer, HarmonyRenderer):  # its calls are harmony messages, not tool-call text
            raise ValueError("the OpenAI endpoint does not speak harmony: it parses no harmony turns into tool_calls")
        self.policy, self.renderer, self.scorer = policy, renderer, scorer
        self.tokenizer_fingerprint = tokenizer_fingerprint(renderer.tokenizer)
        self.config = config or EndpointConfig()
        self.captures = CaptureStore(writer)
        self.stats = EndpointStats()
        known = [self.config.context_length, policy.max_seq_len]
        limits = [int(n) for n in known if isinstance(n, int)]
        self.context_length = min(limits) if limits else None
        self.app = self._build_app()
        self._gate: asyncio.Future[None] | None = None
        self._gate_task: asyncio.Future[None] | None = None
        self._last_arrival = 0.0
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:PORT/v1`: the OpenAI client's base_url."""
        return f"http://{self.config.host}:{self.port}/v1"

    # ---- lifecycle --------------------------------------------------------------------------

    def _socket(self) -> socket.socket:
        # IPPROTO_TCP given, not 0: asyncio sets TCP_NODELAY only on sockets that name it, and
        # without it every response waits for a delayed ACK (Nagle) before its last segment.
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        self.port = sock.getsockname()[1]
        return sock

    def _uvicorn(self, quiet: bool) -> uvicorn.Server:
        # Idle keep-alive connections are closed by the clients (httpx after 5 s, aiohttp after
        # 15 s), never by the server: a server closing one (uvicorn's default, after 5 s) races a
        # client reusing it, whose request then fails with a connection error.
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        return _Server(config) if quiet else _ForegroundServer(config)

    async def start(self) -> None:
        """Serve from the running event loop; returns once the socket accepts connections."""
        if self._task is not None:
            return
        self._server = server = self._uvicorn(quiet=True)
        self._task = asyncio.create_task(server.serve(sockets=[self._socket()]))
        while not server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the endpoint stopped while starting")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop serving (requests in flight get a short grace), then finish every open
        conversation as incomplete."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._server, self._task = None, None
        self.captures.close_all()

    async def __aenter__(self) -> PolicyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def run(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve until interrupted (Ctrl+C, SIGTERM), then close the captures: `toolgym serve`.
        `on_ready` gets the base URL once the port is bound."""

        async def serve() -> None:
            server = self._server = self._uvicorn(quiet=False)
            sock = self._socket()
            sock.listen(2048)  # connections made once on_ready has said where wait in the backlog
            if on_ready is not None:
                on_ready(self.base_url)
            try:
                await server.serve(sockets=[sock])
            finally:
                self.captures.close_all()

        asyncio.run(serve())

    # ---- HTTP -------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="toolgym endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        app.add_middleware(_KnownHostsOnly, bind_host=self.config.host, stats=self.stats)  # hosts.py

        @app.exception_handler(APIError)
        async def api_error(request: Request, exc: APIError) -> JSONResponse:
            self.stats.errors += 1
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
            self.stats.errors += 1
            what = f"{request.method} {request.url.path}: {exc.detail}"
            return JSONResponse(
                APIError(what, exc.status_code, code=str(exc.status_code)).body(), exc.status_code
            )

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            model = {
                "id": self.config.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "toolgym",
                "toolgym": {"tokenizer_fingerprint": self.tokenizer_fingerprint},
            }
            return {"object": "list", "data": [model]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            self.stats.requests += 1
            body = decode_request(await request.body(), ChatCompletionRequest)
            work = self._chat(body, self._conversation_id(request, body))
            if not body.stream:
                return await self._until_done(request, work)
            usage = bool((body.stream_options or {}).get("include_usage"))
            return await self._until_done(
                request, work, lambda answer: _EventStream(stream_chunks(answer, usage))
            )

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            self.stats.requests += 1
            body = decode_request(await request.body(), CompletionRequest)
            if body.stream:
                raise APIError(
                    "stream=true is supported on /v1/chat/completions only; send stream=false", param="stream"
                )
            return await self._until_done(request, self._complete(body, self._conversation_id(request, body)))

        @app.post("/toolgym/conversations/{conversation_id}/end")
        async def end(conversation_id: str, request: Request) -> dict[str, Any]:
            raw = await request.body()
            try:
                given = msgspec.json.decode(raw or b"{}", type=dict[str, Any])
                reward = float(given.get("reward", 0.0))
                components = {str(k): float(v) for k, v in dict(given.get("components") or {}).items()}
            except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError) as exc:
                raise APIError(f'the body is {{"reward": <number>, "components": {{...}}}} ({exc})') from None
            if conversation_id not in self.captures.open:  # nothing to record: an empty one would count
                raise APIError(
                    f"no open conversation {conversation_id!r} (never started, or ended already)",
                    404,
                    code="conversation_not_found",
                )
            trajectory = self.captures.finish(conversation_id, reward, components=components)
            return {
                "conversation_id": conversation_id,
                "turns": len(trajectory.transitions),
                "error": trajectory.error,
            }

        return app

    def _conversation_id(self, request: Request, body: Any) -> str | None:
        header = request.headers.get(CONVERSATION_HEADER)
        if header:
            return header
        if body.conversation_id:
            return body.conversation_id
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        return key or None

    async def _until_done(
        self,
        request: Request,
        work: Awaitable[dict[str, Any]],
        respond: Callable[[dict[str, Any]], Response] | None = None,
    ) -> Any:
        """`work`'s answer (JSON, or what `respond` makes of it), unless the client disconnects
        first: then it is cancelled."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                self.stats.disconnects += 1
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            return Response(status_code=499)
        if respond is not None:
            return respond(task.result())
        # Encoded here (msgspec), not by FastAPI's jsonable_encoder walking every field.
        return Response(msgspec.json.encode(task.result()), media_type="application/json")

    # ---- requests ---------------------------------------------------------------------------

    def _conversation(self, conversation_id: str | None) -> Conversation:
        if conversation_id is None:
            return Conversation("", CaptureInfo())  # served, not kept
        return self.captures.get(conversation_id)

    def _check_max_tokens(self, max_tokens: int | None) -> None:
        """A max_tokens beyond the context can never be sampled: refused, as OpenAI does."""
        if max_tokens is not None and self.context_length is not None and max_tokens > self.context_length:
            raise APIError(
                f"max_tokens is too large: {max_tokens}. This model's maximum context length is "
                f"{self.context_length} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def _params(
        self, body: Any, conversation: Conversation, prompt_length: int, max_tokens: int | None
    ) -> SamplingParams:
        config = self.config
        cap = (
            config.max_tokens_per_turn if max_tokens is None else min(max_tokens, config.max_tokens_per_turn)
        )
        if config.max_tokens_per_episode is not None:
            left = config.max_tokens_per_episode - conversation.sampled_tokens
            if left <= 0:
                conversation.limit = StopReason.MAX_TOKENS
                raise APIError(
                    f"the conversation has sampled its {config.max_tokens_per_episode} tokens "
                    "(max_tokens_per_episode)",
                    code="token_budget_exhausted",
                )
            cap = min(cap, left)
        if self.context_length is not None:
            room = self.context_length - prompt_length
            if room <= 0:
                conversation.limit = StopReason.CONTEXT_OVERFLOW
                raise APIError(
                    f"This model's maximum context length is {self.context_length} tokens; the prompt "
                    f"has {prompt_length} tokens",
                    param="messages",
                    code="context_length_exceeded",
                )
            cap = min(cap, room)
        fixed = config.sampling
        seed = body.seed
        if conversation.info.sampling_seed is not None:
            extra = 0 if seed is None else seed + 1
            seed = sampling_seed(conversation.info.sampling_seed, conversation.turns, extra)
        return SamplingParams(
            max_tokens=cap,
            temperature=fixed.temperature
            if fixed
            else (1.0 if body.temperature is None else body.temperature),
            top_p=fixed.top_p if fixed else (1.0 if body.top_p is None else body.top_p),
            top_k=fixed.top_k if fixed else 0,
            n=body.n,
            stop_token_ids=self.renderer.stop_token_ids,
            seed=seed,
        )

    async def _generate(
        self, conversation: Conversation, prompt: list[int], params: SamplingParams
    ) -> list[Completion]:
        started = time.perf_counter()
        try:
            await self._gather()
            return await self.policy.generate([prompt], params)
        except asyncio.CancelledError:
            conversation.broken = "ClientDisconnected: the client went away mid-generation"
            raise
        except ContextOverflowError as exc:
            conversation.limit = StopReason.CONTEXT_OVERFLOW
            raise APIError(str(exc), param="messages", code="context_length_exceeded") from None
        except Exception as exc:
            conversation.broken = f"{type(exc).__name__}: {exc}"
            raise APIError(
                f"generation failed: {type(exc).__name__}: {exc}", 500, type="server_error"
            ) from None
        finally:
            conversation.generate_s += time.perf_counter() - started

    async def _gather(self) -> None:
        """Wait at the gate (see EndpointConfig): one task per burst watches for quiet."""
        if self.config.gather_quiet_s <= 0:
            return
        self._last_arrival = time.perf_counter()
        if self._gate is None:
            self._gate = asyncio.get_running_loop().create_future()
            self._gate_task = asyncio.ensure_future(self._open_gate(self._gate))
        await asyncio.shield(self._gate)

    async def _open_gate(self, gate: asyncio.Future[None]) -> None:
        opened = time.perf_counter()
        quiet, longest = self.config.gather_quiet_s, self.config.gather_max_s
        while True:
            await asyncio.sleep(0)  # a loop turn: sockets are read, handlers run up to the gate
            now = time.perf_counter()
            if now - self._last_arrival >= quiet or now - opened >= longest:
                break
        self._gate = None
        gate.set_result(None)

    def _cut(self, completion: Completion, stops: list[str]) -> tuple[Completion, str]:
        """The completion up to the token that completes the first stop string, and its text
        before that string (the sampled tokens stay verbatim: a prefix of what was sampled)."""
        decode = self.renderer.decode
        text = decode(completion.tokens, skip_special_tokens=True)
        if not stops or not any(s in text for s in stops):
            return completion, text
        for k in range(1, len(completion.tokens) + 1):
            part = decode(completion.tokens[:k], skip_special_tokens=True)
            at = min((part.find(s) for s in stops if s in part), default=-1)
            if at >= 0:
                cut = Completion(
                    completion.tokens[:k],
                    completion.logprobs[:k],
                    "stop",
                    part[:at],
                    completion.policy_version,
                )
                return cut, part[:at]
        return completion, text

    def _piece(self, token: int) -> str:
        return self.renderer.decode([token])

    def _usage(self, prompt: list[int], completions: list[Completion]) -> dict[str, int]:
        sampled = sum(len(c.tokens) for c in completions)
        return {
            "prompt_tokens": len(prompt),
            "completion_tokens": sampled,
            "total_tokens": len(prompt) + sampled,
        }

    async def _chat(self, body: ChatCompletionRequest, conversation_id: str | None) -> dict[str, Any]:
        check_common(body, self.config.max_n)
        check_chat(body)
        max_tokens = requested_max_tokens(body)
        messages = normalise_messages(body.messages)
        check_tool_messages(messages)
        self._check_max_tokens(max_tokens)
        tools_enabled = bool(body.tools) and body.tool_choice != "none"
        conversation = self._conversation(conversation_id)
        async with conversation.lock:
            render = functools.partial(conversation.chat_prompt, self.renderer, messages, body.tools or None)
            # long text is tokenized with the GIL released (agents/tokenizer.py): on a worker thread
            # then, one huge message does not stall every other request on the event loop
            if sum(len(m["content"]) for m in messages) > RELEASE_GIL_CHARS:
                prompt, observation_tokens, restart = await asyncio.to_thread(render)
            else:
                prompt, observation_tokens, restart = render()
            params = self._params(body, conversation, len(prompt), max_tokens)
            completions = await self._generate(conversation, prompt, params)
            stops = stop_strings(body.stop)
            turn = conversation.turns
            choices, out = [], []
            for i, sampled in enumerate(completions):
                completion, text = self._cut(sampled, stops)
                completion.text = text
                content, calls = parse_reply(text, tools_enabled)
                choices.append(Choice(reply_message(content, calls), completion))
                message: dict[str, Any] = {"role": "assistant", "content": content}
                tool_calls = tool_calls_json(calls, f"{turn}_{i}")
                if tool_calls:
                    message["tool_calls"] = tool_calls
                finish = (
                    "tool_calls" if calls else ("length" if completion.finish_reason == "length" else "stop")
                )
                out.append(
                    {
                        "index": i,
                        "message": message,
                        "finish_reason": finish,
                        "logprobs": logprobs_json(completion.tokens, completion.logprobs, self._piece)
                        if body.logprobs
                        else None,
                    }
                )
            conversation.sampled(messages[-1]["content"], observation_tokens, restart, choices)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model or self.config.model_name,
            "choices": out,
            "usage": self._usage(prompt, [c.completion for c in choices]),
            "toolgym": {"conversation_id": conversation_id, "policy_version": completions[0].policy_version},
        }

    def _prompt_logprobs(self, body: CompletionRequest, prompt: list[int]) -> PromptLogprobs | None:
        """The request's `prompt_logprobs` of `prompt` (prompt_logprobs.py), None when not asked."""
        k = body.prompt_logprobs
        if k is None:
            return None
        if self.scorer is None:
            raise APIError(
                "prompt_logprobs is not supported by this endpoint (it serves no checkpoint to score with: "
                "`toolgym serve --policy DIR` does)",
                param="prompt_logprobs",
            )
        if not 0 <= k <= MAX_PROMPT_LOGPROBS:
            raise APIError(
                f"prompt_logprobs must be between 0 and {MAX_PROMPT_LOGPROBS}, got {k}",
                param="prompt_logprobs",
            )
        if self.context_length is not None and len(prompt) > self.context_length:
            raise APIError(
                f"This model's maximum context length is {self.context_length} tokens; the prompt "
                f"has {len(prompt)} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        try:
            return self.scorer.score(prompt, k)
        except ValueError as exc:  # a token outside the model's vocabulary
            raise APIError(f"prompt_logprobs: {exc}", param="prompt") from None
        except Exception as exc:
            raise APIError(
                f"prompt_logprobs failed: {type(exc).__name__}: {exc}", 500, type="server_error"
            ) from None

    def _check_prompt(self, body: CompletionRequest, vocabulary: bool = True) -> None:
        """`vocabulary`: token ids must be the tokenizer's (a prompt only scored is checked against
        the scoring model's vocabulary instead, as the checkpoint teacher does: a policy whose
        embedding is padded past its tokenizer can sample those ids)."""
        if body.echo:
            raise APIError("echo=true is not supported", param="echo")
        if body.logprobs is not None and not 0 <= body.logprobs <= 1:
            raise APIError(
                "logprobs must be 0 or 1: the sampler reports the sampled token's log-probability",
                param="logprobs",
            )
        if (
            vocabulary
            and isinstance(body.prompt, list)
            and any(not 0 <= t < self.renderer.vocab_size for t in body.prompt)
        ):
            raise APIError(f"prompt token ids must be in [0, {self.renderer.vocab_size})", param="prompt")
        if not body.prompt:
            raise APIError("prompt must not be empty", param="prompt")

    async def _complete(self, body: CompletionRequest, conversation_id: str | None) -> dict[str, Any]:
        check_common(body, self.config.max_n)
        if body.max_tokens == 0 and body.prompt_logprobs is not None:  # the prompt's logprobs alone
            return self._score_only(body)
        max_tokens = requested_max_tokens(body)
        self._check_max_tokens(max_tokens)
        self._check_prompt(body)
        conversation = self._conversation(conversation_id)
        async with conversation.lock:
            prompt, observation_tokens, restart = conversation.text_prompt(self.renderer, body.prompt)
            scored = self._prompt_logprobs(body, prompt)
            params = self._params(body, conversation, len(prompt), max_tokens)
            completions = await self._generate(conversation, prompt, params)
            stops = stop_strings(body.stop)
            choices, out = [], []
            for i, sampled in enumerate(completions):
                completion, text = self._cut(sampled, stops)
                completion.text = text
                choices.append(Choice(text, completion))
                logprobs = None
                if body.logprobs is not None:
                    logprobs = {
                        "tokens": [self._piece(t) for t in completion.tokens],
                        "token_logprobs": list(completion.logprobs),
                        "top_logprobs": None,
                        "text_offset": None,
                    }
                finish = "length" if completion.finish_reason == "length" else "stop"
                choice: dict[str, Any] = {
                    "index": i,
                    "text": text,
                    "finish_reason": finish,
                    "logprobs": logprobs,
                }
                if scored is not None:
                    choice["prompt_logprobs"] = scored
                out.append(choice)
            shown = body.prompt if isinstance(body.prompt, str) else ""
            conversation.sampled(shown, observation_tokens, restart, choices)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or self.config.model_name,
            "choices": out,
            "usage": self._usage(prompt, [c.completion for c in choices]),
        }

    def _score_only(self, body: CompletionRequest) -> dict[str, Any]:
        """max_tokens 0 with prompt_logprobs: the prompt's logprobs, nothing sampled or captured."""
        self._check_prompt(body, vocabulary=False)
        prompt = (
            list(body.prompt) if isinstance(body.prompt, list) else raw_tokens(self.renderer, body.prompt)
        )
        scored = self._prompt_logprobs(body, prompt)
        choice = {
            "index": 0,
            "text": "",
            "finish_reason": "length",
            "logprobs": None,
            "prompt_logprobs": scored,
        }
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or self.config.model_name,
            "choices": [choice] * body.n,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)},
        }
