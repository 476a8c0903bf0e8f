"""Answers and graders: a task's answer may be any JSON value; a grader says how right a response is.

A grader is any callable `(response, task, state) -> bool | float | Grade`: `response` is what
the policy answered (the text after the answer tag, or a submit tool's `answer` argument),
`task` the episode's Task, `state` the task's per-episode state. A float is a score in [0, 1]
(1 is fully right); a `Grade` adds named reward components. The built-in graders also `read`
a response (text that is no answer of their kind, like `[ANSWER] ten` for a number, is a
malformed answer the policy may correct) and `find` an answer in untagged text:

    exact()                  equal as JSON values (text that is not JSON is compared as a string)
    text()                   strings equal ignoring case and runs of whitespace
    numeric(rel_tol, abs_tol)  a number within tolerance; text must be exactly one number

`default_grader(answer)` picks one by the answer's type: numeric for int (exact) and float
(rel_tol 1e-6), text for str, exact otherwise. A float answer is never rounded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, Final, Protocol, runtime_checkable

import msgspec

MAX_NUMBER_CHARS: Final = 300  # longer numbers are not read (and cannot equal any sensible answer)
_NUMBER: Final = r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
_NUMBER_RE: Final = re.compile(_NUMBER)
# An untagged number stands alone: no letter, digit, '.', ',' or 'x' glued to it (`0x1c`, `1,000`).
_LONE_NUMBER_RE: Final = re.compile(r"(?<![\w.,])(" + _NUMBER + r")(?![\w,]|\.[0-9])")


class Grade(msgspec.Struct, frozen=True):
    """score: how right the response is, in [0, 1]; 1.0 is correct. components: extra named
    reward components (added to the reward and to `reward_components`)."""

    score: float
    components: dict[str, float] = msgspec.field(default_factory=dict)

    @property
    def correct(self) -> bool:
        return self.score >= 1.0


class Unreadable(ValueError):
    """Raised by a grader's `read`: the response is no answer of the grader's kind."""


GraderFn = Callable[[Any, Any, Any], "bool | float | Grade"]


@runtime_checkable
class Reader(Protocol):
    """A grader that also reads responses (`read`) and finds untagged answers (`find`)."""

    hint: str

    def read(self, response: Any) -> Any: ...

    def find(self, text: str) -> Any | None: ...


_READER_TYPES: dict[type, bool] = {}


def is_reader(grader: Any) -> bool:
    """Whether `grader` reads and finds answers (the Reader protocol), decided once per type:
    a runtime Protocol check costs microseconds, more than a whole env step."""
    kind = type(grader)
    if kind not in _READER_TYPES:
        _READER_TYPES[kind] = isinstance(grader, Reader)
    return _READER_TYPES[kind]


def answer_text(answer: Any) -> str:
    """How an answer is written after the tag: a str as it is, a float in its shortest exact form,
    anything else as JSON."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, float):
        return repr(answer)
    return msgspec.json.encode(answer).decode()


def to_grade(value: Any, who: str = "grader") -> Grade:
    """A grader's return value as a Grade; ValueError for a score that is not a finite number in
    [0, 1] or a component that is not a finite number."""
    if isinstance(value, bool):
        return Grade(float(value))
    if isinstance(value, int | float):
        value = Grade(float(value))
    if not isinstance(value, Grade):
        raise ValueError(f"{who} must return a bool, a float or a Grade, got {value!r:.80}")
    if not (math.isfinite(value.score) and 0.0 <= value.score <= 1.0):
        raise ValueError(f"{who} returned score {value.score!r}; scores are in [0, 1]")
    for name, v in value.components.items():
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"{who} returned component {name!r} = {v!r}; components are finite numbers")
    return value


class _ReadingGrader:
    """A grader that reads the response first: one it cannot read scores 0."""

    hint = "<answer>"

    def read(self, response: Any) -> Any:
        return response

    def find(self, text: str) -> Any | None:
        return None

    def score(self, said: Any, truth: Any) -> float:
        raise NotImplementedError

    def __call__(self, response: Any, task: Any, state: Any) -> float:
        try:
            said = self.read(response)
        except Unreadable:
            return 0.0
        return self.score(said, task.answer)


class ExactGrader(_ReadingGrader):
    """Equal as JSON values: the response text is decoded as JSON when it is JSON (`[1, 2]`,
    `true`, `"x"`), else compared as the string it is. `True` never equals `1`."""

    def read(self, response: Any) -> Any:
        if isinstance(response, str):
            try:
                return msgspec.json.decode(response)
            except msgspec.DecodeError:
                return response
        return response

    def score(self, said: Any, truth: Any) -> float:
        return float(_json_equal(said, truth))


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return a == b


