"""The model's forward over a MicroBatch, for the Trainer: whole logits, or TokenScores straight
from the final hidden states (the fused head). A MicroBatch only holds the data
(trainers/batching.py); the Trainer runs these under its precision (trainers/trainer.py).

A shared prefix (MicroBatch.prefix_rows > 0) is attended across in one place, `run_model`:
the prefix rows of `input_ids` are computed once and the episode rows attend to them
(trainers/shared_prefix.py); the outputs drop the prefix rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from ..agents.model.config import ModelConfig
from .batching import MicroBatch
from .logprobs import TokenScores, head_token_scores
from .shared_prefix import SharedPrefixAttention


def run_model(model: Callable[..., Any], mb: MicroBatch, **kwargs: Any) -> Any:
    """`model` on mb.input_ids, attending across the shared prefix rows when there are any."""
    if not mb.prefix_rows:
        return model(mb.input_ids, **kwargs)
    config = getattr(model, "config", None)  # a native model's: its layers' sliding windows
    windows = (
        [config.layer_window(i) for i in range(config.num_hidden_layers)]
        if isinstance(config, ModelConfig)
        else []
    )
    attention = SharedPrefixAttention(
        mb.prefix_rows, mb.prefix_len, mb.input_ids.shape[1], mb.input_ids.device, windows
    )
    return model(mb.input_ids, mb.positions, cache=attention, **kwargs)


def batch_logits(model: Callable[..., Tensor], mb: MicroBatch) -> Tensor:
    """`model`'s logits for the episode rows: [B, T, V] (the shared prefix rows dropped)."""
    return run_model(model, mb)[mb.prefix_rows :]


def batch_scores(
    model: Callable[..., TokenScores],
    mb: MicroBatch,
    temperature: float = 1.0,
    *,
    select: Tensor | None = None,
    targets: Tensor | None = None,
    with_entropy: bool = False,
    with_argmax: bool = False,
) -> TokenScores:
    """`model`'s TokenScores of `targets` (default mb.targets [B, T]; [B, T, C] scores C tokens a
    position, its logprobs then [B, T, C]) at the `select`ed positions (bool [B, T]; default the
    loss mask), 0 elsewhere: the output layer runs on those rows of the final hidden states alone
    (`head_token_scores`). `model` takes a `head=` (agents/model/transformer.py)."""
    select = mb.loss_mask if select is None else select
    targets = (mb.targets if targets is None else targets)[select]

    def head(hidden: Tensor, lm_head: nn.Module) -> TokenScores:
        picked = hidden[mb.prefix_rows :][select]
        logprobs, entropy, argmax = head_token_scores(
            picked, lm_head, targets, temperature, with_entropy=with_entropy, with_argmax=with_argmax
        )
        return TokenScores(
            _place(logprobs, select),
            None if entropy is None else _place(entropy, select),
            None if argmax is None else _place(argmax, select),
        )

    return run_model(model, mb, head=head)


def _place(values: Tensor, select: Tensor) -> Tensor:
    """values [select.sum(), ...] at the True positions of select [B, T] ([B, T, ...] out), 0
    elsewhere (differentiable)."""
    shape = select.shape + values.shape[1:]
    where = select.reshape(select.shape + (1,) * (values.dim() - 1)).expand(shape)
    return values.new_zeros(shape).masked_scatter(where, values)
