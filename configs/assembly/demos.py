"""The SFT warm start's demonstrations, from a config: a `toolgym record` file, or the env's
oracle rolled out here (`OraclePolicy` through the rollout runner, so they take the exact token
path a model's episodes take) with its imperfection knobs, e.g. `p_omit_tag = 0.5`: half the demos
state the answer without the env's answer format; `sft.processes` records them in that many
processes at once (an env whose steps are the cost, as TextWorld's interpreter is). Oracle task
seeds come from their own training stream (`sft_stream`), never from the held-out eval seeds nor
RL's (`rl_stream`).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from queue import Empty
from typing import Any

import msgspec
import torch
from tqdm import tqdm

from ...agents.chat import Renderer
from ...agents.tokenizer import tokenizer_fingerprint
from ...envs.registry import import_env_modules
from ...rollouts.batches import TaskSeedStream
from ...rollouts.episode.config import EnvRolloutConfig
from ...rollouts.episode.runner import RolloutRunner
from ...rollouts.recording.format import RecordingHeader, RecordingWriter, read_recording, rendering_of
from ...rollouts.recording.replay import OfflineMode, episodes_from_trajectories, summarize
from ...rollouts.scripted import OraclePolicy
from ...rollouts.types import Episode, Trajectory
from ...trainers.config import TrainerConfig
from ...trainers.sft import SFTSchedule
from ..load import ConfigError
from ..schema import Config
from .parts import build_renderer, run_chat_template_extra, usable_cores


def rl_stream(config: Config) -> int:
    """The RL task stream's id: 2 x run.seed."""
    return 2 * config.run.seed


def sft_stream(config: Config) -> int:
    """The oracle demonstrations' task stream's id: 2 x run.seed + 1."""
    return 2 * config.run.seed + 1


def check_demo_rendering(config: Config, renderer: Renderer, header: RecordingHeader) -> None:
    """Raise ConfigError (sft.recording, one line) unless the SFT recording's episodes were
    rendered as the run renders (the chat template its header records, or plain ChatML, against
    policy.chat_template): its tokens are what SFT trains on, and a warm start in another
    format than RL's would teach the model a format it never sees again."""
    recorded, recorded_key = rendering_of(header.extra)
    run, run_key = rendering_of(run_chat_template_extra(config))
    if recorded_key != run_key:
        raise ConfigError(
            "sft.recording",
            f"{config.sft.recording} was rendered with {recorded}, but this run renders with {run} "
            "(policy.chat_template, chat_template_kwargs): record the demonstrations with the run's template",
        )


