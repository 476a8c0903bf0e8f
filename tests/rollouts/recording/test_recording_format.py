"""Recording files: round trip, torn last line, header refusals, appending."""

import json
import subprocess
import sys

import msgspec
import pytest
from recording_testlib import play, write

from toolgym.agents.types import Completion
from toolgym.rollouts.recording.format import (
    RecordingError,
    RecordingHeader,
    RecordingReader,
    RecordingWriter,
    TornLineWarning,
    read_recording,
)
from toolgym.rollouts.types import StopReason, Trajectory, Transition


def trajectory(seed: int) -> Trajectory:
    action = Completion([5, 6, 2], [-0.5, -1.25, -0.125], "stop", "LOOKUP[x]", policy_version=2)
    transition = Transition(
        "What?\nünïcode", [1, 7, 8], action, reward=0.1, info={"tool_calls": 1, "nested": {"a": [1]}}
    )
    return Trajectory(
        env_id="toolgym/Zorplex-v0", env_kwargs={"tier": "simple"}, task_seed=seed, group_id=seed // 2,
        transitions=[transition], stop_reason=StopReason.ANSWERED, total_reward=0.1,
        reward_components={"correct": 1.0}, metrics={"turns": 1},
    )  # fmt: skip


def header(fingerprint: str = "abc") -> RecordingHeader:
    return RecordingHeader(
        tokenizer_fingerprint=fingerprint, env_id="toolgym/Zorplex-v0", env_kwargs={"tier": "simple"}
    )


def test_round_trip_is_exact(tmp_path):
    path = tmp_path / "r.jsonl"
    with RecordingWriter(path, header()) as writer:
        writer.write_all(trajectory(s) for s in range(3))
    head, trajectories = read_recording(path, expected_tokenizer_fingerprint="abc")
    assert trajectories == [trajectory(s) for s in range(3)]
    assert head.env_kwargs == {"tier": "simple"} and head.created  # filled in
    assert path.read_bytes().count(b"\n") == 4


def test_torn_last_line_loses_only_that_line(tmp_path):
    path = tmp_path / "r.jsonl"
    with RecordingWriter(path, header()) as writer:
        writer.write_all(trajectory(s) for s in range(3))
    data = path.read_bytes()
    path.write_bytes(data[: data.rfind(b"\n", 0, -1) + 40])  # a crash 40 bytes into line 4
    reader = RecordingReader(path)
    with pytest.warns(TornLineWarning, match="line 4 is torn"):
        got = list(reader)
    assert got == [trajectory(0), trajectory(1)] and reader.torn_lines == 1

    # appending cuts the torn tail first, so the file is whole lines again
    with pytest.warns(TornLineWarning, match="cutting"), RecordingWriter(path, header()) as writer:
        writer.write(trajectory(7))
    assert read_recording(path)[1] == [trajectory(0), trajectory(1), trajectory(7)]


def test_appending_keeps_a_last_line_that_lacks_only_its_newline(tmp_path, recwarn):
    path = tmp_path / "r.jsonl"
    with RecordingWriter(path, header()) as writer:
        writer.write_all(trajectory(s) for s in range(2))
    path.write_bytes(path.read_bytes()[:-1])  # a whole record, no newline: the reader keeps it
    assert read_recording(path)[1] == [trajectory(0), trajectory(1)]
    with RecordingWriter(path, header()) as writer:
        writer.write(trajectory(7))
    assert read_recording(path)[1] == [trajectory(0), trajectory(1), trajectory(7)]
    assert not [w for w in recwarn if issubclass(w.category, TornLineWarning)]
    assert path.read_bytes().count(b"\n") == 4

    path.write_bytes(path.read_bytes() + b"  ")  # trailing blanks hold no record: dropped quietly
    with RecordingWriter(path, header()) as writer:
        writer.write(trajectory(8))
    assert [t.task_seed for t in read_recording(path)[1]] == [0, 1, 7, 8]
    assert not [w for w in recwarn if issubclass(w.category, TornLineWarning)]


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "r.jsonl"
    with RecordingWriter(path, header()) as writer:
        writer.write_all(trajectory(s) for s in range(2))
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1][:30]
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(RecordingError, match="line 2 is corrupt"):
        read_recording(path)


def test_refuses_other_schema_or_tokenizer(tmp_path):
    path = tmp_path / "r.jsonl"
    with RecordingWriter(path, header("abc")) as writer:
        writer.write(trajectory(0))
    with pytest.raises(RecordingError, match="tokenizer"):
        read_recording(path, expected_tokenizer_fingerprint="def")
    with pytest.raises(RecordingError, match="tokenizer"):
        RecordingWriter(path, header("def"))
    other_env = msgspec.structs.replace(header(), env_kwargs={"tier": "recursive"})
    with pytest.raises(RecordingError, match="refusing to append"):
        RecordingWriter(path, other_env)

    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    head["schema_version"] = 99
    path.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    with pytest.raises(RecordingError, match="schema version 99"):
        read_recording(path)

    (tmp_path / "x.jsonl").write_text('{"hello": 1}\n')
    with pytest.raises(RecordingError, match="not a toolgym recording"):
        read_recording(tmp_path / "x.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(RecordingError, match="empty"):
        read_recording(tmp_path / "empty.jsonl")
    with pytest.raises(RecordingError, match="no such"):
        read_recording(tmp_path / "missing.jsonl")


def test_lines_are_flushed_as_written(tmp_path):
    path = tmp_path / "r.jsonl"
    writer = RecordingWriter(path, header())
    writer.write(trajectory(0))
    assert read_recording(path)[1] == [trajectory(0)]  # visible before close
    writer.close()


def test_a_command_reading_a_torn_recording_prints_one_clean_warning_line(tmp_path):
    """`toolgym replay` on a file whose last line is torn: stderr has the warning as one line of
    its own text (path, line, what was done), not the warnings module's `file:line: Category:`
    prefix and the source line of the code that warned."""
    path = write(tmp_path / "r.jsonl", play("toolgym/Zorplex-v0", [0, 1], group_size=1), "toolgym/Zorplex-v0")
    data = path.read_bytes()
    path.write_bytes(data[: data.rfind(b"\n", 0, -1) + 40])  # a crash 40 bytes into line 3
    result = subprocess.run(
        [sys.executable, "-m", "toolgym.configs.cli", "replay", str(path), "--summary-only"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [f"warning: {path}: line 3 is torn (a crash mid-write?); skipped it"]
