"""Fixtures for CLI tests: the rollouts tests' tiny tokenizer and its ChatRenderer
(tests/rollouts/tokenizer_testlib.py)."""

from tokenizer_testlib import renderer, tokenizer  # noqa: F401 (fixtures)
