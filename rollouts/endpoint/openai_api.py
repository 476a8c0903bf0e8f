"""The OpenAI wire format the endpoint speaks: request bodies checked field by field, errors in
OpenAI's shape, chat messages normalised for matching, and the model's JSON tool calls as
`tool_calls`.

Requests are decoded with msgspec into Structs that forbid unknown fields, so a typo (`max_token`)
or a wrong type (`"n": "2"`) is a 400 whose message names the field, never a silent default.
Errors are `{"error": {"message", "type", "param", "code"}}` as OpenAI sends them; the `openai`
client raises them as `BadRequestError` etc. with that message.

Tool calls: the model writes JSON `<tool_call>` blocks (envs/tools/call_formats.py, the "json" format);
a reply whose blocks all parse becomes an assistant message with `tool_calls` (ids
`call_<conversation turn>_<i>`) and the text outside the blocks as `content` (None when empty);
a reply with a malformed block is returned as plain content (the agent sees what the model
wrote). An assistant message sent back is matched to what was sampled by its content and its
calls' names and (parsed) arguments, not by ids or JSON spacing.

Streaming: `stream_chunks` turns a finished chat completion into the SSE events OpenAI streams.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from ...envs.tools.call_formats import CALLS, get_format

_JSON_CALLS = get_format("json")
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered as OpenAI does: HTTP `status` and the `error` object."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields both endpoints take. `conversation_id` (an `extra_body` field) names the capture."""

    model: str = ""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False  # null is false, as OpenAI reads it
    user: str | None = None
    conversation_id: str | None = None
    presence_penalty: float | None = None  # accepted only as 0 (the sampler has no penalties)
    frequency_penalty: float | None = None


class ChatCompletionRequest(_Request, kw_only=True, forbid_unknown_fields=True):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False  # null is false
    top_logprobs: int | None = None
    stream_options: dict[str, Any] | None = None


