"""Append-only JSON Lines recordings of Trajectories (msgspec).

Line 1 is a `RecordingHeader`; every further line is one `Trajectory`. Each line is written and
flushed on its own, so a crash can tear at most the last line. The reader skips a torn last line
with a warning and refuses (with a clear `RecordingError`) a file of another schema version or,
when the caller says which tokenizer it will decode with, another tokenizer fingerprint: token
ids only mean something under the tokenizer that produced them.

Integrity (schema version 2): every record line is the Trajectory's JSON object with a last key
`"crc32"`, the crc32 of the object's exact bytes without that key, and the header carries the
crc32 of its own line (with its `checksum` field zeroed), so a flipped byte anywhere is
detected. Version 1 files (no checksums) still read, unchecked, and appending to one keeps it
version 1. A damaged line (bad checksum, invalid UTF-8, not JSON, not a Trajectory) is named by
path, line and reason: by default reading stops there with a `RecordingError`; with
`skip_damaged=True` (what `replay` uses) it is skipped and listed in `reader.damaged`, and every
intact record is still read. Non-finite floats in the typed float fields (rewards, sampler logprobs) are written as the
strings "nan", "inf", "-inf" and read back as floats (JSON has no NaN; msgspec would write null).

The chat template (header `extra["chat_template"]`, `chat_template_entry`): a recording rendered
through a model's own chat template keeps the template's text, the tokenizer config's special
tokens and the template variables, so `replay` rebuilds that renderer (rollouts/recording/replay.py
`recorded_renderer`); no such key means plain ChatML (every recording made before templates).

The scoring (header `extra["scoring"]`, `scoring_entry`): a training run's recordings keep how the
run turned rewards into advantages (its `AdvantageConfig` and whether infrastructure failures were
trained on, which is all the scorer reads) and, for the record, the loss settings that shape a
token's weight, so replay's offline policy gradient and the viewer score the episodes as the run
did (`recorded_scoring`); no such key (recordings made before it, `toolgym record`, imports,
endpoint captures) means the advantages the run used are unknown.

Appending to an existing file checks its header first (same tokenizer, env and chat template;
its schema version is kept) and cuts a torn last line off before writing, so the file stays one header +
whole lines. A last line that lacks only its newline (it decodes, so the reader keeps it) is
kept: the newline is added.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import warnings
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from ..scoring.advantages import AdvantageConfig
from ..scoring.distill import DistillConfig
from ..scoring.judge import JudgeConfig
from ..types import Trajectory

if TYPE_CHECKING:
    from ...agents.chat_template import ChatTemplate

SCHEMA_VERSION = 2  # 2: a crc32 on every line; 1 (no checksums) still reads
READABLE_VERSIONS = (1, 2)
FORMAT_NAME = "toolgym.trajectories"


class RecordingError(ValueError):
    """A recording that cannot be read as asked (wrong schema, tokenizer, or a corrupt line)."""


class TokenizerMismatch(RecordingError):
    """A recording made with another tokenizer than the one given; `recorded` is its fingerprint."""

    def __init__(self, message: str, recorded: str) -> None:
        super().__init__(message)
        self.recorded = recorded


class TornLineWarning(UserWarning):
    """The last line of a recording was cut off (a crash mid-write); it was skipped. Shown as one
    line, `warning: <path>: line <n> is torn ...` (`_format_torn_line`), never with the source
    line of the code that warned."""


def _format_torn_line(message, category, filename, lineno, line=None, *, _default=warnings.formatwarning):
    """`warnings.formatwarning` that writes a `TornLineWarning` as one line of its own text (the
    path and line are in it; where the reader was called from is not the user's business) and
    any other warning as before."""
    if isinstance(category, type) and issubclass(category, TornLineWarning):
        return f"warning: {message}\n"
    return _default(message, category, filename, lineno, line)


warnings.formatwarning = _format_torn_line


class DamagedLine(msgspec.Struct, frozen=True):
    """A record line that could not be read: its 1-based line number and why."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: line {self.line} is corrupt: {self.reason}"


class RecordingHeader(msgspec.Struct):
    tokenizer_fingerprint: str
    env_id: str
    env_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    policy_id: str = ""
    created: str = ""  # ISO 8601, UTC
    format: str = FORMAT_NAME
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    checksum: str = ""  # version 2: crc32 of this line with this field's value zeroed (last field)


CHAT_TEMPLATE = "chat_template"  # RecordingHeader.extra key: the chat template the episodes used
POLICY_MODEL = "policy_model"  # RecordingHeader.extra key: the base model and its LoRA adapter, if any


def policy_model_entry(base: str, adapter: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`RecordingHeader.extra[POLICY_MODEL]`: the base model (a name or a path) and, for a policy
    sampling through LoRA adapters, their shape (rank, alpha, target_modules). An episode's
    `policy_version` is then the version of the adapter that sampled it."""
    return {"base": base, "adapter": None if adapter is None else dict(adapter)}


def describe_policy_model(header: RecordingHeader) -> str:
    """One line naming the model a recording's episodes were sampled by; "" if the header does not
    say (recordings written before the entry, imports, endpoint captures)."""
    entry = header.extra.get(POLICY_MODEL)
    if not isinstance(entry, dict):
        return ""
    adapter = entry.get("adapter")
    if not isinstance(adapter, dict):
        return f"model {entry.get('base')}"
    return (
        f"model {entry.get('base')} + LoRA adapter r{adapter.get('rank')} alpha {adapter.get('alpha')}"
        " (an episode's policy version is its adapter's)"
    )


def chat_template_entry(
    template: ChatTemplate, template_kwargs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """`RecordingHeader.extra[CHAT_TEMPLATE]` for episodes rendered through `template` with
    `template_kwargs` as template variables: what rebuilds the same renderer (the template's
    text, the tokenizer config's special tokens, the variables) and, for humans, where the
    template came from (`source`: its file)."""
    return {
        "source": template.source,
        "text": template.text,
        "special_tokens": dict(template.special_tokens),
        "template_kwargs": dict(template_kwargs or {}),
    }


SCORING = "scoring"  # RecordingHeader.extra key: how the run scored its episodes (`scoring_entry`)
# RecordingHeader.extra key: on-policy distillation's teacher (`teacher_entry`), whose logprobs the
# transitions carry (info["teacher_logprobs"], rollouts/scoring/distill.py)
TEACHER = "teacher"


def teacher_entry(path: str, fingerprint: str) -> dict[str, Any]:
    """`RecordingHeader.extra[TEACHER]`: the teacher's directory and its tokenizer's fingerprint
    (the student's: the run refuses any other)."""
    return {"path": path, "tokenizer_fingerprint": fingerprint}


# RecordingHeader.extra key: the judge whose scores the episodes carry (`judge_entry`;
# info["judge"] of each judged episode's last transition, rollouts/scoring/judge.py)
JUDGE = "judge"


def judge_entry(config: JudgeConfig) -> dict[str, Any]:
    """`RecordingHeader.extra[JUDGE]`: the judge's endpoint, model, mode, seed and rubric (never
    its key: only the key's variable name), what `replay --rejudge` asks another judge again."""
    return msgspec.to_builtins(config)


class ScoringEntry(msgspec.Struct, frozen=True, kw_only=True):
    """`RecordingHeader.extra[SCORING]`: what the scorer (rollouts/scoring/scorer.py) read in the
    run that made the recording, `advantage` and `train_on_infra_failures`, and the trainer's loss
    settings (`loss`: trainer.loss as plain values, e.g. name, clip bounds, aggregation, tis_cap,
    seq_mask), which weight each token's advantage in the loss."""

    advantage: AdvantageConfig
    train_on_infra_failures: bool
    loss: dict[str, Any] = msgspec.field(default_factory=dict)
    distill: DistillConfig | None = None  # on-policy distillation's weights (None: off)


def scoring_entry(
    advantage: AdvantageConfig,
    loss: Mapping[str, Any],
    *,
    train_on_infra_failures: bool,
    distill: DistillConfig | None = None,
) -> dict[str, Any]:
    """`RecordingHeader.extra[SCORING]` for a run that scores with `advantage` (and trains on
    infrastructure failures or not) under the loss settings `loss` (plain values: the trainer's
    loss config as builtins)."""
    entry = ScoringEntry(
        advantage=advantage, train_on_infra_failures=train_on_infra_failures, loss=dict(loss), distill=distill
    )
    return msgspec.to_builtins(entry)


def recorded_scoring(header: RecordingHeader, path: str | os.PathLike = "") -> ScoringEntry | None:
    """The scoring a recording's run used (its `.advantage` is the AdvantageConfig to score with),
    or None when the header does not record it (`path` names the file in errors). Raises
    RecordingError for an entry that is not a scoring entry."""
    entry = header.extra.get(SCORING)
    if entry is None:
        return None
    try:
        return msgspec.convert(entry, ScoringEntry)
    except (msgspec.ValidationError, ValueError) as exc:
        where = f"{path}: " if path else ""
        raise RecordingError(
            f"{where}the header's extra[{SCORING!r}] is not a scoring entry: {exc}"
        ) from None


def rendering_of(extra: Mapping[str, Any]) -> tuple[str, Any]:
    """How the episodes of a header with this `extra` were rendered: (in words, a value equal for
    headers whose episodes were rendered alike: the template and its variables, where its file
    was aside; None for plain ChatML)."""
    entry = extra.get(CHAT_TEMPLATE)
    if not isinstance(entry, dict):
        return "plain ChatML", None
    return f"chat template {entry.get('source')}", {k: v for k, v in entry.items() if k != "source"}


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


_CRC_FIELD = b',"crc32":"'
_HEADER_CRC_ZERO = b',"checksum":"00000000"}'


def _crc(data: bytes) -> bytes:
    return b"%08x" % zlib.crc32(data)


def _wrap(body: bytes) -> bytes:
    """A version-2 record line (without its newline): the record's JSON object with a last key
    "crc32", the crc32 of the object's bytes without it (readers that ignore it still work)."""
    return body[:-1] + _CRC_FIELD + _crc(body) + b'"}'


def _unwrap(line: bytes) -> bytes:
    """The record bytes of a version-2 line; ValueError (the reason) when its checksum fails."""
    if not line.endswith(b'"}') or line[-20:-10] != _CRC_FIELD:
        raise ValueError("no crc32 at the end of the line (cut short, or not a version-2 record)")
    body = line[:-20] + b"}"
    if _crc(body) != line[-10:-2]:
        raise ValueError("checksum mismatch: the record's bytes were altered")
    return body


def _encode_header(encoder: msgspec.json.Encoder, header: RecordingHeader) -> bytes:
    """The header line (without its newline); version 2 carries its own crc32."""
    if header.schema_version < 2:
        return encoder.encode(msgspec.structs.replace(header, checksum=""))
    line = encoder.encode(msgspec.structs.replace(header, checksum="00000000"))
    return line[: -len(_HEADER_CRC_ZERO)] + _HEADER_CRC_ZERO.replace(b"00000000", _crc(line))


def _decode_header(line: bytes, path: Path) -> RecordingHeader:
    line = line.rstrip(b"\r\n")
    try:
        raw = msgspec.json.decode(line)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise RecordingError(f"{path}: line 1 is not JSON ({exc}); not a toolgym recording") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise RecordingError(f"{path}: line 1 is not a toolgym recording header (format != {FORMAT_NAME!r})")
    if raw.get("schema_version") not in READABLE_VERSIONS:
        raise RecordingError(
            f"{path}: recording schema version {raw.get('schema_version')!r}, this toolgym reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}; re-record it with this version"
        )
    if raw["schema_version"] >= 2:  # the line ends with ,"checksum":"<crc32 of the line, zeroed>"}
        stored, field = line[-10:-2], line[-len(_HEADER_CRC_ZERO) : -10]
        if (
            field != _HEADER_CRC_ZERO[:-10]
            or not line.endswith(b'"}')
            or _crc(line[:-10] + b'00000000"}') != stored
        ):
            raise RecordingError(f"{path}: line 1 (the header) is corrupt: checksum mismatch")
    try:
        return msgspec.convert(raw, RecordingHeader)
    except msgspec.ValidationError as exc:
        raise RecordingError(f"{path}: bad recording header: {exc}") from exc


def _finite_or_text(x: float) -> Any:
    return x if math.isfinite(x) else repr(float(x))  # 'nan', 'inf', '-inf': read back by strict=False


def _writable(trajectory: Trajectory) -> Trajectory:
    """`trajectory` with every non-finite float of a typed float field (rewards, logprobs) as
    text, which the reader's non-strict decoder turns back into that float; the same object when
    all are finite (the usual case, no copy)."""
    t = trajectory
    finite = math.isfinite(t.total_reward) and all(map(math.isfinite, t.reward_components.values()))
    finite = finite and all(
        math.isfinite(tr.reward) and all(map(math.isfinite, tr.action.logprobs)) for tr in t.transitions
    )
    if finite:
        return t
    replace = msgspec.structs.replace
    transitions = [
        replace(
            tr,
            reward=_finite_or_text(tr.reward),
            action=replace(tr.action, logprobs=[_finite_or_text(x) for x in tr.action.logprobs]),
        )
        for tr in t.transitions
    ]
    return replace(
        t,
        transitions=transitions,
        total_reward=_finite_or_text(t.total_reward),
        reward_components={k: _finite_or_text(v) for k, v in t.reward_components.items()},
    )


def _record_decoder() -> msgspec.json.Decoder[Trajectory]:
    # strict=False: the text "nan"/"inf"/"-inf" reads back into float fields (see _writable).
    return msgspec.json.Decoder(Trajectory, strict=False)


def _decode_record(decoder: msgspec.json.Decoder[Trajectory], line: bytes, version: int) -> Trajectory:
    """One record line (newline stripped) as a Trajectory; ValueError with the reason otherwise."""
    body = _unwrap(line) if version >= 2 else line
    try:
        return decoder.decode(body)
    except UnicodeDecodeError as exc:
        raise ValueError(f"invalid UTF-8 at byte {exc.start}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(str(exc)) from None


def check_tokenizer(header: RecordingHeader, fingerprint: str | None, path: Path | str) -> None:
    if fingerprint is not None and header.tokenizer_fingerprint != fingerprint:
        raise TokenizerMismatch(
            f"{path}: recorded with tokenizer {header.tokenizer_fingerprint}, but the tokenizer "
            f"given has fingerprint {fingerprint}; its token ids would decode to other text. "
            "Use the tokenizer it was recorded with.",
            header.tokenizer_fingerprint,
        )


RECOVERED_POLICY_ID = "(unknown: the header line was damaged; rebuilt from the records)"


def _header_from_records(path: Path) -> RecordingHeader | None:
    """A header for a recording whose header line is damaged, from its first intact record: the
    env id and kwargs (every record carries them); the tokenizer fingerprint, policy id and chat
    template are unknown. None when no line after the first is a record (not a recording)."""
    decoder = _record_decoder()
    with path.open("rb") as f:
        f.readline()
        for line in f:
            for version in sorted(READABLE_VERSIONS, reverse=True):  # its lines say which it is
                try:
                    record = _decode_record(decoder, line.rstrip(b"\r\n"), version)
                except ValueError:
                    continue
                return RecordingHeader(
                    tokenizer_fingerprint="", env_id=record.env_id, env_kwargs=dict(record.env_kwargs),
                    policy_id=RECOVERED_POLICY_ID, schema_version=version,
                )  # fmt: skip
    return None


class RecordingReader:
    """Reads a recording: `.header`, then iterate for Trajectories.

    expected_tokenizer_fingerprint: refuse the file unless it was recorded with this tokenizer.
    skip_damaged: False (default): a damaged line raises `RecordingError` naming the path, line
    and reason. True: it is skipped and listed in `.damaged` (a `DamagedLine` each), and every
    intact record is still yielded. Either way a torn LAST line (a crash mid-write) is skipped
    with a `TornLineWarning`; after iterating, `.torn_lines` is 1 when it was. With skip_damaged,
    a damaged header line does not lose the records: the header is rebuilt from them
    (`_header_from_records`; its tokenizer is not checked) and line 1 is listed as damaged.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        expected_tokenizer_fingerprint: str | None = None,
        skip_damaged: bool = False,
    ):
        self.path = Path(path)
        self.skip_damaged = skip_damaged
        if not self.path.exists():
            raise RecordingError(f"{self.path}: no such recording")
        with self.path.open("rb") as f:
            first = f.readline()
        if not first.strip():
            raise RecordingError(f"{self.path}: empty file, not a toolgym recording")
        self.header_damage: DamagedLine | None = None  # the header's, when it was rebuilt
        try:
            self.header = _decode_header(first, self.path)
        except RecordingError as exc:
            recovered = _header_from_records(self.path) if skip_damaged else None
            if recovered is None:
                raise RecordingError(
                    f"{exc}" + ("" if skip_damaged else "; `toolgym replay --verify` reads the records after it")
                ) from None
            self.header, self.header_damage = recovered, DamagedLine(str(self.path), 1, str(exc))
        if self.header_damage is None:  # a rebuilt header does not know the tokenizer
            check_tokenizer(self.header, expected_tokenizer_fingerprint, self.path)
        self.torn_lines = 0
        self.damaged: list[DamagedLine] = []

    def __iter__(self) -> Iterator[Trajectory]:
        decoder = _record_decoder()
        version = self.header.schema_version
        self.torn_lines, self.damaged = 0, [self.header_damage] if self.header_damage else []
        with self.path.open("rb") as f:
            f.readline()  # header
            lineno = 1
            for line in f:
                lineno += 1
                if not line.strip():
                    continue
                try:
                    trajectory = _decode_record(decoder, line.rstrip(b"\r\n"), version)
                except ValueError as exc:
                    if not line.endswith(b"\n") and not f.read(1):
                        self.torn_lines += 1
                        warnings.warn(
                            f"{self.path}: line {lineno} is torn (a crash mid-write?); skipped it",
                            TornLineWarning,
                            stacklevel=2,
                        )
                        return
                    damage = DamagedLine(str(self.path), lineno, str(exc))
                    if not self.skip_damaged:
                        raise RecordingError(
                            f"{damage}; `toolgym replay --verify` lists every damaged line and checks the rest"
                        ) from None
                    self.damaged.append(damage)
                    continue
                yield trajectory


def read_recording(
    path: str | os.PathLike, expected_tokenizer_fingerprint: str | None = None
) -> tuple[RecordingHeader, list[Trajectory]]:
    reader = RecordingReader(path, expected_tokenizer_fingerprint)
    return reader.header, list(reader)


def check_recording(path: str | os.PathLike, expected_tokenizer_fingerprint: str | None = None) -> int:
    """Read every record of `path` without keeping them (bounded memory); returns how many.
    Raises `RecordingError` (path, line, reason) at the first damaged line. A torn last line
    is allowed (it is skipped, and cut off by the next writer)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornLineWarning)
        return sum(1 for _ in RecordingReader(path, expected_tokenizer_fingerprint))


class RecordingWriter:
    """Appends Trajectories to a recording, one flushed line each. Use as a context manager.

    A new file gets `header` (its schema version decides the line format); an existing one must
    have a compatible header (tokenizer fingerprint, env id/kwargs, chat template), its schema version is kept,
    and a torn last line is cut off first (a last line that lacks only its newline gets it back
    instead).
    """

    def __init__(self, path: str | os.PathLike, header: RecordingHeader):
        self.path = Path(path)
        if not header.created:
            header = msgspec.structs.replace(header, created=_now_iso())
        self.header = header
        self._encoder = msgspec.json.Encoder()
        if self.path.exists() and self.path.stat().st_size > 0:
            existing = RecordingReader(self.path).header
            self.version = existing.schema_version
            check_tokenizer(existing, header.tokenizer_fingerprint, self.path)
            if (existing.env_id, existing.env_kwargs) != (header.env_id, header.env_kwargs):
                raise RecordingError(
                    f"{self.path}: holds {existing.env_id} {existing.env_kwargs}, refusing to append "
                    f"{header.env_id} {header.env_kwargs}; write to a new file"
                )
            (had, had_key), (new, new_key) = rendering_of(existing.extra), rendering_of(header.extra)
            if had_key != new_key:
                raise RecordingError(
                    f"{self.path}: holds episodes rendered with {had}, refusing to append episodes "
                    f"rendered with {new}; write to a new file"
                )
            self._cut_torn_tail()
            self._file = self.path.open("ab")
        else:
            self.version = header.schema_version
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("wb")
            self._write_line(_encode_header(self._encoder, header))

    def _cut_torn_tail(self) -> None:
        """Make the file end on a newline before appending. A last line that still decodes as a
        Trajectory (the reader keeps it: only its newline was lost) gets its newline back; one
        that does not is torn and is cut off."""
        with self.path.open("rb+") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            pos = size  # scan back in chunks for the last newline
            while pos > 0:
                start = max(0, pos - 65536)
                f.seek(start)
                chunk = f.read(pos - start)
                nl = chunk.rfind(b"\n")
                if nl >= 0:
                    keep = start + nl + 1
                    break
                pos = start
            else:  # only a header with no newline (it parsed): finish its line
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
                return
            f.seek(keep)
            tail = f.read()
            if tail.strip():
                try:
                    _decode_record(_record_decoder(), tail.rstrip(b"\r\n"), self.version)
                except ValueError:
                    warnings.warn(
                        f"{self.path}: cutting a torn last line ({size - keep} bytes) before appending",
                        TornLineWarning,
                        stacklevel=3,
                    )
                else:
                    f.seek(0, os.SEEK_END)
                    f.write(b"\n")
                    return
            f.truncate(keep)  # a torn line, or only whitespace (no record to keep)

    def _write_line(self, payload: bytes) -> None:
        self._file.write(payload + b"\n")
        self._file.flush()

    def write(self, trajectory: Trajectory) -> None:
        body = self._encoder.encode(_writable(trajectory))
        self._write_line(_wrap(body) if self.version >= 2 else body)

    def write_all(self, trajectories: Iterable[Trajectory]) -> None:
        for trajectory in trajectories:
            self.write(trajectory)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
