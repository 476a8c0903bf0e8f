"""Episodes -> padded micro-batches of tensors, with the next-token shift applied here, once.

An Episode of L tokens gives L - 1 training positions: the logits at position t predict token
t + 1, so position t carries token t + 1's target, loss mask, advantage and sampler logprob. Token
0 is never predicted (its loss mask, if set, is dropped: nothing sampled it).

Micro-batches are built by a token budget on the padded size (rows x longest row): episodes are
sorted longest first, so rows of similar length share a batch and padding stays small. Padding is
on the right (harmless for a causal model). An episode longer than the budget gets a micro-batch
of its own rather than being cut.

Why padding and not packing: the model's training call is `model(input_ids)` with plain causal
attention, so packing several episodes into one row would let them attend to each other.

Shared prefixes (`share_prefix=True`): when the rows of a micro-batch start with the same
untrained tokens (the system prompt, a group's prompt) and sharing saves at least a quarter of
the padded positions, the prefix is computed once: `prefix_rows` leading rows of `input_ids`
hold it and the other rows hold each episode's remainder (trainers/shared_prefix.py). The
per-episode tensors (targets, masks, ...) always have one row per episode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..agents.model.chunks import padded_chunks
from ..rollouts.types import Episode
from .shared_prefix import shared_prefix_length

_MIN_SAVING = 0.25  # share a prefix only when it removes at least this share of padded positions


@dataclass
class MicroBatch:
    """One forward/backward worth of padded, shifted tensors ([B, T] unless noted): data only;
    the Trainer runs the model over it (trainers/forward.py).

    Row b's column t is input position `prefix_len + t` of its episode (prefix_len = 0 unless a
    prefix is shared; then `input_ids` has `prefix_rows` extra leading rows holding it).
    """

    input_ids: Tensor  # long [prefix_rows + B, T]: tokens[:-1], right-padded with pad_token_id
    targets: Tensor  # long: tokens[1:] (pad_token_id on padding)
    loss_mask: Tensor  # bool: loss_mask[1:], False on padding
    advantages: Tensor  # float32: advantages[1:]
    sampler_logprobs: Tensor  # float32: sampler_logprobs[1:]
    versions: Tensor  # long: the policy version that sampled each target (token_versions[1:])
    episode_index: Tensor  # long [B]: the row's index in the list given to make_micro_batches
    lengths: Tensor  # long [B]: real positions per row (episode length - 1 - prefix_len)
    positions: Tensor | None = None  # long [prefix_rows + B, T] when a prefix is shared
    prefix_rows: int = 0
    prefix_len: int = 0
    # On-policy distillation's top-k (Episode.teacher_topk_*), when an episode has them: long and
    # float32 [B, T, K], K the most any token has; a position without them has ids 0, logprobs -inf.
    teacher_topk_ids: Tensor | None = None
    teacher_topk_logprobs: Tensor | None = None
    # A mixture of experts' routing as the sampler ran it (Episode.routes), when an episode has
    # it: long [prefix_rows + B, T, layers, top_k] aligned with input_ids, -1 where none.
    routes: Tensor | None = None
    # bool [B]: rows whose episode the env's oracle played (Episode.guided), when one is; the
    # trainer's own logprobs stand in for their sampler_logprobs.
    guided: Tensor | None = None

    @property
    def num_padded_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_real_tokens(self) -> int:
        """Input positions the forward computes (a shared prefix counts once)."""
        return int(self.lengths.sum()) + self.prefix_len

    def to(self, device: torch.device | str) -> MicroBatch:
        moved: dict[str, Any] = {
            k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in vars(self).items()
        }
        return MicroBatch(**moved)

    def real_positions(self) -> Tensor:
        """bool [B, T]: the positions that hold an episode's token (not padding)."""
        return torch.arange(self.targets.shape[1], device=self.targets.device) < self.lengths[:, None]


def validate_episode(episode: Episode, index: int, vocab_size: int | None = None) -> None:
    """Raise a clear error for an Episode the trainer cannot use."""
    n = len(episode.tokens)
    if not (len(episode.loss_mask) == len(episode.sampler_logprobs) == len(episode.advantages) == n):
        raise ValueError(f"episode {index}: field lengths disagree (tokens={n})")
    if n < 2:
        raise ValueError(f"episode {index}: needs at least 2 tokens to predict one, has {n}")
    if episode.token_versions and len(episode.token_versions) != n:
        raise ValueError(f"episode {index}: {len(episode.token_versions)} token_versions for {n} tokens")
    if (episode.teacher_topk_ids or episode.teacher_topk_logprobs) and not (
        len(episode.teacher_topk_ids) == len(episode.teacher_topk_logprobs) == n
        and all(
            len(a) == len(b)
            for a, b in zip(episode.teacher_topk_ids, episode.teacher_topk_logprobs, strict=True)
        )
    ):
        raise ValueError(f"episode {index}: teacher top-k ids and logprobs disagree with its {n} tokens")
    if vocab_size is not None:
        bad = [t for t in episode.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"episode {index}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")


