"""Training on a micro-batch whose rows share a prefix, computing that prefix once.

Every episode of an RL batch starts with the same system prompt (and the G episodes of a group
with the same whole prompt); every SFT demo of one env does too. Padding each row to its full
length recomputes that prefix once per row: for Zorplex (a ~95-token system prompt, ~35 tokens
after it) that is ~3x the work the batch needs.

Instead, a micro-batch with a long enough common prefix is laid out as

    rows [0, n)       the shared prefix, folded into n rows of the batch width W
                      (positions 0 .. P-1, row-major; the tail of the last row is filler)
    rows [n, n + B)   each episode's remainder, positions P .. P + W - 1, right-padded

and `SharedPrefixAttention` (an `AttentionCache` for the model's forward) makes the prefix attend
causally to itself and every remainder row attend to the whole prefix and causally to itself.
The model's linears see one [n + B, W] batch, so nothing else in the forward changes, and the
gradient of the prefix is the sum over the rows that read it, exactly as with full rows.

A model's sliding-window layers (`ModelConfig.layer_window`) get the same layout with banded masks,
built once per micro-batch: a query at position p sees keys p - window + 1 .. p, prefix or own.

Only positions that nothing trains may be shared: the shared input positions [0, P) predict
tokens 1..P, which must be identical in every row and outside every loss mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..agents.model.attention import scaled_dot_product_attention, sliding_causal_mask
from ..agents.model.prefix_attention import attend_after_prefix, common_prefix_length, prefix_mask


def shared_prefix_length(rows: list[list[int]], masks: list[list[int]]) -> int:
    """P: how many leading input positions every row can share.

    Input position t predicts token t + 1, so positions [0, P) are shareable when tokens
    [0, P] agree across rows and no row trains a target in 1..P.
    """
    if len(rows) < 2:
        return 0
    shortest = min(len(r) for r in rows)
    limit = common_prefix_length(rows) - 1  # tokens 0..P must agree: P <= common - 1
    for mask in masks:
        trained = next((i for i in range(1, len(mask)) if mask[i]), len(mask))
        limit = min(limit, trained - 1)  # targets 1..P untrained: P <= first trained index - 1
    # Every row keeps at least one input position of its own.
    return max(0, min(limit, shortest - 2))


class SharedPrefixAttention:
    """The attention of a shared-prefix micro-batch (see the module doc); the model calls
    `attend(layer, q, k, v)` with q [n + B, H, W, D] and k/v [n + B, Hkv, W, D], RoPE applied.
    windows: each layer's sliding window (None: full context; default every layer full)."""

    def __init__(
        self,
        prefix_rows: int,
        prefix_len: int,
        width: int,
        device: torch.device,
        windows: Sequence[int | None] = (),
    ) -> None:
        self.prefix_rows, self.prefix_len = prefix_rows, prefix_len
        self.mask = prefix_mask(prefix_len, width, device)
        self.windows = list(windows)
        # Per window: (the prefix's band [P, P], the rows' band [W, P + W]).
        self.bands = {
            w: (
                sliding_causal_mask(prefix_len, prefix_len, w, device),
                sliding_causal_mask(width, prefix_len + width, w, device, offset=prefix_len),
            )
            for w in {w for w in self.windows if w is not None}
        }

    def _unfold(self, x: Tensor) -> Tensor:
        """[n, heads, W, D] prefix rows -> [1, heads, P, D] as one sequence."""
        n, heads, width, dim = x.shape
        return x.transpose(0, 1).reshape(1, heads, n * width, dim)[:, :, : self.prefix_len]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None) -> Tensor:
        n = self.prefix_rows
        width = q.shape[2]
        q_prefix, k_prefix, v_prefix = self._unfold(q[:n]), self._unfold(k[:n]), self._unfold(v[:n])
        window = self.windows[layer] if layer < len(self.windows) else None
        mask = self.mask
        if window is None:
            out_prefix = scaled_dot_product_attention(q_prefix, k_prefix, v_prefix, sinks=sinks, is_causal=True)
        else:
            prefix_band, mask = self.bands[window]
            out_prefix = scaled_dot_product_attention(
                q_prefix, k_prefix, v_prefix, sinks=sinks, attn_mask=prefix_band
            )
        out_prefix = F.pad(out_prefix, (0, 0, 0, n * width - self.prefix_len))
        out_prefix = out_prefix.reshape(q.shape[1], n, width, q.shape[3]).transpose(0, 1)

        out_rows = attend_after_prefix(q[n:], k[n:], v[n:], k_prefix, v_prefix, mask, sinks=sinks)
        return torch.cat([out_prefix, out_rows], dim=0)
