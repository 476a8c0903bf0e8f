"""Recordings lose only what is damaged: a damaged line is named (path, line, reason) and skipped,
a flipped byte anywhere is caught by the line's crc32, non-finite floats read back, version-1
files still read, and a fuzz over a 200-episode recording (truncations, insertions, byte flips)."""

import math
import random
import subprocess
import sys
import warnings

import msgspec
import pytest

from toolgym.agents.types import Completion
from toolgym.configs.cli.main import main
from toolgym.rollouts.recording.format import (
    DamagedLine,
    RecordingError,
    RecordingHeader,
    RecordingReader,
    RecordingWriter,
    TornLineWarning,
    check_recording,
    read_recording,
)
from toolgym.rollouts.types import StopReason, Trajectory, Transition


def trajectory(seed: int, logprobs=(-0.5, -1.25, -0.125), reward: float = 0.1) -> Trajectory:
    action = Completion([5, 6, 2], list(logprobs), "stop", "LOOKUP[x]", policy_version=2)
    transition = Transition(
        "What?\nünïcode", [1, 7, 8], action, reward=reward, info={"tool_calls": 1, "metrics": {"calls": 1}}
    )
    return Trajectory(
        env_id="toolgym/Zorplex-v0", env_kwargs={"tier": "simple"}, task_seed=seed, group_id=seed // 2,
        transitions=[transition], stop_reason=StopReason.ANSWERED, total_reward=reward,
        reward_components={"correct": 1.0}, policy_version=2, metrics={"turns": 1, "env": {"calls": 1}},
    )  # fmt: skip


def header(version: int | None = None) -> RecordingHeader:
    head = RecordingHeader(
        tokenizer_fingerprint="abc", env_id="toolgym/Zorplex-v0", env_kwargs={"tier": "simple"}
    )
    return head if version is None else msgspec.structs.replace(head, schema_version=version)


def write(path, n: int, version: int | None = None) -> list[bytes]:
    with RecordingWriter(path, header(version)) as writer:
        writer.write_all(trajectory(s) for s in range(n))
    return path.read_bytes().split(b"\n")


