"""Loading a `tokenizers.Tokenizer` from `tokenizer.json`, and a fingerprint that identifies it.

No `transformers` at run time: a Hugging Face checkpoint directory's `tokenizer.json` is all we
need (Qwen2/Qwen3 ship one). The fingerprint goes into recording headers so that a recording
made with one tokenizer is never replayed or trained on with another.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

TOKENIZER_FILENAME = "tokenizer.json"


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a `tokenizer.json` file, or the `tokenizer.json` inside a (Hugging Face) directory.

    Truncation and padding settings stored in the file are switched off: in RL a tokenizer that
    silently drops tokens corrupts training data, and callers pad themselves.

    Raises FileNotFoundError when there is no such file, ValueError when it cannot be parsed.
    """
    path = Path(path)
    if path.is_dir():
        file = path / TOKENIZER_FILENAME
        if not file.is_file():
            present = sorted(p.name for p in path.iterdir() if p.name in _SLOW_TOKENIZER_FILES)
            hint = (
                f" (found {', '.join(present)}: save it once with transformers'"
                " `AutoTokenizer.from_pretrained(dir).save_pretrained(dir)` to get a tokenizer.json)"
                if present
                else ""
            )
            raise FileNotFoundError(f"no {TOKENIZER_FILENAME} in directory {path}{hint}")
    elif path.is_file():
        file = path
    else:
        raise FileNotFoundError(f"tokenizer file or directory not found: {path}")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for every parse failure
        raise ValueError(f"could not load tokenizer from {file}: {exc}") from exc
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


_SLOW_TOKENIZER_FILES = {"vocab.json", "merges.txt", "tokenizer.model", "vocab.txt"}


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A sha256 hex digest of what decides the token ids: the model (vocabulary, merges and their
    options), the added tokens (id, text, flags), the normalizer and the pre-tokenizer.

    It does not depend on how the file was formatted (indentation, key order, legacy "a b" merge
    strings vs ["a", "b"] pairs) and leaves out what does not change ids: the decoder, the
    post-processor (we never add special tokens through it), truncation and padding.
    """
    data = json.loads(tokenizer.to_str())
    canonical = {
        "model": _canonical_model(data["model"]),
        "added_tokens": sorted(
            (_canonical_added_token(t) for t in data.get("added_tokens") or []), key=lambda t: t["id"]
        ),
        "normalizer": data.get("normalizer"),
        "pre_tokenizer": data.get("pre_tokenizer"),
    }
    blob = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _canonical_model(model: dict[str, Any]) -> dict[str, Any]:
    model = dict(model)
    merges = model.get("merges")
    if merges is not None:
        # Files written before tokenizers 0.20 store a merge as "a b"; newer ones as ["a", "b"].
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges]
    return model


def _canonical_added_token(token: dict[str, Any]) -> dict[str, Any]:
    keys = ("id", "content", "special", "single_word", "lstrip", "rstrip", "normalized")
    return {k: token.get(k) for k in keys}


# Text longer than this is encoded through `encode_batch`, which releases the GIL while the Rust
# tokenizer works (`encode` holds it): a multi-megabyte message then takes seconds on its own
# thread without stopping the others (the endpoint renders such a request off its event loop).
RELEASE_GIL_CHARS = 64 * 1024


def text_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """A private copy of `tokenizer` for message text, as every renderer encodes it: special-token
    strings stay plain text (no prompt injection), never truncated or padded. A copy, because
    the flag lives on the tokenizer object and the caller's one is left alone."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = True
    return copy


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text`'s ids with nothing added around it (special-token strings are encoded as the
    tokenizer's settings say); the same ids `tokenizer.encode` gives."""
    if len(text) > RELEASE_GIL_CHARS:
        return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
    return tokenizer.encode(text, add_special_tokens=False).ids
