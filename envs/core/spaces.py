"""A Gymnasium space of Unicode strings.

Gymnasium's own `spaces.Text` only holds strings over a fixed character set (alphanumerics by
default), so it rejects the newlines, punctuation and non-ASCII text a language model writes.
`UnicodeText` holds every `str` up to a length; that is all the env contract needs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.spaces import Space

# Sampled characters: half from printable ASCII plus newline/tab (so samples look like text and
# sometimes like tool syntax), half from all of Unicode minus the surrogate block (lone
# surrogates cannot be encoded to UTF-8, and a tokenizer downstream would choke on them).
_ASCII = np.array([ord(c) for c in "\n\t"] + list(range(0x20, 0x7F)), dtype=np.int64)
_SURROGATES = 0xE000 - 0xD800
_UNICODE_HIGH = 0x110000 - _SURROGATES


class UnicodeText(Space[str]):
    """Any Python `str` of `min_length` to `max_length` characters (code points).

    `sample()` draws the length uniformly and then each character, from the space's own
    `np_random` (seed it with `space.seed(n)`). `sample(mask=n)` fixes the length to n.
    """

    def __init__(
        self, max_length: int, *, min_length: int = 0, seed: int | np.random.Generator | None = None
    ):
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"UnicodeText max_length must be a positive int, got {max_length!r}")
        if not isinstance(min_length, int) or not 0 <= min_length <= max_length:
            raise ValueError(f"UnicodeText min_length must be in [0, {max_length}], got {min_length!r}")
        self.max_length = max_length
        self.min_length = min_length
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def sample(self, mask: int | None = None, probability: None = None) -> str:
        if probability is not None:
            raise ValueError("UnicodeText.sample does not support `probability`")
        rng = self.np_random
        if mask is None:
            length = int(rng.integers(self.min_length, self.max_length + 1))
        else:
            length = int(mask)
            if not self.min_length <= length <= self.max_length:
                raise ValueError(
                    f"UnicodeText.sample(mask={mask}): length must be in "
                    f"[{self.min_length}, {self.max_length}]"
                )
        if length == 0:
            return ""
        ascii_chars = rng.choice(_ASCII, size=length)
        any_chars = rng.integers(1, _UNICODE_HIGH, size=length)
        any_chars[any_chars >= 0xD800] += _SURROGATES
        codepoints = np.where(rng.random(length) < 0.5, ascii_chars, any_chars)
        return "".join(map(chr, codepoints.tolist()))

    def __repr__(self) -> str:
        return f"UnicodeText(min_length={self.min_length}, max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, UnicodeText)
            and self.min_length == other.min_length
            and self.max_length == other.max_length
        )

    def __hash__(self) -> int:
        return hash((UnicodeText, self.min_length, self.max_length))