def demo_trajectories(
    config: Config, renderer: Renderer, progress: bool = False
) -> tuple[list[Trajectory], str]:
    """The demonstrations and a description of where they came from. A recording must have been
    rendered as the run renders (`check_demo_rendering`). Oracle demos recorded in processes
    (`sft.processes`) are rendered by the run's renderer (`build_renderer`), not `renderer`.
    progress: a bar over the oracle's demonstrations as they finish (in every process)."""
    sft = config.sft
    if sft.source == "recording":
        header, trajectories = read_recording(sft.recording, tokenizer_fingerprint(renderer.tokenizer))
        check_demo_rendering(config, renderer, header)
        return trajectories, f"{sft.recording} ({header.policy_id})"
    seeds, group_ids = TaskSeedStream(stream=sft_stream(config)).take(sft.num_tasks)
    processes = min(sft.processes or usable_cores(), len(seeds))
    policy_id = OraclePolicy(renderer, sft.oracle).policy_id
    bar = tqdm(total=len(seeds), desc="sft demos", unit="demo", disable=not progress, dynamic_ncols=True)
    with bar:
        if processes <= 1:

            def count(_: Trajectory) -> None:
                bar.update(1)

            return oracle_trajectories(config, renderer, seeds, group_ids, count), policy_id
        # Contiguous shares, concatenated in order: an oracle episode depends only on its task seed,
        # so these are the demonstrations one process records, in the same order.
        bounds = [len(seeds) * k // processes for k in range(processes + 1)]
        context = multiprocessing.get_context("spawn")
        finished = context.Queue()  # one item per demonstration a process finishes: the bar's
        with ProcessPoolExecutor(
            processes, mp_context=context, initializer=_start_recorder, initargs=(os.getpid(), finished)
        ) as pool:
            shares = itertools.pairwise(bounds)
            futures = [pool.submit(_record_share, config, seeds[a:b], group_ids[a:b]) for a, b in shares]
            while bar.n < len(seeds):
                done = all(future.done() for future in futures)
                if done and any(future.exception() is not None for future in futures):
                    break  # a share failed: `result()` below raises its error
                try:
                    # a finished share's last items may still be in the pipe: wait for them then
                    finished.get(timeout=60.0 if done else 1.0)
                except Empty:
                    if done:
                        break
                    continue
                bar.update(1)
            trajectories = [t for future in futures for t in future.result()]
        return trajectories, policy_id


def demo_rollout(config: Config, **changes: Any) -> EnvRolloutConfig:
    """The rollout settings of the oracle's SFT demonstrations: the run's, with `sft.env_kwargs`,
    one episode a task seed and none guided (the oracle plays them all), and `changes`."""
    rollout = config.rollout_config(config.sft.env_kwargs)
    return msgspec.structs.replace(rollout, group_size=1, guided_samples=0, **changes)


def oracle_trajectories(
    config: Config,
    renderer: Renderer,
    seeds: list[int],
    group_ids: list[int],
    on_episode: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """The oracle's episodes of `seeds` (one each), through the rollout runner; `on_episode` is
    called with each as it finishes."""
    runner = RolloutRunner(OraclePolicy(renderer, config.sft.oracle), renderer, demo_rollout(config))
    return runner.run(seeds, group_ids=group_ids, on_episode=on_episode)


def exit_with_parent(parent: int) -> None:
    """A worker process's initializer: a daemon thread ends the process (exit status 1) within a
    second of its parent `parent` going, so a killed run leaves no process recording a share of
    demonstrations for nobody (a pool's worker otherwise runs until it next talks to the parent)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


_finished: Any = None  # a recording process's queue of finished demonstrations (`_start_recorder`)


def _start_recorder(parent: int, finished: Any) -> None:
    """A recording process's initializer: it ends with its parent (`exit_with_parent`) and puts one
    item on `finished` per demonstration it records, for the parent's progress bar."""
    global _finished
    exit_with_parent(parent)
    _finished = finished


def _record_share(config: Config, seeds: list[int], group_ids: list[int]) -> list[Trajectory]:
    """A recording process's share of the demonstrations (`sft.processes`): spawned, so it
    imports the user's env modules and builds the run's renderer itself (the toolgym envs
    register on import); one torch thread, as the envs are the work."""
    torch.set_num_threads(1)
    import_env_modules(config.env.modules, where="env.module")
    renderer, _ = build_renderer(config)
    finished = _finished
    on_episode = None if finished is None else lambda _: finished.put(None)
    return oracle_trajectories(config, renderer, seeds, group_ids, on_episode)


def demo_episodes(
    config: Config,
    renderer: Renderer,
    max_seq_len: int,
    record_to: Path | None = None,
    progress: bool = False,
) -> tuple[list[Episode], dict[str, float], str]:
    """(Episodes, metrics of the demos, source description). `record_to`: also write the demos.
    progress: a bar over the oracle's demonstrations (`demo_trajectories`)."""
    trajectories, source = demo_trajectories(config, renderer, progress)
    if record_to is not None and config.sft.source == "oracle":
        header = RecordingHeader(
            tokenizer_fingerprint=tokenizer_fingerprint(renderer.tokenizer),
            env_id=config.env.id,
            env_kwargs=dict(trajectories[0].env_kwargs if trajectories else config.env.kwargs),
            policy_id=source,
            extra=run_chat_template_extra(config),
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


def sft_trainer_config(config: Config) -> TrainerConfig:
    """[trainer] with [sft]'s optimizer, micro-batch and precision where set."""
    sft = config.sft
    return msgspec.structs.replace(
        config.trainer,
        optimizer=sft.optimizer,
        micro_batch_tokens=sft.micro_batch_tokens or config.trainer.micro_batch_tokens,
        precision=sft.precision or config.trainer.precision,
    )


def sft_schedule(config: Config) -> SFTSchedule:
    sft = config.sft
    return SFTSchedule(
        steps=sft.steps, batch_episodes=sft.batch_episodes, seed=config.run.seed, log_every=sft.log_every
    )
