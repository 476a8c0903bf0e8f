"""A recording read for browsing: a light row per episode, read once; one episode in full on demand.

`RecordingIndex(path)` reads the file line by line and keeps, per intact record, a small row
(env, task seed, group, stop reason, failure mode, reward and its components, policy version,
turns, sampled tokens, env metrics, advantage) and the byte span of its line, never the
Trajectory itself, so a 10,000-episode file costs a few MB and any episode is one seek away.
Filters, sorting and pages run over the rows (`query`); `episode` decodes one line again and
returns its per-token view (`stream`): token ids, their text, loss mask, sampler logprob,
advantage, turn and policy version, built by `trajectory_to_episodes` (what training reads; a
history a chat template re-rendered starts a new sequence, marked on its turn), so what the page
shades is what the trainer masks.

Reading never fails on a bad file: a header that does not read (a foreign or damaged file) is
reported and every line is still tried as a record (checksummed, then plain); a torn last line
and every damaged line are skipped and listed in `problems` (the first `MAX_PROBLEMS`, then a
count). A file that cannot be opened gives no rows and one problem.

Advantages are the run's own: the recording's header records how its run scored episodes
(`extra["scoring"]`, rollouts/recording/format.py `recorded_scoring`), and each group (its
intact records, by recorded group id) is scored with that config by the trainer's scorer
(rollouts/scoring/scorer.py `score_group`), one group's trajectories held at a time while the
file is read (a run writes each group whole; a group whose records are apart is scored again
from the file). A row's `adv` is the episode's advantage, or under turn-level credit the mean of
its turns'; `turn_adv` is each turn's (the episode's on every turn under outcome credit), and the
per-token stream's `adv` is what the trainer puts on each token, before any over-stale
down-weighting of an async run. A header without the entry (recordings made before it, `toolgym
record`, imports) leaves every advantage None and `scoring_note` says why: the viewer never shows
another config's numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from ....agents.chat import ChatRenderer
from ....agents.tokenizer import tokenizer_fingerprint
from ....envs.core.info import FAILURE_MODE, METRICS, REWARD_COMPONENTS
from ....rollouts.episodes import Advantage, sampled_length, trajectory_to_episodes
from ....rollouts.recording.format import (
    POLICY_MODEL,
    RecordingError,
    RecordingHeader,
    ScoringEntry,
    _decode_header,
    _decode_record,
    _record_decoder,
    describe_policy_model,
    recorded_scoring,
)
from ....rollouts.scoring.advantages import Credit
from ....rollouts.scoring.distill import TEACHER_LOGPROBS
from ....rollouts.scoring.judge import JUDGE_INFO
from ....rollouts.scoring.scorer import score_group, trainable
from ....rollouts.types import CONTEXT_REWRITE, SEQUENCE_START, Trajectory

MAX_PROBLEMS = 100
MAX_PAGE = 500
GUIDED_BY = "the env's oracle (a guided sample)"  # who played a guided episode (rollouts/types.py)
SORT_KEYS = ("i", "seed", "group", "reward", "turns", "tokens", "version", "adv")


def _finite(x: Any) -> float | None:
    """A float for JSON, None when it is not a finite number (JSON has no NaN)."""
    try:
        value = float(x)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _numbers(d: Any) -> dict[str, float | None]:
    return {str(k): _finite(v) for k, v in d.items()} if isinstance(d, Mapping) else {}


class RecordingIndex:
    """One recording, indexed (see the module doc). `rows[i]` is episode i (in file order of the
    intact records); `header` is None when the header did not read; `scoring` is the run's
    recorded scoring (None: unknown, `scoring_note` says why); `problems` says what was skipped
    and why; `skipped` counts the skipped lines."""

    def __init__(self, path: str | Path, label: str | None = None) -> None:
        self.path = Path(path)
        self.label = label or self.path.name
        self.header: RecordingHeader | None = None
        self.version: int | None = None  # None: guessed per line (no readable header)
        self.scoring: ScoringEntry | None = None
        self.scoring_note = "advantages unknown: the recording's header did not read"
        self.problems: list[str] = []
        self.skipped = 0
        self.rows: list[dict[str, Any]] = []
        self._spans: list[tuple[int, int]] = []
        self._advantages: list[Advantage | None] = []  # per row, as the trainer would have it
        self._group: list[tuple[int, Trajectory]] = []  # the group being read: (row, trajectory)
        self._scored_groups: set[int] = set()
        self._apart: set[int] = set()  # groups whose records are not contiguous
        self._matches: dict[tuple[int, int], list[int]] = {}  # a game's seats: (seed, sample) -> rows
        try:
            self._read()
        except OSError as exc:
            self._problem(f"cannot read {self.path}: {exc.strerror or exc}")
        self._finish_scoring()

    # ---- reading ------------------------------------------------------------------------------

    def _problem(self, text: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)
        elif len(self.problems) == MAX_PROBLEMS:
            self.problems.append("more lines were skipped; `toolgym replay --verify` lists every one")

    def _decode(self, line: bytes) -> Trajectory:
        decoder = _record_decoder()
        if self.version is not None:
            return _decode_record(decoder, line, self.version)
        try:
            return _decode_record(decoder, line, 2)
        except ValueError:
            return _decode_record(decoder, line, 1)

    def _read(self) -> None:
        with self.path.open("rb") as f:
            first = f.readline()
            offset = len(first)
            lineno, pending = 1, None  # pending: a first line to try as a record (no header)
            if not first.strip():
                self._problem("empty file: not a toolgym recording")
                return
            try:
                self.header = _decode_header(first, self.path)
                self.version = self.header.schema_version
                self._read_scoring(self.header)
            except RecordingError as exc:
                if is_chat_jsonl(first):
                    self._problem(
                        f"this is a chat-messages JSONL file, not a toolgym recording: "
                        f"`toolgym import {self.path} --out recording.jsonl` turns it into one"
                    )
                    return
                self._problem(f"line 1: {exc}; reading the other lines as records anyway")
                pending = (1, 0, first)
            lines = iter(f)
            while True:
                if pending is not None:
                    lineno, start, line = pending
                    pending = None
                else:
                    line = next(lines, None)
                    if line is None:
                        break
                    lineno, start = lineno + 1, offset
                    offset += len(line)
                if not line.strip():
                    continue
                body = line.rstrip(b"\r\n")
                try:
                    trajectory = self._decode(body)
                except ValueError as exc:
                    if lineno == 1:
                        continue  # the unreadable header, already reported
                    self.skipped += 1
                    last = not line.endswith(b"\n") and not f.read(1)
                    what = "torn (a crash mid-write?)" if last else f"corrupt: {exc}"
                    self._problem(f"line {lineno} is {what}; skipped")
                    continue
                self._spans.append((start, start + len(body)))
                self.rows.append(self._row(len(self.rows), lineno, trajectory))
                self._advantages.append(None)
                if trajectory.seat:
                    key = (trajectory.task_seed, trajectory.sample_index)
                    self._matches.setdefault(key, []).append(len(self.rows) - 1)
                self._collect(len(self.rows) - 1, trajectory)

    @staticmethod
    def _row(i: int, lineno: int, t: Trajectory) -> dict[str, Any]:
        env = t.metrics.get("env")
        return {
            "i": i,
            "line": lineno,
            "env": t.env_id,
            "kwargs": json.dumps(t.env_kwargs, sort_keys=True, default=str),
            "seed": t.task_seed,
            "group": t.group_id,
            "sample": t.sample_index,
            "stop": t.stop_reason.value,
            "failure": str(t.metrics.get(FAILURE_MODE) or ""),
            "reward": _finite(t.total_reward),
            "components": _numbers(t.reward_components),
            "version": t.policy_version,
            "turns": len(t.transitions),
            "tokens": sampled_length(t),
            "metrics": _numbers(env),
            "error": t.error,
            "seat": t.seat,
            "opponent": not t.trained,  # a match's untrained seat (rollouts/types.py)
            "adv": None,  # None: unknown (no recorded scoring, or its group could not be scored)
            "turn_adv": None,
        }

    # ---- advantages, as the run scored them ----------------------------------------------------

    def _read_scoring(self, header: RecordingHeader) -> None:
        """The header's recorded scoring (module doc); a damaged entry is a problem, not a failure."""
        try:
            self.scoring = recorded_scoring(header, self.path)
        except RecordingError as exc:
            self.scoring_note = f"advantages unknown: {exc}"
            self._problem(str(exc))
            return
        if self.scoring is None:
            self.scoring_note = (
                "advantages unknown: this recording's header does not record how its run scored "
                "episodes (extra.scoring: written by training runs; not by `toolgym record`, imports, "
                "or runs made before it), so no advantage is shown"
            )
            return
        a = self.scoring.advantage
        overlong = f", overlong {a.overlong.max_length}/{a.overlong.cache_length}" if a.overlong else ""
        infra = ", infra failures trained on" if self.scoring.train_on_infra_failures else ""
        self.scoring_note = (
            f"advantages as the run scored them: {a.estimator.value} (eps {a.eps:g}), credit "
            f"{a.credit.value}, gamma {a.gamma:g}{overlong}{infra}"
        )

    def _collect(self, i: int, trajectory: Trajectory) -> None:
        """Row i's trajectory, as it is read: the group before it is scored when a record of
        another group follows."""
        if self.scoring is None:
            return
        group_id = trajectory.group_id
        if self._group and self._group[0][1].group_id != group_id:
            self._score_group([row for row, _ in self._group], [t for _, t in self._group])
            self._group = []
        if group_id in self._scored_groups:
            self._apart.add(group_id)
        self._group.append((i, trajectory))

    def _finish_scoring(self) -> None:
        """Score the last group, then each group whose records were apart, whole, from the file."""
        if self._group:
            self._score_group([row for row, _ in self._group], [t for _, t in self._group])
            self._group = []
        for group_id in sorted(self._apart):
            rows = [r["i"] for r in self.rows if r["group"] == group_id]
            self._score_group(rows, [self.trajectory(i) for i in rows])

    def _score_group(self, rows: list[int], group: list[Trajectory]) -> None:
        scoring = self.scoring
        if scoring is None:
            return
        self._scored_groups.add(group[0].group_id)
        try:
            advantages, _ = score_group(
                group,
                scoring.advantage,
                train_on_infra_failures=scoring.train_on_infra_failures,
                distill=scoring.distill,
            )
        except ValueError as exc:  # a reward that is not a finite number: training never scores one
            self._problem(f"group {group[0].group_id}: advantages unknown ({exc})")
            return
        for i, advantage in zip(rows, advantages, strict=True):
            row = self.rows[i]
            self._advantages[i] = advantage
            if isinstance(advantage, list):  # per turn; a per-token turn (distillation) shows its mean
                per_turn = [
                    (math.fsum(a) / len(a) if a else 0.0) if isinstance(a, list) else a for a in advantage
                ]
                row["turn_adv"] = [_finite(a) for a in per_turn]
                row["adv"] = _finite(math.fsum(per_turn) / len(per_turn)) if per_turn else 0.0
            else:
                row["adv"] = _finite(advantage)
                row["turn_adv"] = [row["adv"]] * row["turns"]

    def scoring_summary(self) -> dict[str, Any]:
        """What the page says of the advantages: known or not, the note, the credit (a row's
        `adv` is a mean over turns under turn-level credit), the recorded entry."""
        scoring = self.scoring
        return {
            "known": scoring is not None,
            "note": self.scoring_note,
            "credit": None if scoring is None else scoring.advantage.credit.value,
            "turn_level": scoring is not None and scoring.advantage.credit != Credit.OUTCOME,
            "entry": None if scoring is None else msgspec.to_builtins(scoring),
        }

    # ---- the list -----------------------------------------------------------------------------

    def facets(self) -> dict[str, Any]:
        """What the filters offer: the values present, and the reward range."""
        rewards = [r["reward"] for r in self.rows if r["reward"] is not None]
        return {
            "env": sorted({r["env"] for r in self.rows}),
            "stop": sorted({r["stop"] for r in self.rows}),
            "failure": sorted({r["failure"] for r in self.rows}),
            "version": sorted({r["version"] for r in self.rows}),
            "reward_min": min(rewards, default=None),
            "reward_max": max(rewards, default=None),
        }

    def summary(self) -> dict[str, Any]:
        """The header, counts and problems (what the page shows above the list)."""
        h = self.header
        return {
            "label": self.label,
            "path": str(self.path),
            "episodes": len(self.rows),
            "skipped": self.skipped,
            "problems": self.problems,
            "header": None if h is None else msgspec.to_builtins(h),
            "model": "" if h is None else describe_policy_model(h),
            "scoring": self.scoring_summary(),
            "facets": self.facets(),
        }

    def query(self, params: Mapping[str, str]) -> dict[str, Any]:
        """A page of rows. params (all optional, strings as in a URL): env, stop, failure,
        version, seed (exact), rmin, rmax, sort (one of SORT_KEYS), desc ("1"), offset, limit.
        The reward bounds hold up to float rounding (`_slack`): `rmin=1.1` keeps a reward summed
        to 1.0999999999999999, as the page shows it as 1.100."""
        rows = self.filtered(params)
        key = params.get("sort") or "i"
        if key not in SORT_KEYS:
            raise ValueError(f"sort must be one of {', '.join(SORT_KEYS)}, got {key!r}")
        desc = params.get("desc") in ("1", "true")
        if key != "i" or desc:
            missing = -math.inf if desc else math.inf  # a NaN reward sorts last either way
            rows = sorted(rows, key=lambda r: (missing if r[key] is None else r[key], r["i"]), reverse=desc)
        offset = max(0, _int(params, "offset", 0))
        limit = min(MAX_PAGE, max(1, _int(params, "limit", 100)))
        return {"total": len(rows), "all": len(self.rows), "offset": offset, "rows": rows[offset : offset + limit]}

    def filtered(self, params: Mapping[str, str]) -> list[dict[str, Any]]:
        rows: Sequence[dict[str, Any]] = self.rows
        for name in ("env", "stop", "failure"):
            if params.get(name) not in (None, "", "*"):
                rows = [r for r in rows if r[name] == params[name]]
        for name, field in (("version", "version"), ("seed", "seed")):
            if params.get(name) not in (None, ""):
                value = _int(params, name, 0)
                rows = [r for r in rows if r[field] == value]
        rmin, rmax = _float(params, "rmin"), _float(params, "rmax")
        if rmin is not None:
            rmin -= _slack(rmin)
            rows = [r for r in rows if r["reward"] is not None and r["reward"] >= rmin]
        if rmax is not None:
            rmax += _slack(rmax)
            rows = [r for r in rows if r["reward"] is not None and r["reward"] <= rmax]
        return list(rows)

    # ---- one episode --------------------------------------------------------------------------

    def trajectory(self, i: int) -> Trajectory:
        if not 0 <= i < len(self.rows):
            raise IndexError(f"{self.label} has {len(self.rows)} episodes; no episode {i}")
        start, end = self._spans[i]
        with self.path.open("rb") as f:
            f.seek(start)
            return self._decode(f.read(end - start))

    def _sampled_by(self, version: int) -> str:
        """"adapter v3" for a recording sampled through LoRA adapters (its header says), else
        "policy v3"."""
        entry = self.header.extra.get(POLICY_MODEL) if self.header is not None else None
        lora = isinstance(entry, dict) and isinstance(entry.get("adapter"), dict)
        return f"{'adapter' if lora else 'policy'} v{version}"

    def episode(self, i: int, renderer: ChatRenderer | None) -> dict[str, Any]:
        """Episode i in full: its row, texts, per-turn rewards, advantages and infos, and `stream`
        (parallel lists: id, text, mask, logprob, adv, turn, pv, teacher; text is None when no renderer of
        the recording's tokenizer is given, and `notice` says why; adv is None when the advantages
        are unknown, and `scoring` says why; teacher, on-policy distillation's log p_teacher -
        log p_sampler per sampled token, is None when no teacher scored the episode)."""
        t = self.trajectory(i)
        row = self.rows[i]
        advantage = self._advantages[i]
        # one per training sequence, in turn order; the advantages are the trainer's (None: unknown)
        built = trajectory_to_episodes(t, 0.0 if advantage is None else advantage)
        ids = [x for e in built for x in e.tokens]
        turn_of: list[int] = []
        version_of: list[int | None] = []
        teacher_of: list[float | None] = []
        turns = []
        for k, tr in enumerate(t.transitions):
            turn_of += [k] * (len(tr.observation_tokens) + len(tr.action.tokens))
            scored = tr.info.get(TEACHER_LOGPROBS)
            ratios = (
                [_finite(float(x) - float(s)) for x, s in zip(scored, tr.action.logprobs, strict=True)]
                if isinstance(scored, list) and len(scored) == len(tr.action.logprobs)
                else [None] * len(tr.action.tokens)
            )
            teacher_of += [None] * len(tr.observation_tokens) + ratios
            version_of += [None] * len(tr.observation_tokens) + [tr.action.policy_version] * len(tr.action.tokens)
            info = tr.info
            turns.append(
                {
                    "observation": tr.observation,
                    "action": tr.action.text,
                    "finish": tr.action.finish_reason,
                    "reward": _finite(tr.reward),
                    "terminated": tr.terminated,
                    "truncated": tr.truncated,
                    "components": _numbers(info.get(REWARD_COMPONENTS)),
                    "metrics": _numbers(info.get(METRICS)),
                    "error": info.get("error"),
                    "sequence_start": k > 0 and info.get(SEQUENCE_START) is True,
                    "context_rewrite": k > 0 and info.get(CONTEXT_REWRITE) is True,
                    "turn_adv": None if row["turn_adv"] is None else row["turn_adv"][k],
                    "obs_tokens": len(tr.observation_tokens),
                    "act_tokens": len(tr.action.tokens),
                }
            )
        notice, texts = None, None
        if renderer is not None:
            fingerprint = tokenizer_fingerprint(renderer.tokenizer)
            if self.header is not None and self.header.tokenizer_fingerprint != fingerprint:
                notice = (
                    f"recorded with tokenizer {self.header.tokenizer_fingerprint}, the viewer has "
                    f"{fingerprint}: showing each turn's text, not its tokens (pass --tokenizer)"
                )
            else:
                try:
                    texts = token_texts(renderer, ids)
                except Exception as exc:  # ids outside the vocabulary
                    notice = f"the tokens do not decode ({type(exc).__name__}: {exc}): showing each turn's text"
        else:
            notice = "no tokenizer given: showing each turn's text, not its tokens"
        return {
            **row,
            "label": self.label,
            "system_prompt": t.system_prompt,
            "final_observation": t.final_observation,
            "trained": t.trained and trainable(t, self.scoring is not None and self.scoring.train_on_infra_failures),
            "sampled_by": GUIDED_BY if t.guided else self._sampled_by(t.policy_version),
            # the seats of its match in this recording (rows), itself included: shown side by side
            "match": [
                {"i": j, "seat": self.rows[j]["seat"], "opponent": self.rows[j]["opponent"]}
                for j in self._matches.get((t.task_seed, t.sample_index), [])
            ]
            if t.seat
            else [],
            "turn_list": turns,
            "judge": _judged(t),
            "notice": notice,
            "scoring": {"known": advantage is not None, "note": self.scoring_note},
            "stream": {
                "id": ids,
                "text": texts,
                "mask": [x for e in built for x in e.loss_mask],
                "logprob": [_finite(x) for e in built for x in e.sampler_logprobs],
                "adv": None if advantage is None else [x for e in built for x in e.advantages],
                "turn": turn_of,
                "pv": version_of,
                "teacher": teacher_of if any(x is not None for x in teacher_of) else None,
            },
        }


