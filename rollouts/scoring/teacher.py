"""The teacher of on-policy distillation: a checkpoint that scores the student's sampled tokens.

It lives with the scorer because a teacher's log-ratio is a per-token signal that becomes an
advantage (distill.py), and rollouts/ is the one place where advantages are made; it loads the
checkpoint with agents/ (the model code and its HF checkpoint I/O), as the rollouts drive the
policy through agents/.

`Teacher(directory, ...)` loads a Hugging Face directory with toolgym's own model code
(agents/model/checkpoint.py `load_hf_checkpoint`) on the run's device, and refuses, in one line
naming both fingerprints, a tokenizer other than the student's (agents/tokenizer.py
`tokenizer_fingerprint`, the one recordings and checkpoints carry): its logprobs would be of other
tokens. `annotate(group)` runs one no-grad forward over each of the group's training sequences
(the Episodes builder's: rollouts/episodes.py `sequences`, so a context policy's rewrite or a
template that is not append-only gives a sequence of its own, scored in its own context), batched
over the group (right-padded: the model is causal, so padding after a sequence changes none of
its logits), and writes into each transition `info[TEACHER_LOGPROBS]`: log_softmax(logits / T) of
each sampled token, T the policy's sampling temperature, as the sampler's logprobs are. With
`distill.top_k` = k > 0 the same forward also gives, at each of those positions, the k most likely
tokens' ids and logprobs (torch.topk of the same log_softmax, best first), written as
`info[TEACHER_TOPK_IDS]` and `info[TEACHER_TOPK_LOGPROBS]` (per sampled token, a list of k each).

The endpoint teacher (endpoint_teacher.py, `EndpointTeacher`) shares `score` and `annotate`
(`GroupTeacher`): only where the logprobs come from differs, so the scorer and the losses read
both alike. `position_logprobs` is the forward both this teacher and `toolgym serve`'s
`prompt_logprobs` (rollouts/endpoint/prompt_logprobs.py) run.

Failures: an exception while scoring a group (out of memory, a token outside the teacher's
vocabulary, ...) makes `annotate` return its cause, and the group is dropped as an infrastructure
failure (rollouts/batches.py); `max_consecutive_failures` failures in a row raise TeacherError
with the cause, which stops the run. The forward runs on the caller's thread (the sync
collector's, or the group producer's), blocking its asyncio loop for its duration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from ...agents.model.checkpoint import load_hf_checkpoint
from ...agents.tokenizer import load_tokenizer, tokenizer_fingerprint
from ..episodes import sequences
from ..types import Trajectory
from .distill import TEACHER_LOGPROBS, TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS, DistillConfig

# Rows x padded length per forward: a group is split into forwards of at most this many tokens.
MAX_BATCH_TOKENS = 65536
# Scored positions per output-layer call: bounds the logits held at once to this many x vocab.
MAX_HEAD_ROWS = 2048


class TeacherError(RuntimeError):
    """The teacher cannot be used (its directory, its tokenizer), or its scoring failed
    `max_consecutive_failures` groups in a row; `str()` names the cause."""


def teacher_fingerprint(directory: str | Path) -> str:
    """The tokenizer fingerprint of a teacher directory's tokenizer.json (TeacherError if none)."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise TeacherError(
            f"distill.teacher {directory}: no tokenizer.json (needed to check it is the student's)"
        )
    return tokenizer_fingerprint(load_tokenizer(path))


