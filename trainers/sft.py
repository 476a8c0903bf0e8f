"""The SFT warm start: cross-entropy on the tokens a demonstrator sampled, with the same Trainer.

Takes the demonstrations already built into Episodes (configs/assembly/demos.py makes them from an
oracle or a `toolgym record` file); each optimizer step trains on `batch_episodes` of them (a
seeded shuffle, epoch after epoch), for a fixed number of steps. Every rank builds the same demos
and the same batches; the Trainer gives each rank its share.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
import torch
from tqdm import tqdm

from ..agents.model.transformer import Transformer
from ..rollouts.types import Episode, PolicySampling
from .config import TrainerConfig
from .metrics_log import MetricsLog, sft_line
from .trainer import Trainer


class SFTSchedule(msgspec.Struct, kw_only=True, frozen=True):
    """How long SFT trains and how it draws batches: `steps` optimizer steps of `batch_episodes`
    episodes each, shuffled with `seed`, a console line every `log_every` steps."""

    steps: int
    batch_episodes: int
    seed: int = 0
    log_every: int = 10


class BatchOrder:
    """Endless seeded shuffles of range(n), cut into batches of `size` (one epoch after another)."""

    def __init__(self, n: int, size: int, seed: int) -> None:
        self.n, self.size = n, min(size, n)
        self.rng = np.random.default_rng(seed)
        self.queue: list[int] = []

    def next(self) -> list[int]:
        while len(self.queue) < self.size:
            self.queue += self.rng.permutation(self.n).tolist()
        batch, self.queue = self.queue[: self.size], self.queue[self.size :]
        return batch


def run_sft(
    model: Transformer,
    episodes: list[Episode],
    trainer_config: TrainerConfig,
    sampling: PolicySampling,
    schedule: SFTSchedule,
    log: MetricsLog,
    device: torch.device | str,
    progress: bool,
) -> Trainer:
    """Train `model` on `episodes` for `schedule.steps` optimizer steps; returns the trainer
    (whose model holds the result). Collective under torchrun."""
    trainer = Trainer(model, trainer_config, device=device, sampling=sampling)
    order = BatchOrder(len(episodes), schedule.batch_episodes, seed=schedule.seed)
    started = time.perf_counter()
    steps = schedule.steps
    with tqdm(total=steps, desc="sft", unit="step", disable=not progress, dynamic_ncols=True) as bar:
        for step in range(1, steps + 1):
            metrics = trainer.sft_step([episodes[i] for i in order.next()])
            record = {f"sft/{k}": v for k, v in metrics.items()}
            log.log("sft", step, record)
            if step % schedule.log_every == 0 or step == steps or metrics["skipped"]:
                log.print(sft_line(step, steps, record))
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
    log.print(f"sft: {steps} steps in {time.perf_counter() - started:.1f}s")
    return trainer