def _judged(t: Trajectory) -> list[dict[str, Any]]:
    """What a judge said of the episode (its last transition's info["judge"], rollouts/scoring/
    judge.py), per criterion: score, weight, its answer and the prompt it was asked; [] when
    no judge scored it."""
    entries = t.transitions[-1].info.get(JUDGE_INFO) if t.transitions else None
    if not isinstance(entries, dict):
        return []
    out = []
    for name, entry in entries.items():
        if isinstance(entry, dict):
            out.append(
                {
                    "criterion": str(name),
                    "score": _finite(entry.get("score")) if isinstance(entry.get("score"), int | float) else None,
                    "weight": _finite(entry.get("weight")) if isinstance(entry.get("weight"), int | float) else None,
                    "answer": str(entry.get("answer", "")),
                    "prompt": str(entry.get("prompt", "")),
                    "position": entry.get("position"),
                }
            )
    return out


def token_texts(renderer: ChatRenderer, ids: Sequence[int]) -> list[str]:
    """Each token's text (special tokens included). A token that ends inside a UTF-8 character
    decodes to U+FFFD alone: it is decoded together with the next (up to 3) tokens, the text
    goes to the first and the others get "", so the pieces join to the decoded whole."""
    tokenizer = renderer.tokenizer
    pieces = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    k = 0
    while k < len(pieces):
        if "\ufffd" in pieces[k]:
            for j in range(k + 2, min(k + 4, len(ids)) + 1):
                text = tokenizer.decode(list(ids[k:j]), skip_special_tokens=False)
                if "\ufffd" not in text:
                    pieces[k : j] = [text] + [""] * (j - k - 1)
                    k = j - 1
                    break
        k += 1
    return pieces


