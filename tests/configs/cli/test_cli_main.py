"""The `toolgym` commands turn an unusable path into one line on stderr and exit code 2."""

from __future__ import annotations

import pytest

from toolgym.configs.cli.main import main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["replay", "{dir}"], "toolgym replay: error: {dir}: Is a directory"),
        (
            ["record", "--env", "toolgym/Zorplex-v0", "--tasks", "1", "--out", "{dir}", "--no-progress"],
            "toolgym record: error: {dir}: Is a directory",
        ),
        (["plot", "{run}", "--out", "{file}"], "toolgym plot: error: {file}: not a directory"),
        (["plot", "{dir}"], "toolgym plot: error: {dir} has no metrics.jsonl"),
    ],
)
def test_a_path_of_the_wrong_kind_is_one_line_and_exit_code_2(tmp_path, capsys, args, message):
    paths = {"dir": tmp_path / "a_dir", "run": tmp_path / "run", "file": tmp_path / "a_file"}
    paths["dir"].mkdir()
    paths["run"].mkdir()
    (paths["run"] / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    paths["file"].write_text("x")
    assert main([a.format(**paths) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(**paths)) and len(err.strip().splitlines()) == 1, err
    assert paths["file"].read_text() == "x"


def test_train_help_and_the_training_docs_list_every_preset(capsys):
    from pathlib import Path

    from toolgym.configs.load import preset_names

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    docs = (Path(__file__).resolve().parents[3] / "docs" / "training.md").read_text()
    for name in preset_names():
        assert f"\n  {name} " in out, name
        assert f"`{name}`" in docs, name
