"""`toolgym envs|record|replay|eval` smoke tests (main() in-process, one real subprocess)."""

import json
import subprocess
import sys

import msgspec
import pytest

from toolgym.configs.cli.main import build_parser, main


@pytest.fixture
def tokenizer_file(tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def record_args(tokenizer_file, out, *extra):
    return [
        "record", "--env", "toolgym/Zorplex-v0", "--env-kwargs", '{"tier": "recursive"}',
        "--policy", "oracle", "--p-omit-tag", "0.5", "--tasks", "3", "--group-size", "2",
        "--out", str(out), "--tokenizer", tokenizer_file, "--no-progress", *extra,
    ]  # fmt: skip


def test_envs(capsys):
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert "toolgym/Zorplex-v0" in out and "toolgym/SumDigits-v0" in out


def test_envs_lists_the_max_turns_an_env_sets_itself(tmp_path, monkeypatch, capsys):
    """It listed ToolEnv's max_turns 5 for an env whose __init__ sets 6 with setdefault."""
    (tmp_path / "cli_setdefault_env.py").write_text(
        "import gymnasium\n"
        "from toolgym.envs import ToolEnv\n\n\n"
        "class Quiz(ToolEnv):\n"
        "    def __init__(self, **knobs):\n"
        '        knobs.setdefault("max_turns", 6)\n'
        '        super().__init__(instructions="quiz", **knobs)\n\n\n'
        'gymnasium.register(id="cli_knobs/Quiz-v0", entry_point=Quiz)\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("COLUMNS", "1000")  # one table row per line
    assert main(["envs", "--env-module", "cli_setdefault_env"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "cli_knobs/Quiz-v0" in line]
    assert '"max_turns": 6' in row


def test_record_replay_verify(tokenizer_file, tmp_path, capsys):
    out = tmp_path / "oracle.jsonl"
    assert main(record_args(tokenizer_file, out)) == 0
    assert "recorded 6 episodes" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 7
    # appending continues the task stream instead of repeating tasks
    assert main(record_args(tokenizer_file, out)) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    assert sorted({x["group_id"] for x in lines}) == [0, 1, 2, 3, 4, 5]
    capsys.readouterr()

    assert main(["replay", str(out), "--verify", "--limit", "1", "--tokenizer", tokenizer_file]) == 0
    text = capsys.readouterr().out
    assert "verify: 12/12 episodes replay exactly" in text
    assert text.count("=== toolgym/Zorplex-v0") == 1 and "⟦" in text and "accuracy" in text


def test_replay_refuses_another_tokenizer(tokenizer_file, tmp_path, capsys):
    out = tmp_path / "oracle.jsonl"
    assert main(record_args(tokenizer_file, out)) == 0
    from tokenizers import Tokenizer, models, pre_tokenizers

    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel()
    other.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    other.save(str(tmp_path / "other.json"))
    capsys.readouterr()
    assert main(["replay", str(out), "--tokenizer", str(tmp_path / "other.json")]) == 2
    assert "recorded with tokenizer" in capsys.readouterr().err


def test_replay_with_the_wrong_shipped_tokenizer_names_the_right_one(tmp_path, capsys):
    # Recorded with the shipped "copy" split, replayed with the default: the error says which
    # --tokenizer the file needs; the other way round it says to leave --tokenizer out.
    copy, default = tmp_path / "copy.jsonl", tmp_path / "default.jsonl"
    assert main(record_args("copy", copy)) == 0
    args = record_args("copy", default)
    del args[args.index("--tokenizer") : args.index("--tokenizer") + 2]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["replay", str(copy), "--limit", "0"]) == 2
    assert "It is the shipped 'copy' tokenizer: pass --tokenizer copy." in capsys.readouterr().err
    assert main(["replay", str(default), "--limit", "0", "--tokenizer", "copy"]) == 2
    assert "It is the default tokenizer: leave --tokenizer out." in capsys.readouterr().err
    assert main(["replay", str(copy), "--limit", "0", "--tokenizer", "copy"]) == 0


def test_eval_oracle(tokenizer_file, tmp_path, capsys):
    metrics_file = tmp_path / "eval.json"
    args = ["eval", "--env", "toolgym/SumDigits-v0", "--policy", "oracle", "--tasks", "4"]
    assert main([*args, "--tokenizer", tokenizer_file, "--examples", "1", "--out", str(metrics_file)]) == 0
    assert "[ANSWER]" in capsys.readouterr().out
    assert json.loads(metrics_file.read_text())["metrics"]["eval/accuracy"] == 1.0


def test_bad_input_is_a_clear_error(tokenizer_file, tmp_path, capsys):
    assert main([*record_args(tokenizer_file, tmp_path / "x.jsonl")[:-1], "--max-turns", "0"]) == 2
    assert "max_turns" in capsys.readouterr().err
    args = record_args(tokenizer_file, tmp_path / "x.jsonl")
    args[args.index("--env-kwargs") + 1] = '{"tier": "bogus"}'
    assert main(args) == 2 and "bogus" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--tokenizer", tokenizer_file]) == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["record", "--env", "x", "--env-kwargs", "[1]", "--tasks", "1", "--out", "o"]
        )


def test_entry_point_subprocess():
    result = subprocess.run(
        [sys.executable, "-m", "toolgym.configs.cli", "envs"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "toolgym/Zorplex-v0" in result.stdout


def test_record_says_when_the_oracle_fell_short(tokenizer_file, tmp_path, capsys):
    """An oracle cut by a limit used to report accuracy 0 and exit 0 without a word."""

    def record(name, *extra):
        return main([
            "record", "--env", "toolgym/Zorplex-v0", "--policy", "oracle", "--tasks", "2", "--group-size", "2",
            "--out", str(tmp_path / name), "--tokenizer", tokenizer_file, "--no-progress", *extra,
        ])  # fmt: skip

    assert record("cut.jsonl", "--max-turns", "1") == 1  # Zorplex's oracle takes 2 turns
    err = capsys.readouterr().err
    assert err.startswith("toolgym record: error: the oracle succeeded on no episode (") and "a limit cut" in err
    assert record("fallible.jsonl", "--p-omit-tag", "1.0") == 0
    assert "warning: the oracle succeeded on 0.00 of its episodes" in capsys.readouterr().out
    assert record("fine.jsonl") == 0
    assert "warning" not in capsys.readouterr().out


HASHED_ENV = '''import gymnasium
from toolgym.envs import Task, ToolEnv

WORDS = ["apple", "pear", "fig", "kiwi", "plum", "lime", "date", "yuzu"]


class Words(ToolEnv):
    """Its tasks iterate a set of strings: they change with PYTHONHASHSEED."""

    def __init__(self, **knobs):
        super().__init__(instructions="Name the first word.", **knobs)

    def new_task(self):
        shuffled = list(set(WORDS))
        k = int(self.np_random.integers(2, len(WORDS)))
        return Task("Which word is first: " + ", ".join(shuffled[:k]) + "?", shuffled[0])


gymnasium.register(id="hashed/Words-v0", entry_point=Words)
'''


def test_replay_under_another_hash_seed_names_the_one_it_was_recorded_with(tokenizer_file, tmp_path):
    """It said only "0/8 episodes replay exactly, 8 differ"."""
    (tmp_path / "hashed_words_env.py").write_text(HASHED_ENV)

    def cli(hash_seed, *args):
        env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONHASHSEED"}
        env.update(PYTHONHASHSEED=hash_seed, COLUMNS="1000")
        command = [sys.executable, "-m", "toolgym.configs.cli", *args, "--env-module", "hashed_words_env"]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    out = str(tmp_path / "words.jsonl")
    recorded = cli("0", "record", "--env", "hashed/Words-v0", "--policy", "oracle", "--tasks", "8",
                   "--group-size", "1", "--out", out, "--tokenizer", tokenizer_file, "--no-progress")  # fmt: skip
    assert recorded.returncode == 0, recorded.stderr
    replay = ["replay", out, "--verify", "--limit", "0", "--tokenizer", tokenizer_file]
    same = cli("0", *replay)
    assert same.returncode == 0 and "verify: 8/8 episodes replay exactly" in same.stdout, same.stdout + same.stderr
    assert "PYTHONHASHSEED" not in same.stdout
    other = cli("1", *replay)
    assert other.returncode == 1 and "differ" in other.stdout, other.stdout + other.stderr
    assert (
        "recorded with PYTHONHASHSEED=0 and replayed with PYTHONHASHSEED=1: envs whose tasks iterate "
        "sets of strings make other tasks; replay with PYTHONHASHSEED=0" in other.stdout
    ), other.stdout


def test_verify_of_endpoint_captures_says_what_it_checks(tokenizer_file, tmp_path, capsys):
    # it said "pass --env-module", but no module registers the endpoint's captures
    from toolgym.rollouts.endpoint.capture import ENDPOINT_ENV_ID
    from toolgym.rollouts.recording.format import RecordingReader, RecordingWriter

    recorded = tmp_path / "oracle.jsonl"
    assert main(record_args(tokenizer_file, recorded)) == 0
    reader = RecordingReader(recorded)
    header = msgspec.structs.replace(reader.header, env_id=ENDPOINT_ENV_ID, checksum="")
    captures = tmp_path / "captures.jsonl"
    with RecordingWriter(captures, header) as writer:
        writer.write_all(list(reader))
    capsys.readouterr()
    assert main(["replay", str(captures), "--verify", "--limit", "0", "--tokenizer", tokenizer_file]) == 0
    text = capsys.readouterr().out
    assert "holds `toolgym serve` captures: there is no env to replay them in" in text
    assert "verify: 6/6 captures read whole" in text and "--env-module" not in text
