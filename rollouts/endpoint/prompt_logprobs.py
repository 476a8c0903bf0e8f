"""`prompt_logprobs` for the endpoint's /v1/completions: each prompt position's logprob, as
vLLM's OpenAI server answers it, so an endpoint teacher (rollouts/scoring/endpoint_teacher.py)
scores against `toolgym serve` and against vLLM alike.

A request with `prompt_logprobs: k` (0 <= k <= MAX_PROMPT_LOGPROBS) gets, in its choice,
`prompt_logprobs`: one entry per prompt position, None for the first (nothing before it), else
{token_id: {"logprob", "rank", "decoded_token"}} holding the prompt's own token at that position
(its rank in the vocabulary, 1 = the most likely) and the k most likely tokens (ranks 1..k);
token ids are JSON object keys, so strings on the wire. The logprobs are log_softmax of the raw
logits (temperature 1, whatever the request's temperature: vLLM's default `raw_logprobs`), and
-inf is sent as -9999.0, as vLLM does.

`PromptScorer` computes them with toolgym's own model code in float32 (rollouts/scoring/teacher.py
`position_logprobs`, the checkpoint teacher's forward), from the served checkpoint directory,
loaded on the first request that asks (a served policy that never scores keeps one copy of the
weights). It runs on the event loop's thread, as the torch engine does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...agents.model.checkpoint import load_hf_checkpoint
from ..scoring.teacher import position_logprobs

MAX_PROMPT_LOGPROBS = 20  # vLLM's default max_logprobs
NEG_INF_LOGPROB = -9999.0  # what vLLM sends for -inf (JSON has no infinity)

PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class PromptScorer:
    """A checkpoint directory's float32 model that answers `prompt_logprobs` (module doc);
    `decode(token_id)` is a token's text (the endpoint's renderer)."""

    def __init__(
        self, directory: str | Path, decode: Callable[[int], str], device: torch.device | str = "cpu"
    ) -> None:
        self.directory, self.decode, self.device = Path(directory), decode, torch.device(device)
        self._model: torch.nn.Module | None = None
        self.vocab_size = 0

    def model(self) -> torch.nn.Module:
        if self._model is None:
            model = load_hf_checkpoint(self.directory, dtype=torch.float32, device=self.device)
            self.vocab_size = model.config.vocab_size
            self._model = model.eval().requires_grad_(False)
        return self._model

    def score(self, prompt: list[int], top_k: int) -> PromptLogprobs:
        """The `prompt_logprobs` of one prompt (module doc); ValueError for a token outside the
        model's vocabulary."""
        model = self.model()
        if len(prompt) < 2:
            return [None] * len(prompt)
        (rows,) = position_logprobs(
            model,
            [prompt],
            [range(1, len(prompt))],
            vocab_size=self.vocab_size,
            device=self.device,
            ranks=True,
            top_k=top_k,
        )
        out: PromptLogprobs = [None]
        for token, row in zip(prompt[1:], rows.tolist(), strict=True):
            entry = {str(token): self._entry(row[0], int(row[1]), token)}
            for j in range(top_k):
                best = int(row[2 + top_k + j])
                entry.setdefault(str(best), self._entry(row[2 + j], j + 1, best))
            out.append(entry)
        return out

    def _entry(self, logprob: float, rank: int, token: int) -> dict[str, Any]:
        value = logprob if logprob > NEG_INF_LOGPROB else NEG_INF_LOGPROB
        return {"logprob": value, "rank": rank, "decoded_token": self.decode(token)}
