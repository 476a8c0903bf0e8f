"""The model-client layer the scorers share: one JSON request to an OpenAI-compatible endpoint
(vLLM's server, `toolgym serve`, a provider's URL) on the standard library's HTTP client, so a
scorer that talks to an endpoint needs no package beyond toolgym's own.

`request_json(url, path, body, timeout=..., api_key=...)` sends a GET (body None) or a POST of
the JSON body to url + path, with the key (when given) as the bearer token, and returns the
decoded answer; every failure (a refused connection, a timeout, an error status, an answer that
is not JSON) raises EndpointError with one line naming the URL and the cause, and its HTTP status
(None when there was no answer), so a caller can tell a retryable failure from a refusal
(`retryable`). The on-policy distillation endpoint teacher (endpoint_teacher.py) and the judge
(judge.py) both use it.
"""

from __future__ import annotations

import contextlib
import urllib.error
import urllib.request
from typing import Any

import msgspec

# Statuses worth asking again: rate limits and the server's own failures.
RETRYABLE_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})


class EndpointError(RuntimeError):
    """A request to the endpoint failed; `str()` names the URL and the cause; `status` is the
    answer's HTTP status (None: no answer, e.g. refused or timed out)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def retryable(self) -> bool:
        """Whether asking again may succeed: no answer at all, or a status in RETRYABLE_STATUSES
        (a 4xx refusal such as a wrong key or an unknown model will not change)."""
        return self.status is None or self.status in RETRYABLE_STATUSES


def request_json(url: str, path: str, body: Any = None, *, timeout: float, api_key: str | None = None) -> Any:
    """GET url + path (body None) or POST the JSON `body` there; the decoded JSON answer
    (module doc; EndpointError on any failure)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else msgspec.json.encode(body)
    request = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return msgspec.json.decode(answer.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode("utf-8", "replace")
        with contextlib.suppress(Exception):  # OpenAI's error shape, else the body as text
            text = msgspec.json.decode(text)["error"]["message"]
        raise EndpointError(
            f"{url}{path}: HTTP {exc.code}: {' '.join(str(text).split())[:300]}", exc.code
        ) from None
    except (urllib.error.URLError, OSError) as exc:  # refused, unreachable, timed out
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise EndpointError(f"{url}{path}: {type(reason).__name__}: {reason}") from None
    except msgspec.DecodeError as exc:
        raise EndpointError(f"{url}{path}: the answer is not JSON ({exc})", 200) from None