class CompletionRequest(_Request, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool | None = False  # null is false
    # vLLM's extension: each prompt position's logprob and the top k (prompt_logprobs.py)
    prompt_logprobs: int | None = None


def decode_request(body: bytes, kind: type[_Request]) -> Any:
    """`body` as a `kind`, or an APIError naming what is wrong (bad JSON, unknown field, type)."""
    if not body.strip():
        raise APIError("the request body is empty: send a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        if param is None and "missing required field `" in text:  # at the top level: name the field
            param = text.split("missing required field `", 1)[1].split("`", 1)[0]
        if "unknown field" in text:
            field = text.split("`")[1] if "`" in text else ""
            raise APIError(f"unrecognized request argument supplied: {field} ({text})", param=field) from None
        raise APIError(f"invalid request: {text}", param=param) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # bytes that are not UTF-8 are not JSON
        raise APIError(f"the request body is not valid JSON ({exc})") from None


def check_common(request: _Request, max_n: int) -> None:
    """The checks both endpoints share; APIError naming the parameter."""
    if not 1 <= request.n <= max_n:
        raise APIError(f"n must be between 1 and {max_n}, got {request.n}", param="n")
    if request.temperature is not None and not 0 <= request.temperature <= 2:
        raise APIError(f"temperature must be between 0 and 2, got {request.temperature}", param="temperature")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise APIError(f"top_p must be in (0, 1], got {request.top_p}", param="top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            raise APIError(f"{name} is not supported (only 0)", param=name)
    if request.seed is not None and request.seed < 0:
        raise APIError(f"seed must be >= 0, got {request.seed}", param="seed")
    stops = stop_strings(request.stop)
    if len(stops) > 4 or any(not s for s in stops):
        raise APIError("stop must be up to 4 non-empty strings", param="stop")


def stop_strings(stop: str | list[str] | None) -> list[str]:
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def requested_max_tokens(request: Any) -> int | None:
    """max_completion_tokens (chat) or max_tokens; APIError when below 1."""
    value = getattr(request, "max_completion_tokens", None)
    name = "max_completion_tokens"
    if value is None:
        value, name = request.max_tokens, "max_tokens"
    if value is not None and value < 1:
        raise APIError(f"{name} must be >= 1, got {value}", param=name)
    return value


def check_chat(request: ChatCompletionRequest) -> None:
    """Chat-only checks: tool_choice, logprobs, stream_options, tools' shape (messages:
    `normalise_messages`)."""
    if request.stream_options is not None:
        if not request.stream:
            raise APIError(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                param="stream_options",
            )
        unknown = sorted(set(request.stream_options) - {"include_usage"})
        if unknown or not isinstance(request.stream_options.get("include_usage", False), bool):
            raise APIError(
                f"stream_options takes only include_usage (a boolean), got {request.stream_options!r}",
                param="stream_options",
            )
    choice = request.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        raise APIError(
            f"tool_choice {choice!r} is not supported: use 'auto' or 'none' (the model decides when to call)",
            param="tool_choice",
        )
    if request.top_logprobs:
        raise APIError(
            "top_logprobs above 0 is not supported: the sampler reports the log-probability of the "
            "token it sampled (logprobs=true)",
            param="top_logprobs",
        )
    for i, spec in enumerate(request.tools or []):
        function = spec.get("function")
        if (
            spec.get("type") != "function"
            or not isinstance(function, Mapping)
            or not isinstance(function.get("name"), str)
        ):
            raise APIError(
                f'tools[{i}]: each tool is {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}',
                param=f"tools[{i}]",
            )
        parameters = function.get("parameters")
        if parameters is not None:
            # The serve extra's; imported here so that reading recordings (capture.py's names)
            # needs no extra.
            import jsonschema
            import jsonschema.validators

            try:
                if not isinstance(parameters, dict):
                    raise jsonschema.SchemaError(
                        f"a JSON Schema is an object, got {type(parameters).__name__}"
                    )
                jsonschema.validators.validator_for(parameters).check_schema(parameters)
            except jsonschema.SchemaError as exc:
                raise APIError(
                    f"Invalid schema for function {function['name']!r}: {exc.message}",
                    param=f"tools[{i}].function.parameters",
                    code="invalid_function_parameters",
                ) from None


def message_text(content: Any) -> str:
    """A chat message's content as text: a str, None (""), or a list of {"type": "text", "text":
    ...} parts joined. ValueError for anything else (an image part, a number). The endpoint's
    requests and rollouts/recording/chat_jsonl.py's imported lines both read content with it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise ValueError("a content part that is not text: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"content must be a string, a list of text parts or null, got {type(content).__name__}")


def _text(content: Any, where: str) -> str:
    try:
        return message_text(content)
    except ValueError as exc:
        raise APIError(f"{where}.content: {exc}", param=f"{where}.content") from None


def _arguments(raw: Any, where: str) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise APIError(f"{where}.function.arguments is not valid JSON ({exc})", param=where) from None
    return raw


def check_tool_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """A `tool` message answers a call: it follows an assistant message with tool_calls (or
    another tool message after one), as OpenAI requires; APIError naming the message otherwise."""
    answering = False
    for i, message in enumerate(messages):
        if message["role"] == "tool" and not answering:
            raise APIError(
                f"messages[{i}]: a message with role 'tool' must answer a preceding assistant message "
                "with 'tool_calls'",
                param=f"messages[{i}].role",
            )
        answering = bool(message.get("tool_calls")) or (answering and message["role"] == "tool")


def normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as plain dicts {role, content (str), tool_calls?: [(name, arguments)], name?}:
    the form that is compared (capture matching) and rendered. APIError names a bad message."""
    if not messages:
        raise APIError("messages must hold at least one message", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role not in ROLES:
            raise APIError(
                f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role"
            )
        item: dict[str, Any] = {"role": "system" if role == "developer" else role}
        item["content"] = _text(message.get("content"), where)
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise APIError(
                    f"{where}.tool_calls: only an assistant message has a list of them", param=where
                )
            parsed = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                    raise APIError(
                        f"{where}.tool_calls[{j}] needs function.name", param=f"{where}.tool_calls"
                    )
                parsed.append(
                    (function["name"], _arguments(function.get("arguments"), f"{where}.tool_calls[{j}]"))
                )
            item["tool_calls"] = parsed
        out.append(item)
    return out


def assistant_text(message: Mapping[str, Any]) -> str:
    """What the model would have written for an assistant message: its content, then its calls
    as JSON `<tool_call>` blocks (as the "json" tool-call format writes them)."""
    blocks = [
        "<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>"
        for n, a in message.get("tool_calls", ())
    ]
    return "\n".join([message["content"], *blocks] if message["content"] else blocks)


def parse_reply(text: str, tools_enabled: bool) -> tuple[str | None, list[tuple[str, Any]]]:
    """(content, calls) of a sampled reply: JSON blocks become calls when every block parses."""
    if not tools_enabled or "<tool_call>" not in text:
        return text, []
    parsed = _JSON_CALLS.parse(text, None)
    if parsed.kind != CALLS or not parsed.calls or any(c.error for c in parsed.calls):
        return text, []
    content = text
    for block in ("<tool_call>", "</tool_call>"):
        content = content.replace(block, "\x00")
    pieces = content.split("\x00")
    outside = "".join(pieces[0::2]).strip()  # text outside the blocks
    return (outside or None), [(c.name, c.arguments) for c in parsed.calls]


def reply_message(content: str | None, calls: list[tuple[str, Any]]) -> dict[str, Any]:
    """The normalised form of a reply (what `normalise_messages` gives when it comes back)."""
    item: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        item["tool_calls"] = calls
    return item


def tool_calls_json(calls: list[tuple[str, Any]], prefix: str) -> list[dict[str, Any]] | None:
    if not calls:
        return None
    return [
        {
            "id": f"call_{prefix}_{i}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }
        for i, (name, arguments) in enumerate(calls)
    ]


FinishReason = Literal["stop", "length", "tool_calls"]


def logprobs_json(tokens: Sequence[int], logprobs: Sequence[float], piece: Any) -> dict[str, Any]:
    """OpenAI's `logprobs.content`: per sampled token its text, log-probability and bytes."""
    content = []
    for token, logprob in zip(tokens, logprobs, strict=True):
        text = piece(token)
        content.append(
            {"token": text, "logprob": float(logprob), "bytes": list(text.encode()), "top_logprobs": []}
        )
    return {"content": content}


_PIECES = re.compile(r"\s*\S+|\s+")  # word-sized delta pieces; joined they are the text exactly


def _pieces(text: str) -> list[str]:
    return _PIECES.findall(text) or [text]


def stream_chunks(response: Mapping[str, Any], include_usage: bool) -> list[bytes]:
    """A finished `chat.completion` as the SSE events OpenAI streams it: per choice a first chunk
    with the role, its content in word-sized deltas (the choice's logprobs on the first of them),
    each tool call as one delta with its index, id, type and name (arguments "") and then its
    arguments in fragments, and a last chunk with the finish reason; with `include_usage` every
    chunk has `"usage": null` and one more chunk (no choices) has the usage; then `[DONE]`. The
    deltas concatenate to the response's message exactly (the `openai` client's accumulated stream
    is the non-streamed completion)."""
    head = {
        "id": response["id"],
        "object": "chat.completion.chunk",
        "created": response["created"],
        "model": response["model"],
    }
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    events: list[bytes] = []

    def emit(choice: dict[str, Any] | None, **more: Any) -> None:
        chunk = {**head, "choices": [] if choice is None else [choice], **extra, **more}
        events.append(b"data: " + msgspec.json.encode(chunk) + b"\n\n")

    def delta(
        index: int, fields: dict[str, Any], logprobs: Any = None, finish: str | None = None, **more: Any
    ) -> None:
        emit({"index": index, "delta": fields, "logprobs": logprobs, "finish_reason": finish}, **more)

    choices = response["choices"]
    for choice in choices:
        index, message = choice["index"], choice["message"]
        logprobs = choice["logprobs"]
        delta(index, {"role": "assistant", "content": None if message["content"] is None else ""})
        for piece in _pieces(message["content"]) if message["content"] else []:
            delta(index, {"content": piece}, logprobs)
            logprobs = None
        for k, call in enumerate(message.get("tool_calls") or []):
            function = call["function"]
            opening = {"name": function["name"], "arguments": ""}
            opened = {"index": k, "id": call["id"], "type": "function", "function": opening}
            delta(index, {"tool_calls": [opened]}, logprobs)
            logprobs = None
            for fragment in _pieces(function["arguments"]):
                delta(index, {"tool_calls": [{"index": k, "function": {"arguments": fragment}}]})
        # logprobs here only for an empty reply; the endpoint's own fields on the very last one
        own = {"toolgym": response["toolgym"]} if "toolgym" in response and choice is choices[-1] else {}
        delta(index, {}, logprobs, choice["finish_reason"], **own)
    if include_usage:
        emit(None, usage=response["usage"])
    events.append(b"data: [DONE]\n\n")
    return events