def compare(a: RecordingIndex, b: RecordingIndex, params: Mapping[str, str]) -> dict[str, Any]:
    """Episodes of `a` and `b` aligned by (task seed, sample index), seeds in order. params:
    `changed` ("1": only pairs whose rewards differ, or that one side lacks), offset, limit.
    Returns counts, the mean rewards over the common keys, and a page of {seed, sample, a, b}."""
    def keyed(index: RecordingIndex) -> dict[tuple[int, int], dict[str, Any]]:
        out: dict[tuple[int, int], dict[str, Any]] = {}
        for r in index.rows:
            out.setdefault((r["seed"], r["sample"]), r)
        return out

    left, right = keyed(a), keyed(b)
    common = left.keys() & right.keys()
    pairs = []
    for key in sorted(left.keys() | right.keys()):
        ra, rb = left.get(key), right.get(key)
        if params.get("changed") in ("1", "true") and ra and rb and ra["reward"] == rb["reward"]:
            continue
        pairs.append({"seed": key[0], "sample": key[1], "a": _brief(ra), "b": _brief(rb)})

    def mean(rows: dict[tuple[int, int], dict[str, Any]]) -> float | None:
        values = [rows[k]["reward"] for k in common if rows[k]["reward"] is not None]
        return sum(values) / len(values) if values else None

    offset = max(0, _int(params, "offset", 0))
    limit = min(MAX_PAGE, max(1, _int(params, "limit", 100)))
    return {
        "a": a.label,
        "b": b.label,
        "warning": env_mismatch(a, b),
        "common": len(common),
        "only_a": len(left.keys() - right.keys()),
        "only_b": len(right.keys() - left.keys()),
        "mean_a": mean(left),
        "mean_b": mean(right),
        "total": len(pairs),
        "offset": offset,
        "rows": pairs[offset : offset + limit],
    }


