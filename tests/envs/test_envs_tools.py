"""The action grammar (tools.parse_action), case by case."""

import pytest

from toolgym.envs.tools import clean_argument, near_miss_pattern, parse_action

NEAR_MISS = near_miss_pattern(["LOOKUP", "FETCH"])


@pytest.mark.parametrize(
    ("text", "kind", "answer", "calls"),
    [
        ("[ANSWER] 42", "answer", 42, None),
        ("[ANSWER] -7", "answer", -7, None),
        ("blah [Answer]:  13 trailing", "answer", 13, None),
        ("LOOKUP[a] [ANSWER] 1", "answer", 1, None),
        ("[ANSWER] 99999999999999999999", "answer", None, None),  # too many digits to be an answer
        ("[ANSWER]", "bad_answer", None, None),
        ("[ANSWER] -", "bad_answer", None, None),
        ("[ANSWER] - 5", "bad_answer", None, None),
        ("LOOKUP[apple]", "calls", None, [("LOOKUP", "apple")]),
        ("lookup['apple'] then FETCH[ ZK_1 ]", "calls", None, [("lookup", "'apple'"), ("FETCH", " ZK_1 ")]),
        ("FOO[bar]", "calls", None, [("FOO", "bar")]),
        ("x[ANSWER 3]", "calls", None, [("x", "ANSWER 3")]),
        # a call whose argument is the word "answer" is a call, not a malformed answer
        ("LOOKUP[answer]", "calls", None, [("LOOKUP", "answer")]),
        ("lookup[ Answer ] FETCH_2[answer]", "calls", None, [("lookup", " Answer "), ("FETCH_2", "answer")]),
        ("LOOKUP[answer] so [ANSWER] 5", "answer", 5, None),
        ("it is 42[ANSWER] 42", "answer", 42, None),  # digits are no tool name
        ("so:[answer] 7", "answer", 7, None),
        ("LOOKUP[", "bad_call", None, None),
        ("LOOKUP (apple)", "bad_call", None, None),
        ("fetch[a\nb]", "bad_call", None, None),
        ("MYLOOKUP[", "nothing", None, None),  # not a known tool name
        ("The answer is 42.", "untagged", 42, None),
        ("3-2 is 1", "untagged", 1, None),
        ("it is -12", "untagged", -12, None),
        ("[1, 2, 3]", "untagged", 3, None),
        ("no numbers here", "nothing", None, None),
        ("  \n ", "empty", None, None),
        ("", "empty", None, None),
    ],
)
def test_parse_action(text, kind, answer, calls):
    parsed = parse_action(text, NEAR_MISS)
    assert (parsed.kind, parsed.answer, parsed.calls) == (kind, answer, calls)


def test_untagged_can_be_switched_off():
    assert parse_action("The answer is 42.", NEAR_MISS, accept_untagged=False).kind == "nothing"


@pytest.mark.parametrize(
    ("raw", "clean"),
    [("apple", "apple"), (" 'apple' ", "apple"), ('"apple"', "apple"), ("'apple\"", "'apple\""), ("''", "")],
)
def test_clean_argument(raw, clean):
    assert clean_argument(raw) == clean


def test_no_tools_means_no_near_misses():
    assert near_miss_pattern([]) is None
    assert parse_action("LOOKUP[", None).kind == "nothing"
