"""`toolgym envs`, `record` and `eval`: commands that roll a policy out on envs.

Each function prints to `console` and returns a process exit code.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium
import msgspec
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from ...agents.chat import Renderer
from ...agents.tokenizer import tokenizer_fingerprint
from ...envs import list_envs
from ...envs.core.info import SUCCESS_METRIC
from ...envs.registry import import_env_modules
from ...rollouts.batches import TaskSeedStream
from ...rollouts.episode.config import EnvRolloutConfig
from ...rollouts.episode.runner import RolloutRunner
from ...rollouts.evaluation import EvalConfig, evaluate_sync
from ...rollouts.recording.format import (
    RecordingHeader,
    RecordingReader,
    RecordingWriter,
)
from ...rollouts.recording.replay import errored, summarize
from ...rollouts.scripted import OracleConfig
from ..assembly.parts import ORACLE, chat_template_extra, load_policy, policy_renderer
from ..checks import command_format_notes
from .recordings import hash_seed_extra
from .summary import error_text, print_summary


def envs_command(console: Console, env_modules: Sequence[str] = ()) -> int:
    """The toolgym envs and those `env_modules` register (imported first; any namespace), each
    with its default keyword arguments. An id counts as registered by a module when importing it
    added the id, or when its entry point lives in that module or below (a module imported
    earlier registers nothing new on a second import)."""
    before = set(gymnasium.registry)
    import_env_modules(env_modules)
    added = set(gymnasium.registry) - before
    added |= {env_id for env_id, spec in gymnasium.registry.items() if _entry_in(spec, env_modules)}
    table = Table("env id", "default keyword arguments")
    for env_id, kwargs in list_envs(added).items():
        table.add_row(env_id, json.dumps(kwargs, default=str))
    console.print(table)
    return 0


def _entry_in(spec: Any, modules: Sequence[str]) -> bool:
    """Whether an env spec's entry point lives in one of `modules` or below."""
    entry = spec.entry_point
    where = entry.partition(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", None)
    return isinstance(where, str) and any(where == m or where.startswith(f"{m}.") for m in modules)


def record_command(
    console: Console,
    rollout: EnvRolloutConfig,
    policy_spec: str,
    oracle: OracleConfig,
    tokenizer_path: str | os.PathLike,
    out: str | os.PathLike,
    num_tasks: int,
    stream: int = 0,
    start: int | None = None,
    progress: bool = True,
    env_modules: Sequence[str] = (),
    chat_template: str = "",
) -> int:
    """Roll out `num_tasks` training task seeds x group_size episodes and append them to `out`.

    Task seeds come from the training stream (never eval seeds). When `out` already exists and
    `start` is None, the stream continues after the largest group id in the file. `env_modules`
    are imported first (they register the user's envs with gymnasium).

    Returns 1 (a line on stderr with the first error) when every episode is error-only
    (`replay.errored`: env_error, or no steps): nothing usable was recorded. A batch with some
    errored episodes returns 0 and prints their count.
    """
    import_env_modules(env_modules)
    renderer = policy_renderer(policy_spec, tokenizer_path, chat_template)
    _print_format_notes(console, rollout, renderer, policy_spec)
    policy, policy_id = load_policy(policy_spec, renderer, oracle)
    fingerprint = tokenizer_fingerprint(renderer.tokenizer)
    if start is None:
        start = 0
        if Path(out).exists() and Path(out).stat().st_size > 0:
            start = 1 + max((t.group_id for t in RecordingReader(out, fingerprint)), default=-1)
    header = RecordingHeader(
        tokenizer_fingerprint=fingerprint,
        env_id=rollout.env_id,
        env_kwargs=rollout.env_kwargs,
        policy_id=policy_id,
        extra={
            "rollout_config": msgspec.to_builtins(rollout),
            "task_stream": stream,
            **hash_seed_extra(),
            **chat_template_extra(chat_template),
        },
    )
    seeds, group_ids = TaskSeedStream(stream=stream, position=start).take(num_tasks)
    runner = RolloutRunner(policy, renderer, rollout)
    with (
        RecordingWriter(out, header) as writer,
        tqdm(total=num_tasks * rollout.group_size, unit="ep", desc="record", disable=not progress) as bar,
    ):

        def done(trajectory: Any) -> None:
            writer.write(trajectory)
            bar.update(1)

        trajectories = runner.run(seeds, group_ids=group_ids, on_episode=done)
    policy.close()
    summary = summarize(trajectories)
    print_summary(console, summary, f"recorded {len(trajectories)} episodes to {out}")
    if policy_spec == ORACLE and _oracle_fell_short(console, summary, oracle):
        return 1
    failed = [t for t in trajectories if errored(t)]
    if not failed:
        return 0
    first = error_text(failed[0])
    if len(failed) == len(trajectories):
        print(
            f"toolgym record: error: every episode errored ({len(failed)} of {len(trajectories)}: "
            f"env_error or no steps); the first: {first}",
            file=sys.stderr,
        )
        return 1
    console.print(
        f"errored: {len(failed)} of {len(trajectories)} episodes (env_error or no steps); the first: {first}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return 0


def _print_format_notes(console: Console, rollout: EnvRolloutConfig, renderer: Renderer, policy_spec: str) -> None:
    """The lines `toolgym train` prints at start where the env's tool-call format and the chat
    template disagree (configs/checks.py's format_notes), with this command's flags."""
    for line in command_format_notes(rollout.env_id, rollout.env_kwargs, renderer, policy_spec):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _oracle_fell_short(console: Console, summary: dict[str, float], oracle: OracleConfig) -> bool:
    """Warn when the oracle's episodes did not all succeed (the env's `success` metric): with
    knobs that make it fallible that is the point, without them a limit cut its answers (e.g. an
    answer longer than the env's max_action_chars). True (an error on stderr) when an oracle
    without knobs succeeded on none: the recording holds no demonstration worth training on."""
    success = summary.get(SUCCESS_METRIC)
    if success is None or success >= 1.0:
        return False
    modes = ", ".join(
        f"{key.removeprefix('failure_mode/')} {value:.2f}"
        for key, value in sorted(summary.items())
        if key.startswith("failure_mode/") and key != f"failure_mode/{SUCCESS_METRIC}" and value > 0
    )
    fallible = oracle != OracleConfig()
    why = (
        "its knobs (--p-omit-tag, ...) make it fallible"
        if fallible
        else "an oracle without knobs succeeds: a limit cut its episodes (the env's max_action_chars, "
        "--max-turns, --max-tokens-per-turn ...)"
    )
    if not fallible and success == 0.0:
        print(f"toolgym record: error: the oracle succeeded on no episode ({modes}); {why}", file=sys.stderr)
        return True
    console.print(
        f"warning: the oracle succeeded on {success:.2f} of its episodes ({modes}); {why}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return False


def eval_command(
    console: Console,
    rollout: EnvRolloutConfig,
    policy_spec: str,
    oracle: OracleConfig,
    tokenizer_path: str | os.PathLike,
    eval_config: EvalConfig,
    out: str | os.PathLike | None = None,
    env_modules: Sequence[str] = (),
    chat_template: str = "",
) -> int:
    """Evaluate a policy on the held-out task seeds; `env_modules` are imported first (they
    register the user's envs with gymnasium). `chat_template`: see `policy_renderer` (configs/assembly/parts.py)."""
    import_env_modules(env_modules)
    renderer = policy_renderer(policy_spec, tokenizer_path, chat_template)
    _print_format_notes(console, rollout, renderer, policy_spec)
    policy, policy_id = load_policy(policy_spec, renderer, oracle)
    report = evaluate_sync(policy, renderer, rollout, eval_config, keep_trajectories=False)
    policy.close()
    for example in report.examples:
        console.print(example, markup=False, highlight=False, soft_wrap=True)
    metrics = {k.removeprefix("eval/"): v for k, v in report.metrics.items()}
    print_summary(console, metrics, f"eval of {policy_id} on {rollout.env_id} {rollout.env_kwargs}")
    if out is not None:
        Path(out).write_text(json.dumps({"policy": policy_id, "metrics": report.metrics}, indent=2) + "\n")
    return 0
