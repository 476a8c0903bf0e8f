"""`toolgym replay`, `export` and `import`: commands over recordings (rollouts/recording/).

Each function prints to `console` and returns a process exit code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium
import msgspec
from rich.console import Console

from ...agents.chat import ChatRenderer
from ...agents.tokenizer import load_tokenizer, tokenizer_fingerprint
from ...envs.registry import check_env_id, import_env_modules
from ...rollouts.endpoint.capture import ENDPOINT_ENV_ID
from ...rollouts.metrics import BatchMetrics
from ...rollouts.recording.chat_jsonl import export_chat_jsonl, import_chat_jsonl, import_header
from ...rollouts.recording.format import (
    CHAT_TEMPLATE,
    RecordingError,
    RecordingReader,
    RecordingWriter,
    TokenizerMismatch,
    describe_policy_model,
    read_recording,
)
from ...rollouts.recording.replay import (
    errored,
    format_transcript,
    game_seats,
    match_key,
    recorded_renderer,
    replay_problems,
    rich_transcript,
    verify_trajectories,
)
from ...rollouts.scoring.judge import Judge, JudgeError
from ...rollouts.scoring.judge_data import judge_examples, judge_group_examples, labelled
from ...rollouts.scoring.rejudge import recorded_judge, rejudge
from ...rollouts.types import Trajectory
from ..load import shipped_tokenizer_hint
from .summary import error_text, print_summary

# RecordingHeader.extra key: the recording process's PYTHONHASHSEED (None: unset, so string
# hashing was random). `record` writes it; replay names it when episodes differ.
PYTHON_HASH_SEED = "python_hash_seed"


def hash_seed_extra() -> dict[str, str | None]:
    """This process's PYTHONHASHSEED as a recording header's extra entry."""
    return {PYTHON_HASH_SEED: os.environ.get("PYTHONHASHSEED")}


def hash_seed_hint(extra: Mapping[str, Any]) -> str:
    """For a replay whose episodes differ: the PYTHONHASHSEED the recording was made with, when
    it is not this process's (or was unset: random), and what to do; "" when the header does not
    say (recordings made before the entry) or the values match."""
    if PYTHON_HASH_SEED not in extra:
        return ""
    recorded, current = extra[PYTHON_HASH_SEED], os.environ.get("PYTHONHASHSEED")
    if recorded is not None and recorded == current:
        return ""

    def shown(value: object) -> str:
        return f"PYTHONHASHSEED={value}" if value is not None else "PYTHONHASHSEED unset (random)"

    cause = "envs whose tasks iterate sets of strings make other tasks"
    fix = (
        f"replay with PYTHONHASHSEED={recorded}"
        if recorded is not None
        else "such an env's recording cannot replay: record it with PYTHONHASHSEED set"
    )
    return f"recorded with {shown(recorded)} and replayed with {shown(current)}: {cause}; {fix}"


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

    When episodes differ and the recording was made under another PYTHONHASHSEED (its header's
    `python_hash_seed`), a line names the value it was made with (`hash_seed_hint`).

    Transcripts and `verify` use the renderer the recording was made with
    (`replay.recorded_renderer`: the chat template its header records, run in the sandbox; plain
    ChatML when it records none); a recorded template that cannot be used raises ValueError."""
    import_env_modules(env_modules)
    tokenizer = load_tokenizer(tokenizer_path)
    try:
        reader = RecordingReader(path, tokenizer_fingerprint(tokenizer), skip_damaged=True)
    except TokenizerMismatch as exc:
        hint = shipped_tokenizer_hint(exc.recorded) if exc.recorded else ""
        raise RecordingError(f"{exc} {hint}".rstrip()) from None
    head = reader.header
    captures = verify and head.env_id == ENDPOINT_ENV_ID
    if captures:  # token-exact captures of an endpoint's requests: no env produced them
        console.print(
            f"{path} holds `toolgym serve` captures: there is no env to replay them in, so --verify "
            "checks that every record reads whole (its checksum) and shows them; it replays none",
            markup=False,
            soft_wrap=True,
        )
        verify = False
    if verify:
        check_env_id(head.env_id)
        try:  # once here, not once per episode with gymnasium's bare "Namespace ... not found"
            gymnasium.spec(head.env_id.rpartition(":")[2])  # `module:Env-v0`: its module is imported
        except gymnasium.error.Error as exc:
            raise ValueError(
                f"{path} was recorded on {head.env_id!r}, which no imported module registers ({exc}): "
                "pass --env-module with the module that registers it"
            ) from None
    renderer = recorded_renderer(head, tokenizer, path)
    template = head.extra.get(CHAT_TEMPLATE)
    rendered = f"  chat template {template.get('source')}" if isinstance(template, dict) else ""
    model = f"  {described}" if (described := describe_policy_model(head)) else ""
    console.print(
        f"{path}: {head.env_id} {head.env_kwargs}  policy {head.policy_id}{model}  created {head.created}{rendered}",
        markup=False,
        soft_wrap=True,
    )
    if show and not console.is_terminal:
        console.print("(⟦ ⟧ marks the tokens the policy sampled, the ones it is trained on)")
    summary, count, mismatches, errors = BatchMetrics(), 0, 0, 0  # streamed: memory does not grow

    def check(i: int, trajectory: Trajectory, problems: list[str]) -> None:
        nonlocal mismatches, errors
        if problems:
            mismatches += 1
            console.print(f"episode {i} (task seed {trajectory.task_seed}) does not replay:", markup=False)
            for problem in problems:
                console.print(f"  {problem}", markup=False, highlight=False)
        elif errored(trajectory):
            errors += 1
            console.print(
                f"episode {i} (task seed {trajectory.task_seed}) errored: {error_text(trajectory)}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )

    # a match's seats are replayed together: held until every seat of the game has been read
    # (the recorder writes a match's seats a few groups apart), the rest checked as read
    matches: dict[tuple, list[tuple[int, Trajectory]]] = {}
    seats = 0

    def check_match(key: tuple) -> None:
        held = matches.pop(key)
        found = {i: p for i, _, p in verify_trajectories([t for _, t in held], renderer)}
        for k, (i, trajectory) in enumerate(held):
            check(i, trajectory, found.get(k, []))

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
        if verify and trajectory.seat:
            seats = seats or game_seats(head.env_id, head.env_kwargs)
            key = match_key(trajectory)
            matches.setdefault(key, []).append((i, trajectory))
            if len(matches[key]) >= seats:
                check_match(key)
        elif verify:
            check(i, trajectory, replay_problems(trajectory, renderer))
    for key in list(matches):  # a match not every seat of which was recorded: not verified
        check_match(key)
    if reader.torn_lines:
        console.print(f"skipped {reader.torn_lines} torn last line")
    for damage in reader.damaged:  # each skipped line: path, line, reason; the rest were read
        console.print(f"skipped {damage}", markup=False, highlight=False, soft_wrap=True)
    metrics = {k.removeprefix("rollout/"): v for k, v in summary.result().items()}
    print_summary(console, metrics, f"{count} episodes")
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
        if mismatches and (hint := hash_seed_hint(head.extra)):
            console.print(hint, markup=False, highlight=False, soft_wrap=True)
    if captures:
        console.print(f"verify: {count}/{count} captures read whole" + (f"; {damaged} damaged" if damaged else ""))
    return 1 if mismatches or errors or damaged else 0


def rejudge_command(
    console: Console,
    recording: str | os.PathLike,
    url: str,
    model: str | None = None,
    key_env: str | None = None,
    mode: str | None = None,
    cache_file: str | None = None,
) -> int:
    """`replay FILE --rejudge URL`: the recording's judged episodes asked again of the judge at
    `url` (the recorded rubric; the recorded model, key variable, mode and cache file unless given), and per
    criterion how far the two judges agree (rollouts/scoring/rejudge.py). Returns 1 when a group
    could not be judged again, else 0."""
    header, trajectories = read_recording(recording)
    recorded = recorded_judge(header.extra)
    if recorded is None:
        raise ValueError(f"{recording} names no judge in its header (a run with [judge] records one)")
    changes: dict[str, Any] = {"url": url}
    if model is not None or url.rstrip("/") != recorded.url.rstrip("/"):
        changes["model"] = model or ""  # another endpoint: the one model it lists, unless named
    if key_env is not None:
        changes["api_key_env"] = key_env
    if mode is not None:
        changes["mode"] = mode
    if cache_file is not None:
        changes["cache_file"] = cache_file
    try:
        judge = Judge(msgspec.structs.replace(recorded, **changes))
    except JudgeError as exc:
        raise ValueError(str(exc)) from None
    console.print(f"{recording}: {len(trajectories)} episodes; recorded {recorded.url} ({recorded.model or 'its one model'})", markup=False)
    console.print(judge.describe(), markup=False, soft_wrap=True)
    report = rejudge(trajectories, judge)
    for a in report.criteria:
        r = "-" if a.correlation is None else f"{a.correlation:.3f}"
        console.print(
            f"{a.criterion}: {a.episodes} episodes, mean score recorded {a.mean_recorded:.3f} new {a.mean_new:.3f}, "
            f"mean |new - recorded| {a.mean_abs_diff:.3f}, same verdict (>= 0.5) {a.same_verdict:.3f}, correlation {r}",
            markup=False,
            soft_wrap=True,
        )
    s = report.stats
    console.print(
        f"{report.groups} groups, {report.failed_groups} failed; {s.calls} requests, {s.cache_hits} cache hits, "
        f"{s.latency_s:.1f} s waited, {s.prompt_tokens} prompt + {s.completion_tokens} completion tokens",
        markup=False,
    )
    for cause in report.causes:
        console.print(f"  {cause}", markup=False, highlight=False, soft_wrap=True)
    return 1 if report.failed_groups else 0


def judge_data_command(
    console: Console,
    recording: str | os.PathLike,
    criterion: str,
    out: str | os.PathLike,
    final_reply: bool = False,
    max_chars: int = 20000,
    group_size: int = 0,
) -> int:
    """`toolgym judge-data`: the recording's episodes as judge-training rows (rollouts/scoring/
    judge_data.py), labelled by the env's `success` metric; episodes without one are skipped.
    group_size > 0: rows of that many episodes each, asked as judge mode "group" asks. Returns 1
    when no episode had a label."""
    _, trajectories = read_recording(recording)
    episodes = labelled(trajectories)
    if group_size > 0:
        rows = judge_group_examples(episodes, criterion, group_size, max_chars, final_reply)
    else:
        rows = judge_examples(episodes, criterion, max_chars, final_reply)
    with Path(out).open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(msgspec.json.encode(row).decode() + "\n")
    passed = sum(e.label for e in episodes)
    console.print(
        f"{out}: {len(rows)} judge examples ({passed} episodes pass, {len(episodes) - passed} fail) from {len(trajectories)} "
        f"episodes of {recording}; `toolgym import {out} --out RECORDING` makes them a recording to SFT on",
        markup=False,
        soft_wrap=True,
    )
    return 0 if rows else 1


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
    rollouts/recording/chat_jsonl.py. `env_modules` are imported first (the envs whose tools are
    exported). Returns 1 when a line of the recording was damaged (the rest are written)."""
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
    rollouts/recording/chat_jsonl.py. Returns 1 when no line was a conversation; lines that are not
    are reported and skipped."""
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