def split_by_token_budget(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group indices (longest first) so that len(group) x max length <= token_budget."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    return padded_chunks(range(len(lengths)), lengths.__getitem__, token_budget, longest_first=True)


def plan_shared_prefix(episodes: Sequence[Episode], indices: Sequence[int]) -> int:
    """The prefix length to share for these rows (0: not worth it; see the module doc)."""
    rows = [episodes[i].tokens for i in indices]
    prefix_len = shared_prefix_length(rows, [episodes[i].loss_mask for i in indices])
    if prefix_len == 0:
        return 0
    full_width = max(len(r) for r in rows) - 1
    width = full_width - prefix_len
    shared_cost = (-(-prefix_len // width) + len(rows)) * width
    return prefix_len if shared_cost <= (1 - _MIN_SAVING) * len(rows) * full_width else 0


def collate(
    episodes: Sequence[Episode], indices: Sequence[int], pad_token_id: int = 0, prefix_len: int = 0
) -> MicroBatch:
    """Pad and shift the given episodes into one MicroBatch (rows in the order of `indices`),
    sharing their first `prefix_len` input positions (see `plan_shared_prefix`)."""
    lengths = [len(episodes[i].tokens) - 1 - prefix_len for i in indices]
    rows, width = len(indices), max(lengths)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    targets = torch.full((rows, width), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((rows, width), dtype=torch.bool)
    advantages = torch.zeros((rows, width), dtype=torch.float32)
    sampler_logprobs = torch.zeros((rows, width), dtype=torch.float32)
    versions = torch.zeros((rows, width), dtype=torch.long)
    for row, (i, n) in enumerate(zip(indices, lengths, strict=True)):
        episode = episodes[i]
        if episode.token_versions:
            versions[row, :n] = torch.tensor(episode.token_versions[prefix_len + 1 :], dtype=torch.long)
        else:
            versions[row, :n] = episode.policy_version
        tokens = torch.tensor(episode.tokens, dtype=torch.long)
        input_ids[row, :n] = tokens[prefix_len:-1]
        targets[row, :n] = tokens[prefix_len + 1 :]
        loss_mask[row, :n] = torch.tensor(episode.loss_mask[prefix_len + 1 :], dtype=torch.bool)
        advantages[row, :n] = torch.tensor(episode.advantages[prefix_len + 1 :], dtype=torch.float32)
        sampler_logprobs[row, :n] = torch.tensor(
            episode.sampler_logprobs[prefix_len + 1 :], dtype=torch.float32
        )
    top_k = max((len(row) for i in indices for row in episodes[i].teacher_topk_ids), default=0)
    topk_ids = topk_logprobs = None
    if top_k:
        topk_ids = torch.zeros((rows, width, top_k), dtype=torch.long)
        topk_logprobs = torch.full((rows, width, top_k), -math.inf, dtype=torch.float32)
        for row, i in enumerate(indices):
            episode = episodes[i]
            if not episode.teacher_topk_ids:
                continue
            # Each position's row padded to top_k (ids 0, logprobs -inf), one tensor per episode.
            ids = [r + [0] * (top_k - len(r)) for r in episode.teacher_topk_ids[prefix_len + 1 :]]
            values = [r + [-math.inf] * (top_k - len(r)) for r in episode.teacher_topk_logprobs[prefix_len + 1 :]]
            topk_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            topk_logprobs[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    routes = _routes(episodes, indices, lengths, width, prefix_len)
    guided = None
    if any(episodes[i].guided for i in indices):
        guided = torch.tensor([episodes[i].guided for i in indices], dtype=torch.bool)
    positions = None
    prefix_rows = 0
    if prefix_len:
        prefix_rows = -(-prefix_len // width)
        prefix = torch.full((prefix_rows * width,), pad_token_id, dtype=torch.long)
        prefix[:prefix_len] = torch.tensor(episodes[indices[0]].tokens[:prefix_len], dtype=torch.long)
        input_ids = torch.cat([prefix.view(prefix_rows, width), input_ids])
        if routes is not None:
            head = routes.new_full((prefix_rows * width, *routes.shape[2:]), -1)
            head[:prefix_len] = _route_array(episodes[indices[0]], prefix_len)
            routes = torch.cat([head.view(prefix_rows, width, *routes.shape[2:]), routes])
        positions = torch.cat(
            [
                torch.arange(prefix_rows * width).view(prefix_rows, width),
                (prefix_len + torch.arange(width)).expand(rows, width),
            ]
        )
    return MicroBatch(
        input_ids=input_ids,
        targets=targets,
        loss_mask=loss_mask,
        advantages=advantages,
        sampler_logprobs=sampler_logprobs,
        versions=versions,
        episode_index=torch.tensor(list(indices), dtype=torch.long),
        lengths=torch.tensor(lengths, dtype=torch.long),
        positions=positions,
        prefix_rows=prefix_rows,
        prefix_len=prefix_len,
        teacher_topk_ids=topk_ids,
        teacher_topk_logprobs=topk_logprobs,
        routes=routes,
        guided=guided,
    )


def _route_array(episode: Episode, end: int, start: int = 0) -> Tensor:
    """The episode's recorded routes of input positions start..end-1 (long [n, layers, top_k],
    -1 past what it recorded; all -1 without routes)."""
    routes = episode.routes
    if routes is None:
        return torch.full((end - start, 1, 1), -1, dtype=torch.long)
    out = torch.full((end - start, routes.layers, routes.top_k), -1, dtype=torch.long)
    have = torch.from_numpy(routes.array()[start:end].astype(np.int64))
    out[: have.shape[0]] = have
    return out


def _routes(
    episodes: Sequence[Episode], indices: Sequence[int], lengths: Sequence[int], width: int, prefix_len: int
) -> Tensor | None:
    """long [B, T, layers, top_k] of the rows' recorded routes past the shared prefix (-1 where
    none), or None when no row has any."""
    shapes = {(e.routes.layers, e.routes.top_k) for i in indices if (e := episodes[i]).routes is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(
            f"episodes of one batch carry routes of different shapes (layers, top_k): {sorted(shapes)}"
        )
    (shape,) = shapes
    routes = torch.full((len(indices), width, *shape), -1, dtype=torch.long)
    for row, (i, n) in enumerate(zip(indices, lengths, strict=True)):
        if episodes[i].routes is not None:
            routes[row, :n] = _route_array(episodes[i], prefix_len + n, prefix_len)
    return routes


def make_micro_batches(
    episodes: Sequence[Episode],
    token_budget: int,
    pad_token_id: int = 0,
    vocab_size: int | None = None,
    share_prefix: bool = False,
) -> list[MicroBatch]:
    """All episodes as padded, shifted micro-batches of at most `token_budget` padded positions
    (counted without prefix sharing, which only ever makes a micro-batch smaller)."""
    for index, episode in enumerate(episodes):
        validate_episode(episode, index, vocab_size)
    lengths = [len(e.tokens) - 1 for e in episodes]
    batches = []
    for group in split_by_token_budget(lengths, token_budget):
        prefix_len = plan_shared_prefix(episodes, group) if share_prefix else 0
        batches.append(collate(episodes, group, pad_token_id, prefix_len))
    return batches


def empty_micro_batch(pad_token_id: int = 0) -> MicroBatch:
    """A one-position batch with nothing to train: keeps a rank in step with the others' collectives."""
    return MicroBatch(
        input_ids=torch.full((1, 1), pad_token_id, dtype=torch.long),
        targets=torch.full((1, 1), pad_token_id, dtype=torch.long),
        loss_mask=torch.zeros((1, 1), dtype=torch.bool),
        advantages=torch.zeros((1, 1)),
        sampler_logprobs=torch.zeros((1, 1)),
        versions=torch.zeros((1, 1), dtype=torch.long),
        episode_index=torch.full((1,), -1, dtype=torch.long),
        lengths=torch.zeros((1,), dtype=torch.long),
    )


def shard_episodes(lengths: Sequence[int], rank: int, world_size: int) -> list[int]:
    """This rank's share of episode indices, balanced by tokens (longest first to the lightest rank).

    Deterministic, and the same on every rank. Every episode goes to exactly one rank.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    loads = [0] * world_size
    owner = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += lengths[i]
    return [i for i in range(len(lengths)) if owner[i] == rank]
