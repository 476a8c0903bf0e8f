"""load_tokenizer (files, directories, clear errors) and tokenizer_fingerprint (stable, format-free,
sensitive to everything that decides the ids)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers

from toolgym.agents.tokenizer import load_tokenizer, tokenizer_fingerprint
from toolgym.tools.build_tokenizer import train_bpe

CORPUS = ["LOOKUP[apple] returns zorplex 17.", "The answer is 42.", "What is the digit sum of 123?"] * 30


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_bpe(CORPUS, vocab_size=320)


@pytest.fixture
def saved(tokenizer: Tokenizer, tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_load_from_file_and_from_directory(tokenizer, saved):
    from_file = load_tokenizer(saved)
    from_dir = load_tokenizer(saved.parent)
    from_str = load_tokenizer(str(saved))
    ids = tokenizer.encode("LOOKUP[apple]").ids
    for loaded in (from_file, from_dir, from_str):
        assert loaded.encode("LOOKUP[apple]").ids == ids
        assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(tokenizer)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_tokenizer(tmp_path / "nope.json")


def test_directory_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json in directory"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("")
    with pytest.raises(FileNotFoundError, match=r"found merges.txt, vocab.json: .*save_pretrained"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("content", ["", "{", '{"version": "1.0"}', "[1, 2, 3]", "\x00\x01garbage"], ids=repr)
def test_corrupt_file_is_a_clear_value_error(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"could not load tokenizer from {re.escape(str(path))}"):
        load_tokenizer(path)


def test_truncated_file_is_a_clear_value_error(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="could not load tokenizer"):
        load_tokenizer(saved)


def test_loading_switches_off_truncation_and_padding(tokenizer, tmp_path):
    configured = Tokenizer.from_str(tokenizer.to_str())
    configured.enable_truncation(max_length=3)
    configured.enable_padding(length=64)
    path = tmp_path / "tokenizer.json"
    configured.save(str(path))
    loaded = load_tokenizer(path)
    assert (
        loaded.encode("What is the digit sum of 123?").ids
        == tokenizer.encode("What is the digit sum of 123?").ids
    )
    assert tokenizer_fingerprint(configured) == tokenizer_fingerprint(tokenizer)


# ---- fingerprint ----------------------------------------------------------------------------------


def test_fingerprint_is_a_sha256_hex_digest(tokenizer):
    fingerprint = tokenizer_fingerprint(tokenizer)
    assert len(fingerprint) == 64 and int(fingerprint, 16) >= 0
    assert tokenizer_fingerprint(tokenizer) == fingerprint


def test_fingerprint_ignores_file_formatting(tokenizer, tmp_path):
    compact = tmp_path / "compact.json"
    pretty = tmp_path / "pretty.json"
    tokenizer.save(str(compact), pretty=False)
    tokenizer.save(str(pretty), pretty=True)
    assert compact.read_bytes() != pretty.read_bytes()

    # The legacy format (tokenizers < 0.20): merges as "a b" strings; and keys in another order.
    data = json.loads(compact.read_text())
    data["model"]["merges"] = [" ".join(pair) for pair in data["model"]["merges"]]
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps(dict(reversed(list(data.items()))), indent=4))

    fingerprints = {tokenizer_fingerprint(load_tokenizer(p)) for p in (compact, pretty, legacy)}
    assert fingerprints == {tokenizer_fingerprint(tokenizer)}


def test_fingerprint_is_the_same_in_another_process(tokenizer, saved):
    code = (
        "import sys; from toolgym.agents.tokenizer import load_tokenizer, tokenizer_fingerprint;"
        "print(tokenizer_fingerprint(load_tokenizer(sys.argv[1])))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(saved)], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == tokenizer_fingerprint(tokenizer)


def _copy(tokenizer: Tokenizer) -> Tokenizer:
    return Tokenizer.from_str(tokenizer.to_str())


def test_fingerprint_changes_with_anything_that_changes_ids(tokenizer):
    base = tokenizer_fingerprint(tokenizer)

    added = _copy(tokenizer)
    added.add_special_tokens(["<|extra|>"])
    other_vocab = train_bpe(CORPUS, vocab_size=300)
    split = _copy(tokenizer)
    split.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\s+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    no_normalizer = _copy(tokenizer)
    no_normalizer.normalizer = None
    data = json.loads(tokenizer.to_str())
    data["model"]["merges"] = list(reversed(data["model"]["merges"]))
    reordered_merges = Tokenizer.from_str(json.dumps(data))
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    first, second = "a", "b"
    vocab[first], vocab[second] = vocab[second], vocab[first]
    swapped_ids = Tokenizer.from_str(json.dumps(data))

    variants = [added, other_vocab, split, no_normalizer, reordered_merges, swapped_ids]
    fingerprints = [tokenizer_fingerprint(t) for t in variants]
    assert base not in fingerprints
    assert len(set(fingerprints)) == len(variants)


def test_fingerprint_ignores_what_does_not_change_ids(tokenizer):
    other_decoder = _copy(tokenizer)
    other_decoder.decoder = decoders.Metaspace()
    other_decoder.post_processor = None
    assert tokenizer_fingerprint(other_decoder) == tokenizer_fingerprint(tokenizer)
