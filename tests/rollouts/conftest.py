"""Fixtures for rollouts tests: the tiny tokenizer and its ChatRenderer (tokenizer_testlib.py)."""

from tokenizer_testlib import renderer, tokenizer  # noqa: F401 (fixtures)
