"""Append-only JSON Lines recordings of Trajectories (msgspec).

Line 1 is a `RecordingHeader`; every further line is one `Trajectory`. Each line is written and
flushed on its own, so a crash can tear at most the last line. The reader skips a torn last line
with a warning and refuses (with a clear `RecordingError`) a file of another schema version or,
when the caller says which tokenizer it will decode with, another tokenizer fingerprint: token
ids only mean something under the tokenizer that produced them.

Appending to an existing file checks its header first (same schema, tokenizer, env) and cuts a
torn last line off before writing, so the file stays one header + whole lines. A last line that
lacks only its newline (it decodes, so the reader keeps it) is kept: the newline is added.
"""

from __future__ import annotations

import datetime as dt
import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from .types import Trajectory

SCHEMA_VERSION = 1
FORMAT_NAME = "toolgym.trajectories"


class RecordingError(ValueError):
    """A recording that cannot be read as asked (wrong schema, tokenizer, or a corrupt line)."""


class TornLineWarning(UserWarning):
    """The last line of a recording was cut off (a crash mid-write); it was skipped."""


class RecordingHeader(msgspec.Struct):
    tokenizer_fingerprint: str
    env_id: str
    env_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    policy_id: str = ""
    created: str = ""  # ISO 8601, UTC
    format: str = FORMAT_NAME
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _decode_header(line: bytes, path: Path) -> RecordingHeader:
    try:
        raw = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise RecordingError(f"{path}: line 1 is not JSON ({exc}); not a toolgym recording") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise RecordingError(f"{path}: line 1 is not a toolgym recording header (format != {FORMAT_NAME!r})")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise RecordingError(
            f"{path}: recording schema version {raw.get('schema_version')!r}, this toolgym reads "
            f"version {SCHEMA_VERSION}; re-record it with this version"
        )
    try:
        return msgspec.convert(raw, RecordingHeader)
    except msgspec.ValidationError as exc:
        raise RecordingError(f"{path}: bad recording header: {exc}") from exc


def check_tokenizer(header: RecordingHeader, fingerprint: str | None, path: Path | str) -> None:
    if fingerprint is not None and header.tokenizer_fingerprint != fingerprint:
        raise RecordingError(
            f"{path}: recorded with tokenizer {header.tokenizer_fingerprint}, but the tokenizer "
            f"given has fingerprint {fingerprint}; its token ids would decode to other text. "
            "Use the tokenizer it was recorded with."
        )


class RecordingReader:
    """Reads a recording: `.header`, then iterate for Trajectories.

    expected_tokenizer_fingerprint: refuse the file unless it was recorded with this tokenizer.
    After iterating, `.torn_lines` is 1 when a torn last line was skipped.
    """

    def __init__(self, path: str | os.PathLike, expected_tokenizer_fingerprint: str | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise RecordingError(f"{self.path}: no such recording")
        with self.path.open("rb") as f:
            first = f.readline()
        if not first.strip():
            raise RecordingError(f"{self.path}: empty file, not a toolgym recording")
        self.header = _decode_header(first, self.path)
        check_tokenizer(self.header, expected_tokenizer_fingerprint, self.path)
        self.torn_lines = 0

    def __iter__(self) -> Iterator[Trajectory]:
        decoder = msgspec.json.Decoder(Trajectory)
        with self.path.open("rb") as f:
            f.readline()  # header
            lineno = 1
            for line in f:
                lineno += 1
                if not line.strip():
                    continue
                try:
                    yield decoder.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    if not line.endswith(b"\n") and not f.read(1):
                        self.torn_lines += 1
                        warnings.warn(
                            f"{self.path}: line {lineno} is torn (a crash mid-write?); skipped it",
                            TornLineWarning,
                            stacklevel=2,
                        )
                        return
                    raise RecordingError(f"{self.path}: line {lineno} is corrupt: {exc}") from exc


def read_recording(
    path: str | os.PathLike, expected_tokenizer_fingerprint: str | None = None
) -> tuple[RecordingHeader, list[Trajectory]]:
    reader = RecordingReader(path, expected_tokenizer_fingerprint)
    return reader.header, list(reader)


class RecordingWriter:
    """Appends Trajectories to a recording, one flushed line each. Use as a context manager.

    A new file gets `header`; an existing one must have a compatible header (same schema,
    tokenizer fingerprint and env id/kwargs), and a torn last line is cut off first (a last line
    that lacks only its newline gets it back instead).
    """

    def __init__(self, path: str | os.PathLike, header: RecordingHeader):
        self.path = Path(path)
        if not header.created:
            header = msgspec.structs.replace(header, created=_now_iso())
        self.header = header
        self._encoder = msgspec.json.Encoder()
        if self.path.exists() and self.path.stat().st_size > 0:
            existing = RecordingReader(self.path).header
            check_tokenizer(existing, header.tokenizer_fingerprint, self.path)
            if (existing.env_id, existing.env_kwargs) != (header.env_id, header.env_kwargs):
                raise RecordingError(
                    f"{self.path}: holds {existing.env_id} {existing.env_kwargs}, refusing to append "
                    f"{header.env_id} {header.env_kwargs}; write to a new file"
                )
            self._cut_torn_tail()
            self._file = self.path.open("ab")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("wb")
            self._write_line(self._encoder.encode(header))

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
                    msgspec.json.decode(tail, type=Trajectory)
                except (msgspec.DecodeError, msgspec.ValidationError):
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
        self._write_line(self._encoder.encode(trajectory))

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