def test_corrupt_middle_line_is_reported_and_skipped(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = write(path, 5)
    lines[3] = b"garbage, not a record"  # line 4
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(RecordingError, match=rf"{path}: line 4 is corrupt: .*replay --verify"):
        read_recording(path)
    reader = RecordingReader(path, skip_damaged=True)
    assert [t.task_seed for t in reader] == [0, 1, 3, 4]
    assert [(d.path, d.line) for d in reader.damaged] == [(str(path), 4)]
    assert "crc32" in reader.damaged[0].reason


@pytest.mark.parametrize("version", [1, 2])
def test_invalid_utf8_names_path_and_line(tmp_path, version):
    path = tmp_path / "r.jsonl"
    lines = write(path, 3, version)
    lines[2] = lines[2].replace("ünïcode".encode(), b"\xff\xfe")  # line 3
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(RecordingError) as raised:
        read_recording(path)
    assert str(raised.value).startswith(f"{path}: line 3 is corrupt: ")
    assert ("UTF-8" if version == 1 else "checksum") in str(raised.value)
    reader = RecordingReader(path, skip_damaged=True)
    assert [t.task_seed for t in reader] == [0, 2] and [d.line for d in reader.damaged] == [3]

    # the same bytes in a torn LAST line (no newline): skipped as a crash mid-write, no error
    path.write_bytes(b"\n".join(lines[:3]))
    with pytest.warns(TornLineWarning, match="line 3 is torn"):
        assert [t.task_seed for t in read_recording(path)[1]] == [0]


def test_a_flipped_byte_anywhere_in_a_record_is_detected(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = write(path, 3)
    line = lines[2]
    # the flips that used to pass as a clean replay: inside info / metrics keys, a policy_version key
    for needle in (b'"tool_calls"', b'"calls"', b'"policy_version"', b'"turns"'):
        assert needle in line
    positions = [line.index(n) + 2 for n in (b'"tool_calls"', b'"calls"', b'"policy_version"', b'"turns"')]
    for pos in [*positions, *range(len(line))]:  # ... and every other byte of the line
        flipped = bytearray(line)
        flipped[pos] ^= 0x01 if flipped[pos] != 0x0B else 0x02  # never a newline
        path.write_bytes(b"\n".join([*lines[:2], bytes(flipped), *lines[3:]]))
        reader = RecordingReader(path, skip_damaged=True)
        assert [t.task_seed for t in reader] == [0, 2], pos
        assert [d.line for d in reader.damaged] == [3], pos


def test_a_flipped_byte_in_the_header_refuses_the_file_naming_line_1(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = write(path, 2)
    head = bytearray(lines[0])
    head[head.index(b"Zorplex")] ^= 0x20  # zorplex
    path.write_bytes(b"\n".join([bytes(head), *lines[1:]]))
    with pytest.raises(RecordingError, match=rf"{path}: line 1 \(the header\) is corrupt"):
        RecordingReader(path)


@pytest.mark.parametrize("version", [1, 2])
def test_a_damaged_header_loses_no_record_when_skipping_damage(tmp_path, version):
    """The records carry their env: the header is rebuilt from them, line 1 is listed as damaged,
    and every record is read (it used to lose all of them)."""
    path = tmp_path / "r.jsonl"
    lines = write(path, 5, version)
    path.write_bytes(b"\n".join([b'{"format": "toolgym.traj', *lines[1:]]))
    reader = RecordingReader(path, expected_tokenizer_fingerprint="abc", skip_damaged=True)
    assert (reader.header.env_id, reader.header.env_kwargs) == ("toolgym/Zorplex-v0", {"tier": "simple"})
    assert reader.header.schema_version == version and "header line was damaged" in reader.header.policy_id
    assert [t.task_seed for t in reader] == [0, 1, 2, 3, 4]
    assert [d.line for d in reader.damaged] == [1]
    path.write_bytes(b"not a recording\nat all\n")
    with pytest.raises(RecordingError, match="line 1 is not JSON"):
        RecordingReader(path, skip_damaged=True)


def test_non_finite_floats_read_back(tmp_path):
    path = tmp_path / "r.jsonl"
    nan_episode = trajectory(0, logprobs=(float("nan"), float("-inf"), -0.5), reward=float("inf"))
    with RecordingWriter(path, header()) as writer:
        writer.write(nan_episode)
        writer.write(trajectory(1))
    record = msgspec.json.decode(path.read_bytes().split(b"\n")[1])
    assert record["transitions"][0]["action"]["logprobs"] == ["nan", "-inf", -0.5]  # never null
    _, (got, plain) = read_recording(path)
    assert plain == trajectory(1)
    logprobs = got.transitions[0].action.logprobs
    assert math.isnan(logprobs[0]) and logprobs[1] == -math.inf and logprobs[2] == -0.5
    assert got.total_reward == math.inf and got.transitions[0].reward == math.inf
    assert check_recording(path) == 2


def test_version_1_recordings_still_read_unchecked_and_stay_version_1(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = write(path, 2, version=1)
    assert b"crc32" not in path.read_bytes() and b'"checksum":""' in lines[0]
    with RecordingWriter(path, header()) as writer:  # appending keeps the file's version
        writer.write(trajectory(7))
    head, got = read_recording(path)
    assert head.schema_version == 1 and got == [trajectory(0), trajectory(1), trajectory(7)]
    assert b"crc32" not in path.read_bytes()


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to four random damages to the record lines (the header is left whole): a line cut
    short, a garbage line inserted, a byte flipped; sometimes the file's end torn off."""
    lines = data.split(b"\n")
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(1, len(lines) - 1)
        kind = rng.choice(["truncate", "insert", "flip"])
        if kind == "truncate":
            lines[i] = lines[i][: rng.randrange(1, len(lines[i]))]
        elif kind == "insert":
            garbage = bytes(rng.randrange(256) for _ in range(rng.randint(1, 60))).replace(b"\n", b"")
            lines.insert(i, garbage or b"x")
        else:
            line = bytearray(lines[i])
            line[rng.randrange(len(line))] ^= 1 << rng.randrange(8)
            lines[i] = bytes(line)
    out = b"\n".join(lines)
    if rng.random() < 0.25:  # a crash mid-write: the last line torn
        out = out[: -rng.randint(2, 50)]
    return out


def test_fuzzed_recordings_lose_only_the_damaged_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    original = write(path, 200)
    data = path.read_bytes()
    by_line = {line: trajectory(s) for s, line in enumerate(original[1:-1])}
    rng = random.Random(1234)
    for trial in range(60):
        damaged_data = mutate(rng, data)
        path.write_bytes(damaged_data)
        lines = damaged_data.split(b"\n")
        torn = not damaged_data.endswith(b"\n") and lines[-1] not in by_line
        expected = [by_line[line] for line in lines[1:] if line in by_line]
        expected_damaged = [
            n + 1
            for n, line in enumerate(lines)
            if n > 0 and line.strip() and line not in by_line and not (torn and n == len(lines) - 1)
        ]
        reader = RecordingReader(path, skip_damaged=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TornLineWarning)
            got = list(reader)  # no traceback, whatever the damage
        assert got == expected, trial
        assert [d.line for d in reader.damaged] == expected_damaged, trial
        assert all(isinstance(d, DamagedLine) and d.path == str(path) and d.reason for d in reader.damaged)
        assert reader.torn_lines == int(torn), trial


# ---- the CLI: replay --verify over a real 200-episode recording -----------------------------------


@pytest.fixture
def recorded(tokenizer, tmp_path):
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer.save(str(tokenizer_file))
    out = tmp_path / "oracle.jsonl"
    args = [
        "record", "--env", "toolgym/Zorplex-v0", "--policy", "oracle", "--tasks", "100", "--group-size", "2",
        "--out", str(out), "--tokenizer", str(tokenizer_file), "--no-progress",
    ]  # fmt: skip
    assert main(args) == 0
    return out, str(tokenizer_file)


def _verify(out, tokenizer_file) -> tuple[int, str, str]:
    """`toolgym replay --verify` in a subprocess: (exit code, stdout unwrapped, stderr)."""
    result = subprocess.run(
        [sys.executable, "-m", "toolgym.configs.cli", "replay", str(out), "--verify", "--summary-only",
         "--tokenizer", tokenizer_file],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return result.returncode, " ".join(result.stdout.split()), result.stderr  # rich may wrap lines


def test_replay_verify_checks_every_intact_record_and_names_the_damaged(recorded):
    out, tokenizer_file = recorded
    lines = out.read_bytes().split(b"\n")
    assert len(lines) == 202  # header, 200 records, ''
    flipped = bytearray(lines[150])
    flipped[flipped.index(b'"policy_version"') + 3] ^= 0x01
    lines[150] = bytes(flipped)  # line 151
    lines.insert(101, b"this line is garbage")  # line 102
    out.write_bytes(b"\n".join(lines))
    code, text, err = _verify(out, tokenizer_file)
    assert code == 1 and "Traceback" not in err, err
    assert f"skipped {out}: line 102 is corrupt" in text and f"skipped {out}: line 152 is corrupt" in text
    assert "damaged: 2 lines skipped (line 102, 152)" in text
    assert "verify: 199/199 episodes replay exactly; 2 damaged lines not checked" in text
    # the header too: the records are still checked
    lines[0] = lines[0][:40]
    out.write_bytes(b"\n".join(lines))
    code, text, err = _verify(out, tokenizer_file)
    assert code == 1 and "Traceback" not in err, err
    assert "damaged: 3 lines skipped (line 1, 102, 152)" in text
    assert "verify: 199/199 episodes replay exactly; 3 damaged lines not checked" in text