class TextGrader(_ReadingGrader):
    """Strings equal after case folding and collapsing whitespace (`  New   york ` == `new york`)."""

    hint = "<text>"

    @staticmethod
    def normalise(text: str) -> str:
        return " ".join(text.casefold().split())

    def read(self, response: Any) -> str:
        if not isinstance(response, str):
            raise Unreadable(f"expected text, got {answer_text(response)[:40]}")
        if not response.strip():
            raise Unreadable("empty answer")
        return response

    def score(self, said: Any, truth: Any) -> float:
        return float(self.normalise(said) == self.normalise(answer_text(truth)))


class NumericGrader(_ReadingGrader):
    """A number within `max(rel_tol * max(|a|, |b|), abs_tol)` of the answer. Text must be
    exactly one number (a trailing '.' allowed): `28.9`, `28 or 29`, `28-29`, `28,29` and
    `0x1c` are never 28. Ints are compared exactly when both tolerances are 0."""

    hint = "<number>"

    def __init__(self, rel_tol: float = 0.0, abs_tol: float = 0.0):
        for name, tol in (("rel_tol", rel_tol), ("abs_tol", abs_tol)):
            if not (isinstance(tol, int | float) and math.isfinite(tol) and tol >= 0):
                raise ValueError(f"numeric grader: {name} must be a finite number >= 0, got {tol!r}")
        self.rel_tol, self.abs_tol = float(rel_tol), float(abs_tol)

    def __repr__(self) -> str:
        return f"numeric(rel_tol={self.rel_tol:g}, abs_tol={self.abs_tol:g})"

    @staticmethod
    def _number(text: str) -> int | float:
        if len(text) > MAX_NUMBER_CHARS:
            raise Unreadable("the number is too long")
        if re.fullmatch(r"[-+]?[0-9]+", text):
            return int(text)
        return float(text)

    def read(self, response: Any) -> int | float:
        if isinstance(response, bool) or response is None:
            raise Unreadable(f"expected a number, got {answer_text(response)}")
        if isinstance(response, int | float):
            return response
        if not isinstance(response, str):
            raise Unreadable(f"expected a number, got {answer_text(response)[:40]}")
        text = response.strip()
        if text.endswith(".") and not text.endswith(".."):
            text = text[:-1]
        if not _NUMBER_RE.fullmatch(text):
            raise Unreadable(f"expected a number, got {response.strip()[:40]!r}")
        return self._number(text)

    def find(self, text: str) -> Any | None:
        """The last number standing alone in `text` (`The answer is 42.` -> 42), or None."""
        last = None
        for last in _LONE_NUMBER_RE.finditer(text):  # noqa: B007 (keep the last one)
            pass
        if last is None:
            return None
        try:
            return self._number(last.group(1))
        except Unreadable:
            return None

    def score(self, said: Any, truth: Any) -> float:
        if isinstance(truth, bool) or not isinstance(truth, int | float):
            return 0.0
        if isinstance(said, int) and isinstance(truth, int):
            diff = abs(said - truth)
            if diff == 0:
                return 1.0
            if self.rel_tol == 0 and self.abs_tol == 0:
                return 0.0
        try:
            return float(math.isclose(float(said), float(truth), rel_tol=self.rel_tol, abs_tol=self.abs_tol))
        except OverflowError:
            return 0.0


def exact() -> ExactGrader:
    return ExactGrader()


def text() -> TextGrader:
    return TextGrader()


def numeric(rel_tol: float = 0.0, abs_tol: float = 0.0) -> NumericGrader:
    return NumericGrader(rel_tol, abs_tol)


def default_grader(answer: Any) -> Any:
    """numeric() for an int, numeric(rel_tol=1e-6) for a float, text() for a str, exact() else."""
    if isinstance(answer, bool):
        return _EXACT
    if isinstance(answer, int):
        return _INTEGER
    if isinstance(answer, float):
        return _FLOAT
    if isinstance(answer, str):
        return _TEXT
    return _EXACT


# The defaults hold no state: one of each serves every env.
_EXACT, _TEXT, _INTEGER, _FLOAT = ExactGrader(), TextGrader(), NumericGrader(), NumericGrader(rel_tol=1e-6)