@torch.no_grad()
def position_logprobs(
    model: torch.nn.Module,
    token_lists: Sequence[Sequence[int]],
    positions: Sequence[Sequence[int]],
    *,
    vocab_size: int,
    device: torch.device,
    temperature: float = 1.0,
    top_k: int = 0,
    ranks: bool = False,
) -> list[torch.Tensor]:
    """Per sequence, a float32 [len(positions[i]), columns] tensor, row j for position
    positions[i][j] (each >= 1): column 0 the model's logprob of the token there given the tokens
    before it, at the temperature (log_softmax(logits / T)); with `ranks`, column 1 its rank in
    the vocabulary (1 = the most likely); then `top_k` logprobs, best first, and their token ids
    (exact in float32 below 2**24). Forwards of at most MAX_BATCH_TOKENS (rows x padded length,
    right-padded: the model is causal, so padding after a sequence changes none of its logits);
    the output layer runs only on the hidden states that predict those tokens, MAX_HEAD_ROWS at a
    time, so no [B, T, V] logits exist. ValueError for a token outside the vocabulary or a
    position outside 1..len - 1."""
    columns = 1 + int(ranks) + 2 * top_k
    out: list[torch.Tensor] = [torch.zeros(0, columns) for _ in token_lists]
    order = sorted(range(len(token_lists)), key=lambda i: -len(token_lists[i]))
    start = 0
    while start < len(order):
        longest = max(len(token_lists[order[start]]), 1)
        rows = max(1, min(len(order) - start, MAX_BATCH_TOKENS // longest))
        chunk = order[start : start + rows]
        start += rows
        batch = torch.zeros(len(chunk), longest, dtype=torch.long)
        select = torch.zeros(len(chunk), longest, dtype=torch.bool)  # hidden states that predict
        targets = torch.zeros(len(chunk), longest, dtype=torch.long)
        for row, i in enumerate(chunk):
            tokens = token_lists[i]
            bad = [t for t in tokens if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the teacher's vocabulary of {vocab_size}")
            if any(not 1 <= p < len(tokens) for p in positions[i]):
                raise ValueError(f"a position to score is outside 1..{len(tokens) - 1}")
            batch[row, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
            at = torch.tensor(list(positions[i]), dtype=torch.long) - 1
            select[row, at] = True
            targets[row, at] = batch[row, at + 1]
        if not select.any():
            continue
        head = _head(select.to(device), targets[select].to(device), temperature, top_k, ranks)
        scored = model(batch.to(device), head=head).cpu()
        # select is row-major: each row's positions in increasing order
        offset = 0
        for row, i in enumerate(chunk):
            n = int(select[row].sum())
            by_position = dict(zip(sorted(positions[i]), range(offset, offset + n), strict=True))
            out[i] = scored[[by_position[p] for p in positions[i]]]
            offset += n
    return out


def _head(
    select: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int, ranks: bool
) -> Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]:
    """The model's `head=`: `position_logprobs`' columns from the `select`ed hidden states only."""

    def head(hidden: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
        picked = hidden[select]
        parts = []
        for k in range(0, picked.shape[0], MAX_HEAD_ROWS):
            logits = lm_head(picked[k : k + MAX_HEAD_ROWS]).float()
            if temperature != 1.0:
                logits = logits / temperature
            lp = torch.log_softmax(logits, dim=-1)
            target = lp.gather(-1, targets[k : k + MAX_HEAD_ROWS, None])
            cols = [target]
            if ranks:
                cols.append((lp > target).sum(-1, keepdim=True).float() + 1)
            if top_k:
                best = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
                cols += [best.values, best.indices.float()]
            parts.append(torch.cat(cols, dim=-1))
        return torch.cat(parts)

    return head


class PositionScores(NamedTuple):
    """A teacher's scores of one sequence's positions: the logprob of the token at each, and (with
    distill.top_k > 0; else empty) its top-k token ids and their logprobs, best first."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


TEACHER_KEYS = (TEACHER_LOGPROBS, TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS)


class GroupTeacher:
    """What every teacher shares (module doc): `score` builds each training sequence and the
    positions of its sampled tokens and writes what `logprobs` gives into the transitions;
    `annotate` counts failures. A subclass sets `_config` and `consecutive_failures`/`failures`
    (`_init_counts`), and gives `position_scores`, `describe` and `name` (the teacher in
    errors)."""

    _config: DistillConfig
    name: str

    def _init_counts(self) -> None:
        self.consecutive_failures = 0
        self.failures = 0  # groups whose scoring failed, over the run

    @property
    def config(self) -> DistillConfig:
        return self._config

    def position_scores(
        self, token_lists: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> list[PositionScores]:
        """Per sequence, the teacher's logprob of the token at each of its `positions` (each >= 1)
        given the tokens before it, and its top distill.top_k tokens there."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for the run's log."""
        raise NotImplementedError

    def score(self, group: Sequence[Trajectory]) -> None:
        """Write the teacher's logprobs of every sampled token into the group's transitions
        (`info[TEACHER_LOGPROBS]`, and with top_k the top-k ids and logprobs); raises what the
        forward raises."""
        parts = [part for trajectory in group for part in sequences(trajectory)]
        token_lists: list[list[int]] = []
        positions: list[list[int]] = []
        for part in parts:
            tokens: list[int] = []
            at: list[int] = []
            for transition in part:
                tokens += transition.observation_tokens
                if not tokens and transition.action.tokens:
                    raise ValueError(
                        "a training sequence starts with a sampled token: nothing to condition it on"
                    )
                at += range(len(tokens), len(tokens) + len(transition.action.tokens))
                tokens += transition.action.tokens
            token_lists.append(tokens)
            positions.append(at)
        scored = self.position_scores(token_lists, positions)
        top = self._config.top_k > 0
        for part, got in zip(parts, scored, strict=True):
            k = 0
            for transition in part:
                n = len(transition.action.tokens)
                transition.info[TEACHER_LOGPROBS] = got.logprobs[k : k + n]
                if top:
                    transition.info[TEACHER_TOPK_IDS] = got.top_ids[k : k + n]
                    transition.info[TEACHER_TOPK_LOGPROBS] = got.top_logprobs[k : k + n]
                k += n

    def annotate(self, group: Sequence[Trajectory]) -> str | None:
        """`score`, with failures counted (module doc): None when the group was scored, else the
        cause in one line (the caller drops the group); TeacherError on the
        `max_consecutive_failures`-th failure in a row."""
        try:
            self.score(group)
        except Exception as exc:  # any failure of the teacher is an infrastructure failure
            for trajectory in group:  # no partial annotation survives into a recording
                for transition in trajectory.transitions:
                    for key in TEACHER_KEYS:
                        transition.info.pop(key, None)
            self.consecutive_failures += 1
            self.failures += 1
            cause = f"{type(exc).__name__}: {exc}"
            limit = self._config.max_consecutive_failures
            if self.consecutive_failures >= limit:
                raise TeacherError(
                    f"the teacher ({self.name}) failed {self.consecutive_failures} groups in a row "
                    f"(distill.max_consecutive_failures = {limit}); last cause: {cause}"
                ) from exc
            return cause
        self.consecutive_failures = 0
        return None


class Teacher(GroupTeacher):
    """A checkpoint teacher (module doc). `config`: the run's [distill] section (its teacher is the
    directory); `student_fingerprint`: the student tokenizer's; `temperature`: the policy's
    sampling temperature."""

    def __init__(
        self,
        config: DistillConfig,
        *,
        student_fingerprint: str,
        temperature: float = 1.0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not config.teacher:
            raise TeacherError("distill.teacher is empty: no teacher to load")
        self._config, self.directory = config, Path(config.teacher)
        self.name = str(self.directory)
        if not (self.directory / "config.json").is_file():
            raise TeacherError(
                f"distill.teacher {self.directory} is not a Hugging Face directory (no config.json)"
            )
        self.fingerprint = teacher_fingerprint(self.directory)
        if self.fingerprint != student_fingerprint:
            raise TeacherError(
                f"distill.teacher's tokenizer {self.fingerprint[:16]} ({self.directory / 'tokenizer.json'}) "
                f"is not the student's {student_fingerprint[:16]}: the teacher must share the student's tokenizer"
            )
        self.temperature, self.device = temperature, torch.device(device)
        self.model = load_hf_checkpoint(self.directory, dtype=dtype, device=self.device).eval()
        self.model.requires_grad_(False)
        self.vocab_size = self.model.config.vocab_size
        self._init_counts()

    def describe(self) -> str:
        """One line for the run's log."""
        return f"distill: teacher {self.directory} (tokenizer {self.fingerprint[:16]}, the student's)"

    def position_scores(
        self, token_lists: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> list[PositionScores]:
        """`position_logprobs`' column 0: log_softmax(logits / T) of each position's token; with
        top_k, its top-k columns (torch.topk of the same log_softmax)."""
        k = self._config.top_k
        scored = position_logprobs(
            self.model,
            token_lists,
            positions,
            vocab_size=self.vocab_size,
            device=self.device,
            temperature=self.temperature,
            top_k=k,
        )
        return [
            PositionScores(
                rows[:, 0].tolist(),
                rows[:, 1 + k :].long().tolist() if k else [],
                rows[:, 1 : 1 + k].tolist() if k else [],
            )
            for rows in scored
        ]
