"""What the `toolgym envs|record|replay|eval` commands do (configs/cli.py only parses arguments).

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

from ..agents.chat import ChatRenderer, Renderer
from ..agents.policy import Policy
from ..agents.tokenizer import load_tokenizer, tokenizer_fingerprint
from ..envs import list_envs
from ..envs.registry import check_env_id, import_env_modules
from .evaluation import EvalConfig, evaluate_sync
from .metrics import BatchMetrics, env_metric_names
from .recording import CHAT_TEMPLATE, RecordingHeader, RecordingReader, RecordingWriter, chat_template_entry
from .replay import (
    errored,
    format_transcript,
    recorded_renderer,
    replay_problems,
    rich_transcript,
    summarize,
)
from .runner import RolloutConfig, RolloutRunner
from .sampling import TaskSeedStream
from .scripted import OracleConfig, OraclePolicy
from .types import Trajectory

ORACLE = "oracle"


def load_renderer(
    policy_spec: str, tokenizer_path: str | os.PathLike, chat_template: str | os.PathLike[str] = ""
) -> Renderer:
    """The renderer for a policy: a checkpoint directory's own tokenizer.json if it has one; plain
    ChatML, or the chat template of `chat_template` (a tokenizer_config.json or .jinja file; one
    that cannot be used raises ChatTemplateError, a ValueError naming the file)."""
    own = Path(policy_spec) / "tokenizer.json"
    tokenizer = load_tokenizer(own if policy_spec != ORACLE and own.is_file() else tokenizer_path)
    if not chat_template:
        return ChatRenderer(tokenizer)
    from ..agents.chat_template import TemplateRenderer, load_chat_template

    return TemplateRenderer(tokenizer, load_chat_template(chat_template))


def chat_template_extra(chat_template: str | os.PathLike[str] = "") -> dict[str, Any]:
    """A recording header's `extra` entry for episodes rendered through `chat_template` (as
    `load_renderer` takes it): the template itself, so `replay` rebuilds the renderer; {} for
    plain ChatML."""
    if not chat_template:
        return {}
    from ..agents.chat_template import load_chat_template

    return {CHAT_TEMPLATE: chat_template_entry(load_chat_template(chat_template))}


def load_policy(
    policy_spec: str, renderer: Renderer, oracle: OracleConfig | None = None, device: str = "cpu"
) -> tuple[Policy, str]:
    """`oracle` (the env's scripted oracle with `oracle` knobs) or a Hugging Face checkpoint
    directory served by the torch engine. Returns the policy and an id for recording headers."""
    if policy_spec == ORACLE:
        policy = OraclePolicy(renderer, oracle)
        return policy, policy.policy_id
    path = Path(policy_spec)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--policy must be 'oracle' or a checkpoint directory with config.json, got {policy_spec}"
        )
    from ..agents.engine.engine import TorchEngine
    from ..agents.model.checkpoint import load_hf_checkpoint

    model = load_hf_checkpoint(path, device=device)
    return TorchEngine(model, tokenizer=renderer.tokenizer), f"checkpoint:{path.resolve()}"


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


def _error_text(trajectory: Trajectory) -> str:
    """What went wrong in an error-only episode: its error, else its stop reason."""
    steps = "" if trajectory.transitions else ", no steps"
    return trajectory.error or f"stop reason {trajectory.stop_reason.value}{steps}"


def record_command(
    console: Console,
    rollout: RolloutConfig,
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
    renderer = load_renderer(policy_spec, tokenizer_path, chat_template)
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
    _print_summary(console, summarize(trajectories), f"recorded {len(trajectories)} episodes to {out}")
    failed = [t for t in trajectories if errored(t)]
    if not failed:
        return 0
    first = _error_text(failed[0])
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


def replay_command(
    console: Console,
    path: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    verify: bool = False,
    limit: int | None = None,
    show: bool = True,
    env_modules: Sequence[str] = (),
) -> int:
    """Print transcripts (first `limit`) and a summary; with `verify`, re-run every episode.
    Returns 1 when verification finds a difference, an episode is error-only (`replay.errored`:
    env_error or no steps; reported as an error, never as replaying exactly) or a line is damaged
    (each damaged line is reported by path, line and reason and skipped; every intact record is
    still shown and checked).

    The recording imports nothing: `verify` makes only envs registered with gymnasium or whose
    module is imported already, toolgym's or one of `env_modules` (imported first, as the user
    named them); a header env id that needs any other module raises EnvModuleNotAllowed (one line)
    before any episode is replayed.

    Transcripts and `verify` use the renderer the recording was made with
    (`replay.recorded_renderer`: the chat template its header records, run in the sandbox; plain
    ChatML when it records none); a recorded template that cannot be used raises ValueError."""
    import_env_modules(env_modules)
    tokenizer = load_tokenizer(tokenizer_path)
    reader = RecordingReader(path, tokenizer_fingerprint(tokenizer), skip_damaged=True)
    head = reader.header
    if verify:
        check_env_id(head.env_id)
    renderer = recorded_renderer(head, tokenizer, path)
    template = head.extra.get(CHAT_TEMPLATE)
    rendered = f"  chat template {template.get('source')}" if isinstance(template, dict) else ""
    console.print(
        f"{path}: {head.env_id} {head.env_kwargs}  policy {head.policy_id}  created {head.created}{rendered}",
        markup=False,
        soft_wrap=True,
    )
    if show and not console.is_terminal:
        console.print("(⟦ ⟧ marks the tokens the policy sampled, the ones it is trained on)")
    summary, count, mismatches, errors = BatchMetrics(), 0, 0, 0  # streamed: memory does not grow
    for i, trajectory in enumerate(reader):
        summary.add(trajectory)
        count += 1
        if show and (limit is None or i < limit):
            if console.is_terminal:
                console.print(rich_transcript(trajectory, renderer), soft_wrap=True)
            else:
                console.print(
                    format_transcript(trajectory, renderer), markup=False, highlight=False, soft_wrap=True
                )
        if verify and (problems := replay_problems(trajectory, renderer)):
            mismatches += 1
            console.print(f"episode {i} (task seed {trajectory.task_seed}) does not replay:", markup=False)
            for problem in problems:
                console.print(f"  {problem}", markup=False, highlight=False)
        elif verify and errored(trajectory):
            errors += 1
            console.print(
                f"episode {i} (task seed {trajectory.task_seed}) errored: {_error_text(trajectory)}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
    if reader.torn_lines:
        console.print(f"skipped {reader.torn_lines} torn last line")
    for damage in reader.damaged:  # each skipped line: path, line, reason; the rest were read
        console.print(f"skipped {damage}", markup=False, highlight=False, soft_wrap=True)
    metrics = {k.removeprefix("rollout/"): v for k, v in summary.result().items()}
    _print_summary(console, metrics, f"{count} episodes")
    damaged = len(reader.damaged)
    if damaged:
        lines = ", ".join(str(d.line) for d in reader.damaged)
        console.print(f"damaged: {damaged} line{'s' if damaged > 1 else ''} skipped (line {lines})")
    if verify:
        console.print(
            f"verify: {count - mismatches - errors}/{count} episodes replay exactly"
            + ("" if not mismatches else f", {mismatches} differ")
            + ("" if not errors else f", {errors} errored (env_error or no steps)")
            + ("" if not damaged else f"; {damaged} damaged lines not checked")
        )
    return 1 if mismatches or errors or damaged else 0


def eval_command(
    console: Console,
    rollout: RolloutConfig,
    policy_spec: str,
    oracle: OracleConfig,
    tokenizer_path: str | os.PathLike,
    eval_config: EvalConfig,
    out: str | os.PathLike | None = None,
    env_modules: Sequence[str] = (),
    chat_template: str = "",
) -> int:
    """Evaluate a policy on the held-out task seeds; `env_modules` are imported first (they
    register the user's envs with gymnasium). `chat_template`: see `load_renderer`."""
    import_env_modules(env_modules)
    renderer = load_renderer(policy_spec, tokenizer_path, chat_template)
    policy, policy_id = load_policy(policy_spec, renderer, oracle)
    report = evaluate_sync(policy, renderer, rollout, eval_config, keep_trajectories=False)
    policy.close()
    for example in report.examples:
        console.print(example, markup=False, highlight=False, soft_wrap=True)
    metrics = {k.removeprefix("eval/"): v for k, v in report.metrics.items()}
    _print_summary(console, metrics, f"eval of {policy_id} on {rollout.env_id} {rollout.env_kwargs}")
    if out is not None:
        Path(out).write_text(json.dumps({"policy": policy_id, "metrics": report.metrics}, indent=2) + "\n")
    return 0


def _print_summary(console: Console, metrics: dict[str, float], title: str) -> None:
    table = Table("metric", "value", title=title)
    for key in ("episodes", "reward_mean", *env_metric_names(metrics, ""), "turns_mean", "tokens_generated"):
        if key in metrics:
            table.add_row(key, f"{metrics[key]:.4g}")
    for key, value in metrics.items():
        if key.startswith(("stop_reason/", "failure_mode/")) and value > 0:
            table.add_row(key, f"{value:.3f}")
        elif key.startswith("errors"):
            table.add_row(key, f"{value:g}")
    console.print(table)


def view_command(
    console: Console,
    recordings: Sequence[str | os.PathLike],
    tokenizer_path: str | os.PathLike | None,
    metrics: Sequence[dict[str, Any]] | None = None,
    host: str = "127.0.0.1",
    port: int = 8765,
    title: str = "",
) -> int:
    """Serve the trace viewer (rollouts/traces/server.py) over `recordings` until interrupted;
    `metrics` (a run's metrics records) feed its charts. The first recording is read before the
    URL is printed, so the page opens at once. Raises ValueError for a path that is not a file;
    a file that is damaged or not a recording still opens (the page says what it skipped)."""
    from .traces.server import ViewerData, ViewerServer

    missing = [str(p) for p in recordings if not Path(p).is_file()]
    if not recordings or missing:
        raise ValueError(f"no such recording: {', '.join(missing) or '(none given)'}")
    renderer = ChatRenderer(load_tokenizer(tokenizer_path)) if tokenizer_path is not None else None
    data = ViewerData(recordings, renderer, metrics, title)
    first = data.index(0)
    skipped = f", {first.skipped} lines skipped" if first.skipped else ""
    console.print(f"{first.label}: {len(first.rows)} episodes{skipped}", markup=False, highlight=False)
    for problem in first.problems[:5]:
        console.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)
    server = ViewerServer(data, host, port)
    console.print(
        f"toolgym view: {len(data.paths)} recording(s) at {server.url}  (Ctrl-C stops)",
        markup=False,
        highlight=False,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def export_command(
    console: Console,
    recording: str | os.PathLike,
    out: str | os.PathLike,
    tools: bool = True,
    observation_role: str = "user",
    metadata: bool = True,
    env_modules: Sequence[str] = (),
) -> int:
    """Write `recording` as OpenAI chat-messages JSONL to `out` ("-": stdout); see
    rollouts/traces/chat_jsonl.py. `env_modules` are imported first (the envs whose tools are
    exported). Returns 1 when a line of the recording was damaged (the rest are written)."""
    from .traces.chat_jsonl import export_chat_jsonl

    import_env_modules(env_modules)
    if str(out) == "-":
        report = export_chat_jsonl(recording, sys.stdout, tools, observation_role, metadata)
    else:
        with Path(out).open("w", encoding="utf-8") as f:
            report = export_chat_jsonl(recording, f, tools, observation_role, metadata)
    where = Console(stderr=True) if str(out) == "-" else console
    for problem in report.problems:
        where.print(f"skipped: {problem}", markup=False, highlight=False, soft_wrap=True)
    where.print(
        f"exported {report.episodes} episodes to {out} ({report.with_tools} with tools, "
        f"{report.tool_call_turns} turns with tool_calls)",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    damaged = any(p.startswith(str(recording)) for p in report.problems)
    return 1 if damaged else 0


def import_command(
    console: Console, source: str | os.PathLike, out: str | os.PathLike, tokenizer_path: str | os.PathLike
) -> int:
    """Turn OpenAI chat-messages JSONL into a recording SFT reads (`sft.source = "recording"`),
    tokenized with the renderer of `tokenizer_path` and marked not token-exact; see
    rollouts/traces/chat_jsonl.py. Returns 1 when no line was a conversation; lines that are not
    are reported and skipped."""
    from .traces.chat_jsonl import import_chat_jsonl, import_header

    renderer = ChatRenderer(load_tokenizer(tokenizer_path))
    problems: list[str] = []
    count = 0
    header = import_header(source, tokenizer_fingerprint(renderer.tokenizer))
    with RecordingWriter(out, header) as writer:
        for trajectory in import_chat_jsonl(source, renderer, problems):
            writer.write(trajectory)
            count += 1
    for problem in problems[:20]:
        console.print(f"skipped {problem}", markup=False, highlight=False, soft_wrap=True)
    if len(problems) > 20:
        console.print(f"... and {len(problems) - 20} more lines skipped", markup=False, soft_wrap=True)
    console.print(
        f"imported {count} conversations to {out} (not token-exact; {len(problems)} lines skipped)",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if count == 0:
        print(f"toolgym import: error: no line of {source} is a chat-messages conversation", file=sys.stderr)
        return 1
    return 0
