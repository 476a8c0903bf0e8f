"""The FSDP2 policy trainer: Episodes in, one optimizer step, metrics out.

(One process trains the plain model: there FSDP2 would not shard, only copy; in bf16 its forwards
then run under `torch.autocast`. See `shard_model`.)

Every rank calls `train_step` with the same list of Episodes and trains on its own share
(`sharded=True` when each rank passes only its own). Loss counts are all-reduced first, so the
summed gradient over micro-batches and ranks is the gradient of the whole batch's loss.

    trainer = Trainer(model, TrainerConfig(loss=LossConfig(name="dapo")))
    metrics = trainer.train_step(episodes)      # RL step
    metrics = trainer.sft_step(episodes)        # cross-entropy on loss_mask tokens

Per micro-batch the Trainer runs the model's forward (trainers/forward.py: whole logits, or the
fused head's scores of the trained positions, under its precision) and the configured loss
(trainers/losses/); a MicroBatch only holds the data.

The optimizer holds the parameters that require grad (all of them, or LoRA's adapters over a frozen
base: agents/model/lora.py); clipping is over their gradients.

A non-finite loss or gradient norm skips the update (weights and optimizer state untouched) and
is reported as metrics["skipped"] = 1. `trainer.step` counts applied updates: it is the policy
version of the current weights.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..agents.model.lora import adapted_weights
from ..agents.model.moe import load_balancing_loss, moe_blocks
from ..agents.model.transformer import Transformer
from ..rollouts.types import Episode, PolicySampling
from .batching import MicroBatch, empty_micro_batch, make_micro_batches, shard_episodes
from .config import OptimizerConfig, TrainerConfig
from .distributed import (
    all_gather_objects,
    all_reduce,
    device_mesh,
    init_distributed,
    shard_model,
    training_precision,
)
from .forward import batch_logits, batch_scores
from .logprobs import TokenScores, entropy_from_logits, logits_token_scores, token_logprobs
from .losses import LossNormaliser, TopKForwardKL, combine_metrics, finish_metrics, policy_loss

log = logging.getLogger(__name__)

# (micro-batch, normaliser) -> (loss, metrics); the loss runs its own forward (Trainer._scores)
MicroBatchLoss = Callable[[MicroBatch, LossNormaliser], tuple[Tensor, dict[str, Tensor]]]


def lr_factor(step: int, config: OptimizerConfig) -> float:
    """The learning-rate multiplier for update number `step` (0-based): warmup then decay."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.decay == "constant":
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.total_steps - config.warmup_steps))
    floor = config.min_lr_ratio
    if config.decay == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Trainer:
    """Owns the sharded model, the optimizer and the schedule. See the module doc."""

    def __init__(
        self,
        model: nn.Module,
        config: TrainerConfig,
        *,
        reference_model: nn.Module | None = None,
        device: str | torch.device | None = None,
        sampling: PolicySampling | None = None,
        forward_kl_weight: float = 0.0,
    ) -> None:
        """`sampling`: how the policy samples (default: temperature 1); logprobs are taken of
        logits / sampling.temperature so the ratio to the sampler's logprobs compares like with
        like. `forward_kl_weight` (on-policy distillation's, rollouts/scoring/distill.py
        `DistillConfig.forward_kl`): > 0 adds the top-k forward KL to the teacher
        (losses/terms.py `TopKForwardKL`) on the episodes that carry the teacher's top-k."""
        if not (math.isfinite(forward_kl_weight) and forward_kl_weight >= 0):
            raise ValueError(f"forward_kl_weight must be a finite number >= 0, got {forward_kl_weight}")
        self.forward_kl_weight = forward_kl_weight
        self.config = config
        self.temperature = (sampling or PolicySampling()).temperature
        if not self.temperature > 0:
            raise ValueError(f"the trainer needs a sampling temperature > 0, got {self.temperature}")
        self.dist = init_distributed(device)
        self.device = self.dist.device
        self.mesh = device_mesh(self.dist)
        self.model_config = getattr(model, "config", None)
        self.vocab_size = getattr(self.model_config, "vocab_size", None)
        self.precision = training_precision(config.precision, self.device)
        for option, flag in (("activation_checkpointing", "checkpoint_layers"), ("compile", "compile_layers")):
            if getattr(config, option):
                stack = getattr(model, "model", None)
                if not hasattr(stack, flag):
                    raise ValueError(f"trainer.{option} needs toolgym's Transformer (agents/model)")
                setattr(stack, flag, True)
        self.model = shard_model(model.to(self.device), self.mesh, self.precision)
        # A shared prefix is attended to as k/v: a model with linear-attention layers (a recurrent
        # state) computes every row whole instead.
        self._share_prefix = config.share_prefix and not getattr(self.model_config, "linear_attention", False)
        # The fused head needs our Transformer's `head=`; any other model gives logits.
        self._fused_head = config.fused_head and isinstance(model, Transformer)
        # A mixture of experts' routers keep their logits for the load-balancing loss and metric.
        self._routers = moe_blocks(self.model)
        for router in self._routers:
            router.keep_router_logits = True
        if config.replay_routes and not self._routers:
            raise ValueError(
                "trainer.replay_routes needs a mixture-of-experts model (this one has no routers)"
            )
        self.reference_model = None
        if config.loss.kl_coef > 0:
            if reference_model is None:
                raise ValueError("loss.kl_coef > 0 needs a reference_model")
            reference_model.requires_grad_(False)
            self.reference_model = shard_model(reference_model.to(self.device), self.mesh, self.precision)
        opt = config.optimizer
        # Only what trains: with LoRA (agents/model/lora.py) the adapters, the frozen base has
        # neither optimizer state nor gradients.
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the model has no trainable parameters (every requires_grad is False)")
        # LoRA+ (opt.loraplus_lr_ratio): the adapters' B matrices in a group of their own, at
        # lr x the ratio; otherwise one group, in the model's order (what checkpoints hold).
        params: list[nn.Parameter] | list[dict] = self.trainable
        lora_b = {id(adapted.lora_B) for adapted in adapted_weights(self.model)}
        if lora_b and opt.loraplus_lr_ratio != 1.0:
            params = [
                {"params": [p for p in self.trainable if id(p) not in lora_b]},
                {
                    "params": [p for p in self.trainable if id(p) in lora_b],
                    "lr": opt.lr * opt.loraplus_lr_ratio,
                },
            ]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            # One fused kernel over all parameters, faster than the foreach form (bench/RESULTS.md,
            # "bench/vs_trl.py"); CPU, CUDA and FSDP2's DTensors have it.
            fused=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, opt))
        # bf16 on an unwrapped model (one process): autocast, as FSDP2's mixed precision would cast.
        self._autocast = self.precision == "bf16" and not isinstance(self.model, FSDPModule)
        self.step = 0  # applied optimizer updates == policy version
        self.skipped_steps = 0

    # ---- public API -------------------------------------------------------------------------

    def train_step(self, episodes: Sequence[Episode], *, sharded: bool = False) -> dict[str, float]:
        """One policy-gradient update on `episodes` with the configured loss."""
        return self._step(episodes, self.policy_loss, sharded)

    def sft_step(self, episodes: Sequence[Episode], *, sharded: bool = False) -> dict[str, float]:
        """One supervised update: mean cross-entropy over all loss_mask tokens of the batch."""
        return self._step(episodes, self.sft_loss, sharded)

    def policy_loss(self, mb: MicroBatch, norm: LossNormaliser) -> tuple[Tensor, dict[str, Tensor]]:
        """The configured RL loss of one micro-batch (a MicroBatchLoss)."""
        loss_config, temperature = self.config.loss, self.temperature
        # With the top-k forward KL, the same pass also scores the teacher's top-k tokens.
        top_ids = mb.teacher_topk_ids if self.forward_kl_weight > 0 else None
        targets = mb.targets if top_ids is None else torch.cat([mb.targets[..., None], top_ids], dim=-1)
        if loss_config.entropy_coef > 0:  # an entropy bonus trains the entropy: whole logits
            logits = self._logits(mb, self.model)
            logprobs = token_logprobs(logits, targets, temperature)
            entropy = entropy_from_logits(logits, temperature)
        else:  # the entropy is a metric only (no grad), from the same pass over the logits
            logprobs, entropy, _ = self._scores(
                mb, self.model, temperature, targets=targets, with_entropy=self.config.compute_entropy
            )
        extra_terms = []
        if self.forward_kl_weight > 0:
            if top_ids is None or mb.teacher_topk_logprobs is None:  # none in this batch: a 0 term
                student = teacher = logprobs.new_zeros((*logprobs.shape, 0))
            else:
                student, teacher, logprobs = logprobs[..., 1:], mb.teacher_topk_logprobs, logprobs[..., 0]
            extra_terms.append(TopKForwardKL(self.forward_kl_weight, student, teacher))
        ref_logprobs = None
        if self.reference_model is not None:
            with torch.no_grad():
                ref_logprobs = self._scores(mb, self.reference_model, temperature).logprobs
        sampler_logprobs = mb.sampler_logprobs
        if mb.guided is not None:  # the oracle's rows: no sampler logprobs, the trainer's own (ratio 1)
            sampler_logprobs = torch.where(mb.guided[:, None], logprobs.detach().float(), sampler_logprobs)
        loss, metrics = policy_loss(
            loss_config,
            logprobs,
            sampler_logprobs,
            mb.advantages,
            mb.loss_mask,
            normaliser=norm,
            ref_logprobs=ref_logprobs,
            entropy=entropy,
            staleness=(self.step - mb.versions).clamp(min=0),
            extra_terms=extra_terms,
        )
        if self._routers:
            aux = self._router_aux(mb)
            metrics["router_aux"] = aux.detach()
            if loss_config.router_aux_coef > 0:
                share = mb.loss_mask.sum() / max(norm.num_tokens, 1.0)
                loss = loss + loss_config.router_aux_coef * share * aux
        return loss, metrics

    @contextlib.contextmanager
    def _replaying(self, mb: MicroBatch) -> Iterator[Tensor | None]:
        """With replay_routes, the routers take mb's recorded routes for the forward (and
        backward) inside; yields the share of mb's trained positions whose every layer's routes
        were recorded (a prompt position's last layer may have none: agents/engine/routes.py)."""
        if not (self.config.replay_routes and mb.routes is not None):
            yield None
            return
        routes = mb.routes
        if routes.shape[2] != len(self._routers) or routes.shape[3] != self._routers[0].top_k:
            raise ValueError(
                f"episodes carry routes of {routes.shape[2]} layers x top {routes.shape[3]}; the model has "
                f"{len(self._routers)} MoE layers x top {self._routers[0].top_k}"
            )
        for layer, router in enumerate(self._routers):
            router.replay = routes[:, :, layer].reshape(-1, routes.shape[3])
        known = (routes[mb.prefix_rows :] >= 0).all(-1).all(-1)
        try:
            yield (known & mb.loss_mask).sum() / mb.loss_mask.sum().clamp(min=1)
        finally:
            for router in self._routers:
                router.replay = None

    def _router_aux(self, mb: MicroBatch) -> Tensor:
        """The load-balancing loss of the routers' logits of mb's forward, over its real positions
        (a shared prefix's rows counted once)."""
        logits = [router.router_logits for router in self._routers]
        if any(x is None for x in logits):
            raise RuntimeError("a router kept no logits: the forward did not run every MoE layer")
        width = mb.input_ids.shape[1]
        real = mb.real_positions()
        if mb.prefix_rows:
            prefix = (torch.arange(width, device=real.device) < mb.prefix_len).expand(mb.prefix_rows, width)
            real = torch.cat([prefix, real])
        top_k = self._routers[0].top_k
        return load_balancing_loss([x for x in logits if x is not None], top_k, real)

    def sft_loss(self, mb: MicroBatch, norm: LossNormaliser) -> tuple[Tensor, dict[str, Tensor]]:
        """Cross-entropy on loss_mask tokens over the step's token count (a MicroBatchLoss)."""
        logprobs, _, argmax = self._scores(mb, self.model, 1.0, with_argmax=True)
        assert argmax is not None
        mask = mb.loss_mask
        loss = -torch.where(mask, logprobs, torch.zeros_like(logprobs)).sum() / max(norm.num_tokens, 1.0)
        with torch.no_grad():
            correct = (argmax == mb.targets) & mask
            metrics = {
                "loss": loss.detach(),
                "token_accuracy": correct.sum() / mask.sum().clamp(min=1),
                "num_tokens": mask.sum().float(),
                "num_sequences": mask.any(dim=-1).sum().float(),
            }
        return loss, metrics

    @torch.no_grad()
    def compute_logprobs(
        self, episodes: Sequence[Episode], temperature: float | None = None
    ) -> list[list[float]]:
        """Current-policy logprob of every token of every episode (0.0 for token 0), all on every rank.

        Collective: every rank must call it with the same episodes.
        """
        temperature = self.temperature if temperature is None else temperature
        out: list[list[float]] = [[0.0] * len(e.tokens) for e in episodes]
        for mb in make_micro_batches(
            episodes, self.config.micro_batch_tokens, self.config.pad_token_id, self.vocab_size
        ):
            mb = mb.to(self.device)
            with self._replaying(mb):
                logprobs = self._scores(mb, self.model, temperature, select=mb.real_positions()).logprobs
            for row, (index, n) in enumerate(
                zip(mb.episode_index.tolist(), mb.lengths.tolist(), strict=True)
            ):
                out[index][1:] = logprobs[row, :n].tolist()
        return out

    def _logits(self, mb: MicroBatch, model: nn.Module) -> Tensor:
        """`model`'s whole logits of mb's episode rows [B, T, V] (trainers/forward.py)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast):
            return batch_logits(model, mb)

    def _scores(
        self,
        mb: MicroBatch,
        model: nn.Module,
        temperature: float,
        *,
        select: Tensor | None = None,
        targets: Tensor | None = None,
        with_entropy: bool = False,
        with_argmax: bool = False,
    ) -> TokenScores:
        """`model`'s TokenScores of `targets` (default mb.targets; [B, T, C]: C tokens a position)
        at `select` (default: its loss mask; other positions may hold anything): the fused head
        where it applies (TrainerConfig.fused_head), else the whole logits."""
        if self._fused_head:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast):
                return batch_scores(
                    model, mb, temperature, select=select, targets=targets, with_entropy=with_entropy,
                    with_argmax=with_argmax,
                )  # fmt: skip
        logits = self._logits(mb, model)
        targets = mb.targets if targets is None else targets
        return TokenScores(*logits_token_scores(logits, targets, temperature, with_entropy, with_argmax))

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # ---- one step ---------------------------------------------------------------------------

    def _local_batches(self, episodes: Sequence[Episode], sharded: bool) -> list[MicroBatch]:
        if not sharded:
            mine = shard_episodes([len(e.tokens) for e in episodes], self.dist.rank, self.dist.world_size)
            episodes = [episodes[i] for i in mine]
        batches = make_micro_batches(
            episodes,
            self.config.micro_batch_tokens,
            self.config.pad_token_id,
            self.vocab_size,
            share_prefix=self._share_prefix,
        )
        # FSDP forward/backward are collectives: every rank runs the same number of micro-batches.
        (most,) = all_reduce([float(len(batches))], torch.distributed.ReduceOp.MAX)
        batches += [empty_micro_batch(self.config.pad_token_id) for _ in range(int(most) - len(batches))]
        return batches

    def _step(self, episodes: Sequence[Episode], loss_fn: MicroBatchLoss, sharded: bool) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self._forward_backward(episodes, loss_fn, sharded)
        grad_norm = self._clip_grad_norm()
        skipped = not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm))
        lr = self.lr
        if skipped:
            self.skipped_steps += 1
            log.warning("non-finite loss %s or grad norm %s: update skipped", metrics["loss"], grad_norm)
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        metrics.update(
            grad_norm=grad_norm,
            lr=lr,
            skipped=float(skipped),
            step=float(self.step),
            step_time_s=elapsed,
            tokens_per_s=metrics["num_positions"] / elapsed,
        )
        return metrics

    def _forward_backward(
        self, episodes: Sequence[Episode], loss_fn: MicroBatchLoss, sharded: bool
    ) -> dict[str, float]:
        """Accumulate this rank's gradients of the whole batch's loss; return the step's metrics."""
        self.model.train()
        batches = self._local_batches(episodes, sharded)
        local_counts = [
            sum(float(mb.loss_mask.sum()) for mb in batches),
            sum(float(mb.loss_mask.any(dim=-1).sum()) for mb in batches),
            sum(float(mb.num_real_tokens) for mb in batches),
            sum(float(mb.num_padded_tokens) for mb in batches),
        ]
        num_tokens, num_sequences, positions, padded = all_reduce(local_counts)
        normaliser = LossNormaliser(num_tokens, num_sequences)

        parts: list[dict[str, Tensor]] = []
        local_loss = torch.zeros((), dtype=torch.float64, device=self.device)  # no host sync per micro-batch
        for i, host_batch in enumerate(batches):
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(i == len(batches) - 1)
            mb = host_batch.to(self.device)
            with self._replaying(mb) as replayed:
                loss, metrics = loss_fn(mb, normaliser)
                loss.backward()  # inside: activation checkpointing routes again in backward
            if replayed is not None:
                metrics["replayed_routes"] = replayed
            local_loss += loss.detach().double()
            if host_batch.num_real_tokens > 0:  # not a filler batch
                parts.append(metrics)

        (global_loss,) = all_reduce([float(local_loss)])
        # one device-to-host copy per micro-batch for all of its metrics
        local = combine_metrics(
            [dict(zip(m, torch.stack([v.double() for v in m.values()]).tolist(), strict=True)) for m in parts]
        )
        metrics = finish_metrics(combine_metrics([m for m in all_gather_objects(local) if m]))
        metrics.update(
            loss=global_loss,
            num_micro_batches=float(len(batches)),
            num_positions=positions,
            padding_frac=1.0 - positions / max(padded, 1.0),
        )
        return metrics

    def _clip_grad_norm(self) -> float:
        """Clip to max_grad_norm; return the global norm before clipping (nan/inf if non-finite)."""
        params = [p for p in self.trainable if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return 0.0
        total = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        norm = float(total)
        if math.isfinite(norm):
            torch.nn.utils.clip_grads_with_norm_(
                params, self.config.optimizer.max_grad_norm, total, foreach=True
            )
        return norm
