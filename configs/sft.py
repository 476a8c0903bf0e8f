"""The SFT warm start: cross-entropy on the tokens a demonstrator sampled, with the same Trainer.

Demonstrations come from a `toolgym record` file, or are generated here by the env's oracle
(`OraclePolicy` through the rollout runner, so they take the exact token path a model's episodes
take) with its imperfection knobs, e.g. `p_omit_tag = 0.5`: half the demos state the answer
without the env's answer format. Oracle task seeds come from their own training stream (2 * run.seed
+ 1; RL uses 2 * run.seed), never from the held-out eval seeds.

Efficiency: the demos are built once into Episodes; each optimizer step trains on
`batch_episodes` of them (a seeded shuffle, epoch after epoch), for a fixed number of steps.
Every rank builds the same demos and the same batches; the Trainer gives each rank its share.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import numpy as np
from tqdm import tqdm

from ..agents.chat import Renderer
from ..agents.model.transformer import Transformer
from ..agents.tokenizer import tokenizer_fingerprint
from ..rollouts.batches import TaskSeedStream
from ..rollouts.recording.format import RecordingHeader, RecordingWriter, read_recording, rendering_of
from ..rollouts.recording.replay import OfflineMode, episodes_from_trajectories, summarize
from ..rollouts.runner import RolloutRunner
from ..rollouts.scripted import OraclePolicy
from ..rollouts.types import Episode, Trajectory
from ..trainers.trainer import Trainer
from .load import ConfigError
from .loop import chat_template_extra
from .metrics_log import MetricsLog, sft_line
from .schema import Config


def rl_stream(config: Config) -> int:
    return 2 * config.run.seed


def sft_stream(config: Config) -> int:
    return 2 * config.run.seed + 1


def check_demo_rendering(config: Config, renderer: Renderer, header: RecordingHeader) -> None:
    """Raise ConfigError (sft.recording, one line) unless the SFT recording's episodes were
    rendered as the run renders (the chat template its header records, or plain ChatML, against
    policy.chat_template): its tokens are what SFT trains on, and a warm start in another
    format than RL's would teach the model a format it never sees again."""
    recorded, recorded_key = rendering_of(header.extra)
    run, run_key = rendering_of(chat_template_extra(config, renderer))
    if recorded_key != run_key:
        raise ConfigError(
            "sft.recording",
            f"{config.sft.recording} was rendered with {recorded}, but this run renders with {run} "
            "(policy.chat_template, chat_template_kwargs): record the demonstrations with the run's template",
        )


def demo_trajectories(config: Config, renderer: Renderer) -> tuple[list[Trajectory], str]:
    """The demonstrations and a description of where they came from. A recording must have been
    rendered as the run renders (`check_demo_rendering`)."""
    sft = config.sft
    if sft.source == "recording":
        header, trajectories = read_recording(sft.recording, tokenizer_fingerprint(renderer.tokenizer))
        check_demo_rendering(config, renderer, header)
        return trajectories, f"{sft.recording} ({header.policy_id})"
    rollout = msgspec.structs.replace(config.rollout_config(sft.env_kwargs), group_size=1)
    policy = OraclePolicy(renderer, sft.oracle)
    seeds, group_ids = TaskSeedStream(stream=sft_stream(config)).take(sft.num_tasks)
    trajectories = RolloutRunner(policy, renderer, rollout).run(seeds, group_ids=group_ids)
    return trajectories, policy.policy_id


def demo_episodes(
    config: Config, renderer: Renderer, max_seq_len: int, record_to: Path | None = None
) -> tuple[list[Episode], dict[str, float], str]:
    """(Episodes, metrics of the demos, source description). `record_to`: also write the demos."""
    trajectories, source = demo_trajectories(config, renderer)
    if record_to is not None and config.sft.source == "oracle":
        header = RecordingHeader(
            tokenizer_fingerprint=tokenizer_fingerprint(renderer.tokenizer),
            env_id=config.env.id,
            env_kwargs=dict(trajectories[0].env_kwargs if trajectories else config.env.kwargs),
            policy_id=source,
            extra=chat_template_extra(config, renderer),
        )
        with RecordingWriter(record_to, header) as writer:
            writer.write_all(trajectories)
    episodes, stats = episodes_from_trajectories(
        trajectories, OfflineMode.SFT, only_successful=config.sft.only_successful, max_seq_len=max_seq_len
    )
    if not episodes:
        raise ValueError(f"the SFT demonstrations from {source} give no trainable episodes")
    metrics = {f"sft_data/{k}": float(v) for k, v in summarize(trajectories).items() if isinstance(v, int | float)}
    metrics.update(stats.as_metrics("sft_data/episodes_"))
    return episodes, metrics, source


def sft_trainer_config(config: Config):
    sft = config.sft
    return msgspec.structs.replace(
        config.trainer,
        optimizer=sft.optimizer,
        micro_batch_tokens=sft.micro_batch_tokens or config.trainer.micro_batch_tokens,
        precision=sft.precision or config.trainer.precision,
    )


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
    config: Config,
    model: Transformer,
    episodes: list[Episode],
    log: MetricsLog,
    device,
    progress: bool,
) -> Trainer:
    """Train `model` on `episodes` for sft.steps optimizer steps; returns the trainer (whose model
    holds the result). Collective under torchrun."""
    sft = config.sft
    trainer = Trainer(model, sft_trainer_config(config), device=device, sampling=config.policy)
    order = BatchOrder(len(episodes), sft.batch_episodes, seed=config.run.seed)
    started = time.perf_counter()
    with tqdm(total=sft.steps, desc="sft", unit="step", disable=not progress, dynamic_ncols=True) as bar:
        for step in range(1, sft.steps + 1):
            metrics = trainer.sft_step([episodes[i] for i in order.next()])
            record = {f"sft/{k}": v for k, v in metrics.items()}
            log.log("sft", step, record)
            if step % sft.log_every == 0 or step == sft.steps or metrics["skipped"]:
                log.print(sft_line(step, sft.steps, record))
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
    log.print(f"sft: {sft.steps} steps in {time.perf_counter() - started:.1f}s")
    return trainer
