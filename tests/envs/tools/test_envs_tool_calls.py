"""The bracket tool-call format (tool_calls.BracketFormat.parse), case by case."""

import pytest

from toolgym.envs.tools.call_formats import BracketFormat, clean_argument, near_miss_pattern

BRACKETS = BracketFormat()
NEAR_MISS = near_miss_pattern(["LOOKUP", "FETCH"])


def parse_action(text, near_miss):
    parsed = BRACKETS.parse(text, near_miss)
    calls = None if parsed.calls is None else [(c.name, c.arguments) for c in parsed.calls]
    return parsed._replace(calls=calls)


@pytest.mark.parametrize(
    ("text", "kind", "answer", "calls"),
    [
        ("[ANSWER] 42", "answer", "42", None),
        ("[ANSWER] -7", "answer", "-7", None),
        ("blah [Answer]:  13 trailing", "answer", "13 trailing", None),  # the whole line: the grader reads it
        ("[ANSWER] 1.864\nbecause", "answer", "1.864", None),
        ("LOOKUP[a] [ANSWER] 1", "answer", "1", None),
        ("[ANSWER] 99999999999999999999", "answer", "99999999999999999999", None),
        ("[ANSWER]", "answer", "", None),
        ("[ANSWER] -", "answer", "-", None),
        ("LOOKUP[apple]", "calls", None, [("LOOKUP", "apple")]),
        ("lookup['apple'] then FETCH[ ZK_1 ]", "calls", None, [("lookup", "'apple'"), ("FETCH", " ZK_1 ")]),
        ("FOO[bar]", "calls", None, [("FOO", "bar")]),
        ("x[ANSWER 3]", "calls", None, [("x", "ANSWER 3")]),
        # a call whose argument is the word "answer" is a call, not a malformed answer
        ("LOOKUP[answer]", "calls", None, [("LOOKUP", "answer")]),
        ("lookup[ Answer ] FETCH_2[answer]", "calls", None, [("lookup", " Answer "), ("FETCH_2", "answer")]),
        ("LOOKUP[answer] so [ANSWER] 5", "answer", "5", None),
        ("it is 42[ANSWER] 42", "answer", "42", None),  # digits are no tool name
        ("so:[answer] 7", "answer", "7", None),
        ("LOOKUP[", "bad_call", None, None),
        ("LOOKUP (apple)", "bad_call", None, None),
        ("fetch[a\nb]", "bad_call", None, None),
        ("MYLOOKUP[", "other", None, None),  # not a known tool name
        ("The answer is 42.", "other", None, None),  # maybe an untagged answer: the grader finds it
        ("no numbers here", "other", None, None),
        ("  \n ", "empty", None, None),
        ("", "empty", None, None),
    ],
)
def test_parse_action(text, kind, answer, calls):
    parsed = parse_action(text, NEAR_MISS)
    assert (parsed.kind, parsed.answer, parsed.calls) == (kind, answer, calls)


@pytest.mark.parametrize(
    ("raw", "clean"),
    [("apple", "apple"), (" 'apple' ", "apple"), ('"apple"', "apple"), ("'apple\"", "'apple\""), ("''", "")],
)
def test_clean_argument(raw, clean):
    assert clean_argument(raw) == clean


def test_no_tools_means_no_near_misses():
    assert near_miss_pattern([]) is None
    assert parse_action("LOOKUP[", None).kind == "other"
