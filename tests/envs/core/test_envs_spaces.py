"""UnicodeText: holds any str up to a length; samples from its own seeded RNG."""

import numpy as np
import pytest
from gymnasium.spaces import Text

from toolgym.envs import UnicodeText


def test_contains_any_unicode_up_to_max_length():
    space = UnicodeText(10)
    for text in ["", "line\nbreak", "héllo wö", "日本語", "\x00\x7f", "\U0001f600" * 10, "\ud800"]:
        assert text in space
    assert "x" * 11 not in space
    assert b"bytes" not in space and 5 not in space and None not in space
    assert "a" not in UnicodeText(10, min_length=2)
    assert "line\nbreak" not in Text(20)  # why this space exists


def test_sample_is_seeded_by_the_space_rng_only():
    a, b = UnicodeText(50, seed=3), UnicodeText(50, seed=3)
    np.random.seed(0)
    samples_a = [a.sample() for _ in range(20)]
    np.random.seed(1)  # global state must not matter
    samples_b = [b.sample() for _ in range(20)]
    assert samples_a == samples_b
    assert all(sample in a for sample in samples_a)
    assert len(set(samples_a)) == 20
    other = UnicodeText(50, seed=4)
    assert [other.sample() for _ in range(20)] != samples_a


def test_samples_mix_ascii_and_non_ascii_and_encode_to_utf8():
    space = UnicodeText(2000, seed=0)
    text = "".join(space.sample(mask=2000) for _ in range(5))
    assert any(c.isascii() for c in text) and any(not c.isascii() for c in text)
    text.encode("utf-8")  # no lone surrogates
    assert len(space.sample(mask=7)) == 7 and space.sample(mask=0) == ""
    with pytest.raises(ValueError, match="length must be in"):
        space.sample(mask=2001)


def test_validation_and_equality():
    with pytest.raises(ValueError, match="positive int"):
        UnicodeText(0)
    with pytest.raises(ValueError, match="min_length"):
        UnicodeText(5, min_length=6)
    assert UnicodeText(5) == UnicodeText(5) != UnicodeText(6)
    assert hash(UnicodeText(5)) == hash(UnicodeText(5))
    assert repr(UnicodeText(5)) == "UnicodeText(min_length=0, max_length=5)"