def env_mismatch(a: RecordingIndex, b: RecordingIndex) -> str | None:
    """Why pairing a's and b's episodes by task seed may mean nothing (None when it does mean
    something): they hold different envs, or one env with different kwargs, so one seed may
    be two different tasks."""
    def envs(index: RecordingIndex) -> set[tuple[str, str]]:
        return {(r["env"], r["kwargs"]) for r in index.rows}

    def name(pairs: set[tuple[str, str]]) -> str:
        return "; ".join(sorted(f"{env} {kwargs}" for env, kwargs in pairs))

    left, right = envs(a), envs(b)
    if not left or not right or left == right:
        return None
    return (
        f"{a.label} and {b.label} hold different envs ({name(left)} vs {name(right)}): the same task "
        "seed may be a different task on each side, so the pairs below may compare unlike episodes"
    )


def _brief(row: dict[str, Any] | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {k: row[k] for k in ("i", "reward", "stop", "failure", "turns", "tokens", "version")}


def recording_series(indexes: Sequence[RecordingIndex]) -> dict[str, list[dict[str, Any]]]:
    """Per-recording summary charts when there is no metrics log: reward, accuracy (the env's
    `accuracy` metric, else `success`), turns and sampled tokens per episode, each a mean per
    policy version (one line per recording)."""
    charts: dict[str, list[dict[str, Any]]] = {"reward": [], "accuracy": [], "turns": [], "tokens": []}
    for index in indexes:
        by_version: dict[int, list[dict[str, Any]]] = {}
        for r in index.rows:
            by_version.setdefault(r["version"], []).append(r)
        metric = "accuracy" if any("accuracy" in r["metrics"] for r in index.rows) else "success"
        columns = {
            "reward": lambda r: r["reward"],
            "accuracy": lambda r, m=metric: r["metrics"].get(m, 0.0),
            "turns": lambda r: r["turns"],
            "tokens": lambda r: r["tokens"],
        }
        for chart, get in columns.items():
            points = []
            for version, rows in sorted(by_version.items()):
                values = [v for v in map(get, rows) if v is not None]
                if values:
                    points.append([version, sum(values) / len(values)])
            charts[chart].append({"name": index.label, "points": points})
    return charts


# metrics.jsonl keys per chart: the train line (`rollout/`) and the eval markers (`eval/`).
RUN_CHARTS = {"reward": "reward_mean", "accuracy": "accuracy", "turns": "turns_mean", "tokens": "tokens_per_episode"}


def run_series(records: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per-run summary charts from a run's metrics records (trainers/metrics_log.py): per chart, a
    `train` series (`rollout/<name>` of the train records) and an `eval` series (`eval/<name>`)
    against step; a series the run did not log is left out."""
    charts: dict[str, list[dict[str, Any]]] = {}
    for chart, name in RUN_CHARTS.items():
        lines = []
        for kind, prefix in (("train", "rollout/"), ("eval", "eval/")):
            points = [
                [r["step"], _finite(r[prefix + name])]
                for r in records
                if r.get("kind") == kind and isinstance(r.get(prefix + name), int | float)
            ]
            if points:
                lines.append({"name": kind, "points": points})
        charts[chart] = lines
    return charts


RECORD_FIELDS = ("kind", "step", "time")  # a metrics record's fields that are not metrics


def run_metric_names(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every metric a run logged with a number at least once (what the page's picker offers)."""
    names = {
        k for r in records for k, v in r.items()
        if k not in RECORD_FIELDS and isinstance(v, int | float) and not isinstance(v, bool)
    }
    return sorted(names)


def run_metric_series(records: Sequence[Mapping[str, Any]], name: str) -> list[dict[str, Any]]:
    """One metric of a run against step: a series per record kind that logged it (train, eval,
    sft), in that order; points whose value is not finite are None (a gap)."""
    series = []
    for kind in ("train", "eval", "sft"):
        points = [
            [r["step"], _finite(r[name])]
            for r in records
            if r.get("kind") == kind and isinstance(r.get(name), int | float) and not isinstance(r.get(name), bool)
        ]
        if points:
            series.append({"name": kind, "points": points})
    return series


def recording_metric_names(indexes: Sequence[RecordingIndex]) -> list[str]:
    """What the picker offers without a run's metrics: each env metric (`metrics/<name>`) and
    reward component (`components/<name>`) the recordings' episodes carry."""
    names: set[str] = set()
    for index in indexes:
        for r in index.rows:
            names.update(f"metrics/{k}" for k in r["metrics"])
            names.update(f"components/{k}" for k in r["components"])
    return sorted(names)


def recording_metric_series(indexes: Sequence[RecordingIndex], name: str) -> list[dict[str, Any]]:
    """One env metric or reward component (`recording_metric_names`) as each recording's mean per
    policy version; an episode without it is left out of the mean."""
    group, _, key = name.partition("/")
    if group not in ("metrics", "components") or not key:
        raise ValueError(f"no metric {name!r}: names are metrics/<name> or components/<name>")
    series = []
    for index in indexes:
        by_version: dict[int, list[float]] = {}
        for r in index.rows:
            value = r[group].get(key)
            if value is not None:
                by_version.setdefault(r["version"], []).append(value)
        points = [[v, sum(xs) / len(xs)] for v, xs in sorted(by_version.items())]
        if points:
            series.append({"name": index.label, "points": points})
    return series


def _slack(bound: float) -> float:
    """How far a stored reward may miss a typed bound and still meet it: sums of rewards carry
    float rounding (0.1 + 1.0 is 1.0999999999999999), a few ulps that no typed bound means."""
    return 1e-9 * max(1.0, abs(bound))


def is_chat_jsonl(line: bytes) -> bool:
    """Whether a first line is an OpenAI chat-messages record (`{"messages": [...]}`), the
    format `toolgym export` writes and `toolgym import` reads, rather than a recording's header."""
    try:
        value = json.loads(line)
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("messages"), list)


def _int(params: Mapping[str, str], name: str, default: int) -> int:
    text = params.get(name)
    if text in (None, ""):
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def _float(params: Mapping[str, str], name: str) -> float | None:
    text = params.get(name)
    if text in (None, ""):
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None
