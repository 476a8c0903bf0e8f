"""A small deterministic judge for tests: a real OpenAI-compatible server on 127.0.0.1 (the
standard library's HTTP server in a thread) answering POST /v1/chat/completions (with `usage`)
and GET /v1/models.

Its score is a rule on the transcript: a criterion prompt that says `contains 'X'` scores 1.0 for
an episode whose transcript contains X, else 0.0. An episode question (one transcript) gets
{"score": s}; a group question (the judge's "=== Attempt k ===" sections) gets one score per
attempt, in the order shown, as `<score>` tags. Modes: "rule" (the above), "invert" (1 minus the
rule's score: a judge that disagrees on everything), "garbage" (an answer
without a score), "hang" (no answer until the server stops), "fail" (HTTP 503 for the first
`fail_first` requests, then the rule). With `api_key`, a request without `Authorization: Bearer
<api_key>` gets 401."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "judge-test"


class JudgeServer:
    def __init__(self, mode: str = "rule", fail_first: int = 0, api_key: str | None = None) -> None:
        self.mode, self.fail_first, self.api_key = mode, fail_first, api_key
        self.requests: list[dict[str, Any]] = []  # chat completion bodies, in arrival order
        self.authorizations: list[str | None] = []
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    # ---- the rule ---------------------------------------------------------------------------

    def score(self, criterion: str, transcript: str) -> float:
        needle = re.search(r"contains '([^']+)'", criterion)
        found = 1.0 if needle and needle.group(1) in transcript else 0.0
        return 1.0 - found if self.mode == "invert" else found

    def answer(self, messages: list[dict[str, str]]) -> str:
        if self.mode == "garbage":
            return "The assistant did fine, I suppose."
        user = messages[-1]["content"]
        criterion = user.split("\n\n", 1)[0]
        attempts = re.split(r"=== Attempt \d+ ===\n", user)
        if len(attempts) > 1:  # a group question: one score per attempt shown
            return " ".join(f"<score>{self.score(criterion, a)}</score>" for a in attempts[1:])
        return json.dumps({"score": self.score(criterion, user.split("Transcript:", 1)[1])})

    # ---- HTTP -------------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                got = self.headers.get("Authorization")
                with server._lock:
                    server.authorizations.append(got)
                if server.api_key is not None and got != f"Bearer {server.api_key}":
                    self._send(401, {"error": {"message": "invalid API key"}})
                    return False
                return True

            def do_GET(self) -> None:
                if not self._authorized():
                    return
                if self.path != "/v1/models":
                    self._send(404, {"error": {"message": f"no {self.path}"}})
                    return
                self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self._authorized():
                    return
                with server._lock:
                    server.requests.append(body)
                    n = len(server.requests)
                if server.mode == "hang":
                    server.stopping.wait()
                    return
                if server.mode == "fail" and n <= server.fail_first:
                    self._send(503, {"error": {"message": f"overloaded ({n})"}})
                    return
                text = server.answer(body["messages"])
                prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])
                self._send(
                    200,
                    {
                        "id": f"judge-{n}",
                        "object": "chat.completion",
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": text},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": len(text.split()),
                            "total_tokens": prompt_tokens + len(text.split()),
                        },
                    },
                )

        return Handler

    def start(self) -> None:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def judge_server(
    mode: str = "rule", fail_first: int = 0, api_key: str | None = None
) -> Iterator[JudgeServer]:
    server = JudgeServer(mode, fail_first, api_key)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def says_please(trajectory) -> float:
    """A programmatic criterion (`function = "judge_testlib:says_please"`): 1.0 when the last
    action says please."""
    return 1.0 if "please" in trajectory.transitions[-1].action.text else 0.0


def not_a_score(trajectory) -> str:
    return "very good"
