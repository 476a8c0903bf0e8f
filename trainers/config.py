"""Typed configuration of the trainer (optimizer, schedule, batching, precision, checkpoints).

The sampling temperature is not here: the Trainer reads the policy's `PolicySampling`
(rollouts/types.py), the one the sampler reads."""

from __future__ import annotations

from typing import Literal

import msgspec

from .losses import LossConfig

MAX_LR = 1.0  # OptimizerConfig.lr's upper bound (AdamW's step is about lr per weight)

Decay = Literal["constant", "linear", "cosine"]
Precision = Literal["fp32", "bf16", "auto"]


class OptimizerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """AdamW with gradient-norm clipping and a warmup + decay learning-rate schedule.

    The schedule: linear warmup from 0 over `warmup_steps`, then `decay` down to
    lr x min_lr_ratio at `total_steps` (linear or cosine; constant keeps lr). Steps count
    optimizer updates. `loraplus_lr_ratio`: LoRA adapters' B matrices train at lr x this (LoRA+,
    PEFT's `loraplus_lr_ratio`); 1 = one lr for everything.
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    decay: Decay = "constant"
    total_steps: int = 0
    min_lr_ratio: float = 0.0
    loraplus_lr_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.lr <= MAX_LR:
            # AdamW moves every weight by about lr a step, whatever the gradient's scale
            raise ValueError(
                f"OptimizerConfig.lr must be in (0, {MAX_LR:g}], got {self.lr:g}: AdamW moves every weight "
                "by about lr each step, so a larger lr destroys the model"
            )
        if not all(0.0 <= b < 1.0 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"OptimizerConfig.betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError("OptimizerConfig.eps must be > 0 and weight_decay >= 0")
        if self.max_grad_norm <= 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm must be > 0, got {self.max_grad_norm}")
        if not self.loraplus_lr_ratio > 0:
            raise ValueError(f"OptimizerConfig.loraplus_lr_ratio must be > 0, got {self.loraplus_lr_ratio}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay not in ("constant", "linear", "cosine"):
            raise ValueError(f"OptimizerConfig.decay must be constant, linear or cosine, got {self.decay!r}")
        if self.decay != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"decay {self.decay!r} needs total_steps > warmup_steps "
                f"(got total_steps={self.total_steps}, warmup_steps={self.warmup_steps})"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimizerConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


class TrainerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything the Trainer needs besides the model.

    micro_batch_tokens: padded positions (rows x longest row) per forward/backward; bounds the
        activation memory and the one float32 logits tensor [micro-batch, vocab].
    precision: fp32, or bf16 (parameters and activations bf16 in compute, fp32 master weights,
        optimizer state and gradient reduction), or auto: bf16 where the hardware computes it
        natively (a GPU, or a CPU with AVX-512 BF16 / AMX), else fp32 (`training_precision`).
    compute_entropy: log the per-token entropy (a softmax pass over the vocab per micro-batch).
    share_prefix: compute an untrained prefix that all rows of a micro-batch share (the system
        prompt, a group's prompt) once instead of once per row (trainers/shared_prefix.py); the
        same loss and gradients up to float rounding, ~3x fewer positions on Zorplex.
    fused_head: run the output layer on the trained positions only, a chunk of rows at a time,
        straight into logprobs (trainers/logprobs.py `head_token_scores`): the [positions x vocab]
        logits never exist whole; the same loss and gradients up to float rounding.
    activation_checkpointing: keep only each decoder block's input in a training forward and
        recompute the block in backward: activation memory of one block instead of all of them,
        for one more forward's compute (a larger `micro_batch_tokens`, or a larger model, fits).
    compile: run each decoder block of a training forward through torch.compile (dynamic shapes;
        the first steps compile, tens of seconds on a CPU): fused elementwise kernels around the
        matmuls. The same results up to float rounding.
    replay_routes: a mixture of experts' forward sends each token to the experts the sampler
        chose (Episode.routes, recorded by the torch engine, which a run then asks it to do),
        where it has them, instead of its own top k; the router's weights of those experts still
        train. Off by default; `train/replayed_routes` logs the share of positions replayed.
    """

    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)
    micro_batch_tokens: int = 4096
    precision: Precision = "fp32"
    compute_entropy: bool = True
    share_prefix: bool = True
    fused_head: bool = True
    activation_checkpointing: bool = False
    compile: bool = False
    replay_routes: bool = False
    pad_token_id: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ValueError(f"TrainerConfig.micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.precision not in ("fp32", "bf16", "auto"):
            raise ValueError(f"TrainerConfig.precision must be fp32, bf16 or auto, got {self.precision!r}")
        if self.pad_token_id < 0:
            raise ValueError(f"TrainerConfig.pad_token_id must be >= 0, got {self.pad_token_id}")


class CheckpointConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where and how often to checkpoint. keep_last: how many step checkpoints to keep."""

    directory: str = "checkpoints"
    every_steps: int = 0  # 0: only when asked
    keep_last: int = 2

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"CheckpointConfig.keep_last must be >= 1, got {self.keep_last}")
        if self.every_steps < 0:
            raise ValueError(f"CheckpointConfig.every_steps must be >= 0, got {self.every_steps}")
