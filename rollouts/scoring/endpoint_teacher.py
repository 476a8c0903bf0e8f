"""The endpoint teacher of on-policy distillation: an OpenAI-compatible server that scores the
student's sampled tokens through the completions API (`distill.teacher = "http://host:port/v1"`).

Each training sequence of a group (the same sequences and sampled positions as the checkpoint
teacher's, teacher.py `GroupTeacher.score`) is one request: its token ids as the prompt, and
vLLM's `prompt_logprobs: 0` extension, whose answer carries, per prompt position, the logprob of
the token there ({token_id: {"logprob", "rank", ...}}, None at position 0); the teacher keeps the
sampled positions' values and writes them where the checkpoint teacher does
(`info[TEACHER_LOGPROBS]`), so the scorer and the losses read both alike. With `distill.top_k` = k
it asks for `prompt_logprobs: k`, whose entries then also hold the k most likely tokens (ranks
1..k), and writes those, best first, as the checkpoint teacher does (`info[TEACHER_TOPK_IDS]`,
`info[TEACHER_TOPK_LOGPROBS]`); an answer with fewer is a scoring failure (a vLLM server must
allow it: --max-logprobs >= k; toolgym serve gives up to 20). vLLM's OpenAI server answers it, and so does
`toolgym serve` (rollouts/endpoint/prompt_logprobs.py). The requests of a group run at once, up
to MAX_CONCURRENT_REQUESTS; they use the standard library's HTTP client (model_client.py, which
the judge shares), so this teacher needs no
package the checkpoint teacher does not. `$OPENAI_API_KEY`, when set, is sent as the bearer
token (a vLLM server started with --api-key).

Temperature: an endpoint's prompt logprobs are log_softmax of the raw logits (vLLM's default
`raw_logprobs`; toolgym serve's too), not at the policy's temperature, and one logprob per token
cannot be rescaled; so a policy sampling at a temperature other than 1 is refused with an endpoint
teacher (a checkpoint teacher scores at any temperature).

Checks when it is built (TeacherError, one line naming the endpoint): it answers /v1/models and
serves the model (`distill.teacher_model`, or its only one); its tokenizer is the student's when
it says which it has: toolgym serve's model card carries `toolgym.tokenizer_fingerprint`, and a
different one is refused naming both. An endpoint that does not say (vLLM) is used with a note in
`describe()` (printed in the run's log) that the tokenizer was not checked: scoring a known token
sequence could not tell, since ids go in and logprobs come out, and any tokenizer whose vocabulary
holds those ids scores them without complaint; a check that passes wrongly is worse than one
reported as skipped. Then one probe request over two tokens must return prompt logprobs; an
endpoint that does not (an unknown parameter, or an answer without them) is refused in one line
naming the setting it needs, `prompt_logprobs`.

Failures while scoring (a timeout after `distill.teacher_timeout_s`, a refused connection, an
error answer, an answer without prompt logprobs) are the checkpoint teacher's failures: the group
is dropped as an infrastructure failure and counted, and `max_consecutive_failures` in a row stop
the run (teacher.py `GroupTeacher.annotate`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .distill import DistillConfig
from .model_client import EndpointError, request_json
from .teacher import GroupTeacher, PositionScores, TeacherError

MAX_CONCURRENT_REQUESTS = 16
NEEDS = "the completions parameter `prompt_logprobs` (vLLM's OpenAI server, or toolgym serve)"


class EndpointTeacher(GroupTeacher):
    """An endpoint teacher (module doc). `config`: the run's [distill] section (its teacher is the
    URL); `student_fingerprint`: the student tokenizer's; `temperature`: the policy's (must be 1)."""

    def __init__(self, config: DistillConfig, *, student_fingerprint: str, temperature: float = 1.0) -> None:
        if not config.endpoint:
            raise TeacherError(
                f"distill.teacher {config.teacher!r} is not an endpoint URL (http://host:port/v1)"
            )
        self._config, self.url = config, config.teacher.rstrip("/")
        self.name, self.timeout = self.url, config.teacher_timeout_s
        if temperature != 1.0:
            raise TeacherError(
                f"distill.teacher {self.url}: an endpoint's prompt logprobs are at temperature 1 and the "
                f"policy samples at {temperature}: use policy.temperature = 1, or a checkpoint teacher"
            )
        self.model, self.fingerprint, toolgym = self._model_card()
        if self.fingerprint is not None and self.fingerprint != student_fingerprint:
            raise TeacherError(
                f"distill.teacher {self.url}: its tokenizer {self.fingerprint[:16]} is not the student's "
                f"{student_fingerprint[:16]}: the teacher must share the student's tokenizer"
            )
        # toolgym serve scores without sampling (max_tokens 0); vLLM samples at least one token
        self.max_tokens = 0 if toolgym else 1
        self._probe()
        self._init_counts()

    def describe(self) -> str:
        """One line for the run's log."""
        checked = (
            f"tokenizer {self.fingerprint[:16]}, the student's"
            if self.fingerprint is not None
            else "tokenizer NOT checked: the endpoint does not report its fingerprint; it must serve the "
            "student's tokenizer"
        )
        return f"distill: teacher endpoint {self.url}, model {self.model} ({checked})"

    # ---- HTTP -------------------------------------------------------------------------------

    def _request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return request_json(
            self.url, path, body, timeout=self.timeout, api_key=os.environ.get("OPENAI_API_KEY")
        )

    def _model_card(self) -> tuple[str, str | None, bool]:
        """(the model to request, its tokenizer fingerprint if the card says, whether the endpoint
        is toolgym serve)."""
        try:
            listed = self._request("/models")
        except EndpointError as exc:
            raise TeacherError(f"distill.teacher {self.url}: cannot list its models: {exc}") from None
        data = listed.get("data") if isinstance(listed, dict) else None
        cards = [c for c in data or [] if isinstance(c, dict) and isinstance(c.get("id"), str)]
        ids = [c["id"] for c in cards]
        wanted = self._config.teacher_model
        if wanted:
            if wanted not in ids:
                raise TeacherError(
                    f"distill.teacher {self.url} does not serve distill.teacher_model {wanted!r} "
                    f"(it lists {', '.join(ids) or 'none'})"
                )
            card = cards[ids.index(wanted)]
        elif len(cards) == 1:
            card = cards[0]
        else:
            raise TeacherError(
                f"distill.teacher {self.url} lists {len(cards)} models ({', '.join(ids) or 'none'}): "
                "name one in distill.teacher_model"
            )
        extra = card.get("toolgym")
        fingerprint = extra.get("tokenizer_fingerprint") if isinstance(extra, dict) else None
        return card["id"], fingerprint if isinstance(fingerprint, str) else None, isinstance(extra, dict)

    def _probe(self) -> None:
        """One request over two tokens: the endpoint must return prompt logprobs (module doc)."""
        try:
            self._sequence([0, 1], [1])
        except (EndpointError, ValueError) as exc:
            raise TeacherError(
                f"distill.teacher {self.url} returns no prompt logprobs: it needs {NEEDS} ({exc})"
            ) from None

    # ---- scoring ----------------------------------------------------------------------------

    def _sequence(self, tokens: Sequence[int], positions: Sequence[int]) -> PositionScores:
        k = self._config.top_k
        body = {
            "model": self.model,
            "prompt": list(tokens),
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "prompt_logprobs": k,
        }
        answer = self._request("/completions", body)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        scored = choices[0].get("prompt_logprobs") if choices and isinstance(choices[0], dict) else None
        if not isinstance(scored, list) or len(scored) != len(tokens):
            got = (
                "none"
                if not isinstance(scored, list)
                else f"{len(scored)} positions for {len(tokens)} tokens"
            )
            raise ValueError(
                f"{self.url}/completions answered without prompt_logprobs ({got}): it needs {NEEDS}"
            )
        out = PositionScores([], [], [])
        for p in positions:
            entry = scored[p]
            value = entry.get(str(tokens[p])) if isinstance(entry, dict) else None
            logprob = value.get("logprob") if isinstance(value, dict) else None
            if not isinstance(logprob, int | float):
                raise ValueError(
                    f"{self.url}/completions: prompt_logprobs at position {p} has no logprob of token {tokens[p]}"
                )
            out.logprobs.append(float(logprob))
            if k:
                assert isinstance(entry, dict)
                ids, values = self._top(entry, k, p)
                out.top_ids.append(ids)
                out.top_logprobs.append(values)
        return out

    def _top(self, entry: dict[str, Any], k: int, p: int) -> tuple[list[int], list[float]]:
        """The top k of one position's prompt_logprobs entry (vLLM's shape: the top k tokens, rank
        1..k, and the position's own token with its rank), best first."""
        ranked = []
        for token, value in entry.items():
            rank = value.get("rank") if isinstance(value, dict) else None
            logprob = value.get("logprob") if isinstance(value, dict) else None
            if isinstance(rank, int) and isinstance(logprob, int | float) and 1 <= rank <= k:
                ranked.append((rank, -float(logprob), int(token)))
        if len(ranked) < k:
            raise ValueError(
                f"{self.url}/completions: prompt_logprobs at position {p} has {len(ranked)} of the "
                f"top {k} tokens (distill.top_k): the endpoint must allow prompt_logprobs up to {k}"
            )
        best = sorted(ranked)[:k]
        return [token for _, _, token in best], [-negative for _, negative, _ in best]

    def position_scores(
        self, token_lists: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> list[PositionScores]:
        """Per sequence, the endpoint's logprob of the token at each of its `positions` (and with
        distill.top_k its top k there): one request a sequence, up to MAX_CONCURRENT_REQUESTS at
        once; the first failure raises."""
        if not token_lists:
            return []
        workers = min(MAX_CONCURRENT_REQUESTS, len(token_lists))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="teacher-endpoint") as pool:
            return list(pool.map(self._sequence, token_lists, positions))
