"""Tools as users write them: typed multi-argument tools (both call formats), async tools, tool
rewards, answers of any type with graders, final-state rewards and env-defined success."""

import asyncio
import enum
import json
import time
import warnings
from typing import Literal

import gymnasium
import msgspec
import pytest
from recording_testlib import play

from toolgym.envs import (
    Call,
    Grade,
    Task,
    Tool,
    ToolEnv,
    ToolError,
    ToolResult,
    Unreadable,
    exact,
    numeric,
    text,
    tool,
)
from toolgym.envs.tools import typed
from toolgym.envs.tools.typed import ToolCrashError


def json_call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def response(obs):
    return obs.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")


@tool
def convert(value: float, source: Literal["km", "mi"], target: Literal["km", "mi"]) -> float:
    """Convert a distance between kilometres and miles.

    Args:
        value: the distance.
        source: the unit `value` is in.
        target: the unit wanted.
    """
    factor = {"km": 1.0, "mi": 1.609344}
    return round(value * factor[source] / factor[target], 3)


class ConverterEnv(ToolEnv):
    def __init__(self, answer=1.864, **knobs):
        self._answer = answer
        super().__init__(tools=[convert], instructions="Convert units.", **knobs)

    def new_task(self):
        return Task(
            "How many miles is 3 km?",
            self._answer,
            [Call("convert", dict(value=3, source="km", target="mi"))],
        )


# ---- the cases that used to go wrong -------------------------------------------------------------


@pytest.mark.parametrize("tool_format", ["brackets", "json"])
def test_a_float_answer_is_never_truncated(tool_format):
    env = ConverterEnv(tool_format=tool_format)
    _, info = env.reset(seed=0)
    assert info["answer"] == env.answer == 1.864
    assert env.step("[ANSWER] 1.99")[0] == "INCORRECT (answer: 1.864)"
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("[ANSWER] 1.864")
    assert (obs, reward, terminated, info["metrics"]["accuracy"]) == (
        "CORRECT",
        pytest.approx(1.2),
        True,
        1.0,
    )
    env.reset(seed=0)
    assert env.step("[ANSWER] 1")[0] == "INCORRECT (answer: 1.864)"


@pytest.mark.parametrize(
    ("action", "outcome"),
    [
        ("[ANSWER] 28", "CORRECT"),
        ("[ANSWER] 28.", "CORRECT"),
        ("[ANSWER] 28.0", "CORRECT"),
        ("[ANSWER]: 28", "CORRECT"),
        ("[ANSWER] 28.9", "INCORRECT (answer: 28)"),
        ("[ANSWER] 2.8e1", "CORRECT"),
        ("[ANSWER] 28 or 29", "malformed"),
        ("[ANSWER] 28-29", "malformed"),
        ("[ANSWER] 28,29", "malformed"),
        ("[ANSWER] 0x1c", "malformed"),
        ("[ANSWER] 28 because", "malformed"),
        ("[ANSWER] 1e400", "INCORRECT (answer: 28)"),
        ("[ANSWER] " + "9" * 5000, "malformed"),
        ("The answer is 0x1c.", "no answer"),
        ("It is 28.9 I think", "INCORRECT (answer: 28)"),  # untagged: the last lone number
        ("So 27 or 28", "CORRECT"),  # untagged answers are lenient by design: correct credit only
    ],
)
def test_integer_grading_is_strict(action, outcome):
    env = ConverterEnv(answer=28)
    env.reset(seed=0)
    obs, _reward, terminated, _, info = env.step(action)
    if outcome == "malformed":
        assert (
            not terminated
            and obs.startswith("ERROR: malformed answer")
            and info["step_errors"] == ["malformed_answer"]
        )
    elif outcome == "no answer":
        assert not terminated and info["step_errors"] == ["no_call_no_answer"]
    else:
        assert (
            terminated
            and obs == outcome
            and all(map(lambda v: v == v and abs(v) < 1e9, info["reward_components"].values()))
        )


def test_a_string_answer_is_graded_ignoring_case_and_spacing():
    class Capital(ToolEnv):
        def __init__(self):
            super().__init__(instructions="Name capitals.")

        def new_task(self):
            return Task("Capital of the USA's largest city's state?", "New  York")

    env = Capital()
    _, info = env.reset(seed=0)
    assert info["answer"] == "New  York" and "Finish with [ANSWER] <answer>." in env.system_prompt
    assert env.step("[ANSWER]   new york ")[0] == "CORRECT"
    env.reset(seed=0)
    assert env.step("[ANSWER] Albany")[0] == "INCORRECT (answer: New  York)"
    env.reset(seed=0)
    assert env.step("The answer is New York.")[4]["step_errors"] == [
        "no_call_no_answer"
    ]  # text is never guessed


@pytest.mark.parametrize("tool_format", ["brackets", "json"])
def test_a_three_parameter_tool_is_called_with_its_typed_arguments(tool_format):
    env = ConverterEnv(tool_format=tool_format)
    env.reset(seed=0)
    calls = env.oracle_actions()[:-1]
    expected = "<tool_call>" if tool_format == "json" else "CONVERT[3, km, mi]"
    assert calls[0].startswith(expected)
    obs, reward, *_, info = env.step(calls[0])
    assert response(obs) in ("1.864", "CONVERT[3, km, mi] = 1.864") and info["step_errors"] == []
    assert reward == 0.0


def test_bracket_arguments_are_converted_and_validated():
    env = ConverterEnv(max_consecutive_errors=None)
    env.reset(seed=0)
    assert env.step("convert[ 5, 'mi', km ]")[0] == "CONVERT[5, 'mi', km] = 8.047"
    obs, *_, info = env.step("CONVERT[five, km, mi]")
    assert obs == "CONVERT[five, km, mi] = ERROR: argument `value`: expected `float`, got `str`"
    assert info["step_errors"] == ["bad_arguments"]
    assert env.step("CONVERT[5, km, yards]")[0].endswith(
        "ERROR: argument `target`: invalid enum value 'yards'"
    )
    assert env.step("CONVERT[5, km]")[0].endswith("ERROR: missing argument `target`")
    env.reset(seed=0)
    assert env.step("CONVERT[5, km, mi, 7]")[0].endswith("takes 3 argument(s) (value, source, target), got 4")


def test_json_arguments_are_validated_strictly_and_name_the_parameter():
    env = ConverterEnv(tool_format="json", max_consecutive_errors=None, max_tool_calls=20, max_turns=20)
    env.reset(seed=0)
    cases = [
        (
            json_call("convert", value="3", source="km", target="mi"),
            "ERROR: argument `value`: expected `float`, got `str`",
        ),
        (
            json_call("convert", value=True, source="km", target="mi"),
            "ERROR: argument `value`: expected `float`, got `bool`",
        ),
        (json_call("convert", value=3, source="km"), "ERROR: missing argument `target`"),
        (
            json_call("convert", value=3, source="km", target="mi", extra=1),
            "ERROR: unexpected argument `extra`",
        ),
        (
            '<tool_call>\n{"name": "convert", "arguments": [3]}\n</tool_call>',
            "ERROR: arguments must be a JSON object, got list",
        ),
        (
            '<tool_call>\n{"name": "convert", "arguments": {"value": 3,\n</tool_call>',
            "ERROR: the tool call is not valid JSON",
        ),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', 'ERROR: a tool call is {"name"'),
        (json_call("teleport", to="mars"), "ERROR: unknown tool 'teleport'; the tools are: convert."),
    ]
    for action, expected in cases:
        obs, reward, terminated, truncated, info = env.step(action)
        assert response(obs).startswith(expected), (action, obs)
        assert len(info["step_errors"]) == 1 and reward < 0 and not (terminated or truncated)
    # The OpenAI API's shape (arguments as a JSON string) is accepted too.
    stringified = '<tool_call>\n{"name": "convert", "arguments": "{\\"value\\": 3, \\"source\\": \\"km\\", \\"target\\": \\"mi\\"}"}\n</tool_call>'
    assert response(env.step(stringified)[0]) == "1.864"


def test_json_calls_several_per_turn_in_order_and_mixed_with_an_answer():
    env = ConverterEnv(tool_format="json")
    env.reset(seed=0)
    two = (
        json_call("convert", value=1, source="mi", target="km")
        + "\n"
        + json_call("convert", value=2, source="mi", target="km")
    )
    obs, _, _, _, info = env.step(two)
    assert obs == "<tool_response>\n1.609\n</tool_response>\n<tool_response>\n3.219\n</tool_response>"
    assert info["tool_calls"] == 2
    obs, _, terminated, _, info = env.step(
        json_call("convert", value=1, source="mi", target="km") + "\n[ANSWER] 1.864"
    )
    assert obs.startswith("ERROR: tool calls and an answer in one turn") and not terminated
    assert info["step_errors"] == ["mixed_call_and_answer"] and info["tool_calls"] == 2  # nothing ran


def test_a_native_tool_call_in_a_bracket_env_is_a_malformed_call_not_an_answer():
    env = ConverterEnv(answer=3)
    env.reset(seed=0)
    obs, _, terminated, _, info = env.step(json_call("convert", value=3, source="km", target="mi"))
    assert not terminated and info["step_errors"] == ["malformed_call"]
    assert obs == "ERROR: malformed tool call. Write it like CONVERT[value, source, target]."


def test_a_bracket_call_in_a_json_env_is_a_malformed_call_with_the_json_form():
    """It used to be "no call and no answer", with no hint of how this env calls tools."""
    for accept in (False, True):  # not read as an untagged answer (the 3) either
        env = ConverterEnv(tool_format="json", accept_untagged_answer=accept)
        env.reset(seed=0)
        obs, *_, info = env.step("CONVERT[3, km, mi]")
        assert info["step_errors"] == ["malformed_call"] and "<tool_call>" in obs and '"name": "convert"' in obs


# ---- async tools, state, tool rewards ----------------------------------------------------------


class AsyncEnv(ToolEnv):
    def __init__(self, **knobs):
        super().__init__(instructions="Wait.", tool_format="json", **knobs)

    @tool(timeout_s=0.2)
    async def wait(self, seconds: float) -> str:
        """Sleep, then say so."""
        await asyncio.sleep(seconds)
        self.state["waited"] += seconds
        return f"waited {seconds}"

    @tool
    def find(self, word: str) -> ToolResult:
        """Look for a word; finding it earns a reward."""
        found = word in self.state["words"]
        return ToolResult({"found": found, "word": word}, rewards={"found": 0.25} if found else {})

    def new_task(self):
        return Task("Wait a bit.", 0, state={"waited": 0.0, "words": ["cat"]})


def test_async_tools_are_awaited_with_a_timeout():
    env = AsyncEnv()
    env.reset(seed=0)
    assert response(env.step(json_call("wait", seconds=0.01))[0]) == "waited 0.01"
    assert env.state["waited"] == 0.01
    start = time.perf_counter()
    obs, _reward, *_, info = env.step(json_call("wait", seconds=5))
    assert time.perf_counter() - start < 2
    assert response(obs) == "ERROR: wait timed out after 0.2 s" and info["step_errors"] == ["tool_timeout"]


def test_async_tools_work_inside_a_running_event_loop():
    async def main():
        env = AsyncEnv()
        env.reset(seed=0)
        return env.step(json_call("wait", seconds=0.01))[0]

    assert response(asyncio.run(main())) == "waited 0.01"


def test_structured_results_and_tool_rewards_reach_reward_components():
    env = AsyncEnv()
    env.reset(seed=0)
    obs, reward, *_, info = env.step(json_call("find", word="cat") + json_call("find", word="dog"))
    assert obs.split("\n</tool_response>\n<tool_response>\n") == [
        '<tool_response>\n{"found":true,"word":"cat"}',
        '{"found":false,"word":"dog"}\n</tool_response>',
    ]
    assert info["reward_components"]["found"] == 0.25
    assert reward == pytest.approx(0.25 - 2 * 0.1)  # the solution needs no calls: both are over budget
    assert sum(info["reward_components"].values()) == pytest.approx(reward)


# ---- graders, answer tools, final state, success --------------------------------------------------


def test_graders():
    task = Task("q", 2.5)
    assert numeric(abs_tol=0.1)("2.55", task, None) == 1.0 and numeric()("2.55", task, None) == 0.0
    assert numeric(rel_tol=0.1)(2.7, task, None) == 1.0 and numeric()(True, task, None) == 0.0
    assert text()("  NEW   york", Task("q", "new york"), None) == 1.0
    assert exact()('[1, "a"]', Task("q", [1, "a"]), None) == 1.0
    assert exact()("true", Task("q", True), None) == 1.0 and exact()("1", Task("q", True), None) == 0.0
    assert exact()('{"b": 2, "a": 1}', Task("q", {"a": 1, "b": 2}), None) == 1.0
    with pytest.raises(ValueError, match="rel_tol"):
        numeric(rel_tol=-1)


def test_numpy_answers_become_python_values_without_rounding():
    np = pytest.importorskip("numpy")
    assert Task("q", np.float64(1.864)).answer == 1.864 and type(Task("q", np.int64(3)).answer) is int


class Partial(ToolEnv):
    """A list answer graded by a user callable with partial credit and a named component."""

    def __init__(self, **knobs):
        super().__init__(
            instructions="List the primes below 10.", grader=self.grade, answer_tool="submit", **knobs
        )

    @staticmethod
    def grade(response, task, state):
        said = set(response) if isinstance(response, list) else set()
        right = len(said & set(task.answer)) / len(task.answer)
        return Grade(right, components={"wrong_items": -0.1 * len(said - set(task.answer))})

    def new_task(self):
        return Task("Primes below 10?", [2, 3, 5, 7])

    def success(self, grade, tagged):
        return grade is not None and grade.score >= 0.5


def test_a_user_grader_with_partial_credit_through_an_answer_tool():
    env = Partial(tool_format="json")
    env.reset(seed=0)
    assert "Finish by calling submit with the answer." in env.system_prompt
    final = env.oracle_actions()[-1]
    assert final == json_call("submit", answer=[2, 3, 5, 7])
    obs, reward, terminated, _, info = env.step(json_call("submit", answer=[2, 3, 4]))
    assert obs == "PARTLY CORRECT (score 0.50; answer: [2,3,5,7])" and terminated
    assert info["reward_components"]["wrong_items"] == pytest.approx(-0.1)
    assert info["metrics"]["accuracy"] == 0.5 and info["metrics"]["success"] == 1.0
    assert reward == pytest.approx(0.5 + 0.2 - 0.1) and info["tool_calls"] == 0  # answering is no tool call
    env.reset(seed=0)
    obs, *_, info = env.step(final)
    assert obs == "CORRECT" and info["failure_mode"] == "success"
    # The tag is not this env's answer format: graded without format credit.
    env.reset(seed=0)
    *_, info = env.step("[ANSWER] [2, 3, 5, 7]")
    assert info["reward_components"]["format"] == 0.0 and info["metrics"]["tag_rate"] == 0.0


class Dates(ToolEnv):
    """A plain callable grader (no `read`) that says "no answer at all" by raising Unreadable."""

    def __init__(self, **knobs):
        super().__init__(instructions="Give the date.", grader=self.grade, **knobs)

    @staticmethod
    def grade(response, task, state):
        if not isinstance(response, str) or response.count("-") != 2:
            raise Unreadable("expected a date like 2026-11-28")
        return response.strip() == task.answer

    def new_task(self):
        return Task("What day is it?", "2026-11-28", needed_tool_calls=0)


def test_a_plain_grader_raising_unreadable_is_a_malformed_answer_not_an_env_error():
    env = Dates()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("[ANSWER] tomorrow")
    assert not (terminated or truncated) and "malformed answer (expected a date like 2026-11-28)" in obs
    assert info["step_errors"] == ["malformed_answer"] and reward < 0
    obs, _, terminated, _, info = env.step("[ANSWER] 2026-11-28")
    assert terminated and obs == "CORRECT" and info["failure_mode"] == "success"


def test_an_answer_tool_in_the_bracket_format():
    env = ConverterEnv(answer_tool="submit", max_tool_calls=1)
    env.reset(seed=0)
    assert env.oracle_actions() == ["CONVERT[3, km, mi]", "SUBMIT[1.864]"]
    env.step("CONVERT[3, km, mi]")
    obs, *_, info = env.step("SUBMIT[ten]")
    assert obs == "SUBMIT[ten] = ERROR: malformed answer (expected a number, got 'ten')."
    obs, _reward, terminated, _, info = env.step(
        "SUBMIT[1.864]"
    )  # the call budget is spent; answering is not a call
    assert (obs, terminated, info["failure_mode"]) == ("CORRECT", True, "success")


class Moved(ToolEnv):
    """Success is the final state (the flag set), whatever is answered."""

    def __init__(self, **knobs):
        super().__init__(instructions="Flip the flag.", **knobs)

    @tool
    def flip(self) -> str:
        """Flip the flag."""
        self.state["on"] = not self.state["on"]
        return "flipped"

    def new_task(self):
        return Task("Turn it on, then answer 1.", 1, [Call("flip")], state={"on": False})

    def final_reward(self, grade):
        return {"on": 1.0 if self.state["on"] else 0.0}

    def success(self, grade, tagged):
        return self.state["on"]


def test_final_reward_and_success_whichever_way_the_episode_ends():
    env = Moved(max_turns=2)
    env.reset(seed=0)
    env.step("FLIP[]")
    _obs, _reward, _terminated, truncated, info = env.step("nothing")  # the turn limit ends it, unanswered
    assert truncated and info["reward_components"]["on"] == 1.0 and info["failure_mode"] == "success"
    assert info["metrics"]["success"] == 1.0 and info["metrics"]["accuracy"] == 0.0
    env.reset(seed=0)
    obs, reward, _terminated, *_, info = env.step("[ANSWER] 1")  # right answer, goal not met
    assert obs == "CORRECT" and info["failure_mode"] == "goal_not_met" and info["metrics"]["success"] == 0.0
    assert reward == pytest.approx(1.2) and info["reward_components"]["on"] == 0.0
    env.reset(seed=0)
    env.step("FLIP[]")
    extra, info = env.abandon()
    assert extra == 1.0 and info["reward_components"]["on"] == 1.0


# ---- tool definitions ---------------------------------------------------------------------------


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Event(msgspec.Struct):
    title: str
    day: int


def test_schemas_from_type_hints():
    def book(
        event: Event, color: Color, guests: list[str], note: str | None = None, urgent: bool = False
    ) -> dict:
        """Book an event.

        Args:
            event: what and when.
            guests: who comes.
        """
        return {"booked": event.title, "color": color.value, "guests": len(guests), "urgent": urgent}

    t = Tool.from_function(book)
    assert t.spec["function"]["name"] == "book" and t.description == "Book an event."
    params = t.parameters
    assert params["required"] == ["event", "color", "guests"] and params["additionalProperties"] is False
    assert params["properties"]["guests"] == {
        "type": "array",
        "items": {"type": "string"},
        "description": "who comes.",
    }
    assert params["properties"]["event"]["description"] == "what and when."
    assert params["$defs"]["Event"]["properties"]["day"] == {"type": "integer"}
    result = t({"event": {"title": "x", "day": 3}, "color": "red", "guests": ["a", "b"]})
    assert result.content == {"booked": "x", "color": "red", "guests": 2, "urgent": False}


def test_tool_definitions_that_cannot_work_are_refused_when_defined():
    def untyped(x):
        """No hints."""

    def star(*args: int):
        """Varargs."""

    def nodoc(x: int):
        pass

    with pytest.raises(TypeError, match="needs a type hint"):
        Tool.from_function(untyped)
    with pytest.raises(TypeError, match=r"\*args"):
        Tool.from_function(star)
    with pytest.raises(ValueError, match="docstring"):
        Tool.from_function(nodoc)
    with pytest.raises(ValueError, match="timeout_s"):
        Tool.from_function(convert, timeout_s=0)


def test_a_tool_error_is_an_observation_and_other_exceptions_are_env_errors():
    def picky(n: int) -> int:
        """Only small numbers."""
        if n > 9:
            raise ToolError("too big")
        if n < 0:
            raise KeyError("bug")
        return n

    class Env(ToolEnv):
        def __init__(self):
            super().__init__(tools=[picky], instructions="x")

        def new_task(self):
            return Task("q", 1)

    env = Env()
    env.reset(seed=0)
    assert env.step("PICKY[12]")[0] == "PICKY[12] = too big"
    with pytest.raises(ToolCrashError) as crashed:
        env.step("PICKY[-1]")
    assert isinstance(crashed.value.__cause__, KeyError)


def test_a_solution_that_holds_the_answer_is_refused_with_a_hint():
    class Env(ToolEnv):
        def __init__(self):
            super().__init__(instructions="x")

        def new_task(self):
            return Task("q", 3, ("[ANSWER] 3",))

    with pytest.raises(ValueError, match="leave it out: the env adds the answer"):
        Env().reset(seed=0)


def test_bracket_arguments_by_name_and_an_empty_required_argument():
    env = ConverterEnv(max_turns=10)
    env.reset(seed=0)
    by_position, *_ = env.step("CONVERT[3, km, mi]")
    by_name, *_ = env.step("CONVERT[value=3, source=km, target=mi]")
    assert by_position.split(" = ")[1] == by_name.split(" = ")[1] and "ERROR" not in by_name
    shuffled, *_ = env.step("CONVERT[target=mi, value=3, source=km]")
    assert shuffled.split(" = ")[1] == by_name.split(" = ")[1]
    empty, *_, info = env.step("CONVERT[]")
    assert "ERROR: CONVERT needs value" in empty and info["step_errors"] == ["bad_arguments"]


def test_a_fenced_argument_is_taken_verbatim_and_the_oracle_fences_what_needs_it():
    """Outside a fence one pair of quotes around the argument is stripped (`LOOKUP['apple']`);
    inside, the text is the argument as written (less the whitespace around it)."""

    def echo(text: str) -> str:
        """Echo the text."""
        return text

    class Env(ToolEnv):
        def __init__(self):
            super().__init__(tools=[echo], instructions="x", max_turns=10)

        def new_task(self):
            return Task("q", 1, [Call("echo", {"text": "'a' + ']'\nb"})])

    env = Env()
    env.reset(seed=0)
    assert env.step("ECHO['a' + 'b']")[4]["tool_results"] == ["a' + 'b"]
    assert env.step("ECHO[```'a' + 'b'```]")[4]["tool_results"] == ["'a' + 'b'"]
    (call, _) = env.oracle_actions()
    assert call == "ECHO[```'a' + ']'\nb```]"
    assert env.step(call)[4]["tool_results"] == ["'a' + ']'\nb"]


class Counter(ToolEnv):
    """A tool with a bug: `count` reads a key its state does not have (KeyError: 'cnts')."""

    def __init__(self, **knobs):
        super().__init__(instructions="Count.", **knobs)
        self.counts = {"counts": {}}

    @tool
    def count(self, word: str) -> int:
        """Count a word."""
        return self.counts["cnts"].get(word, 0)

    def new_task(self):
        return Task("How often?", 0, [Call("count", {"word": "apple"})])


def test_a_tool_that_raises_names_the_tool_and_the_call_with_its_traceback_and_logs_one_line(
    caplog, monkeypatch
):
    """It used to end the episode as "KeyError: 'cnts'": no tool, no call, no traceback."""
    monkeypatch.setattr(typed, "_LOGGED_CRASHES", set())
    env = Counter()
    env.reset(seed=0)
    with caplog.at_level("WARNING"), pytest.raises(ToolCrashError) as crashed:
        env.step("COUNT[apple]")
    text = str(crashed.value)
    first, *rest = text.splitlines()
    assert first == "tool count raised KeyError: 'cnts' on the call count(word='apple')"
    assert rest[0] == "Traceback (most recent call last):" and 'return self.counts["cnts"]' in text
    assert rest[-1] == "KeyError: 'cnts'"
    (record,) = caplog.records
    assert "\n" not in record.getMessage() and record.getMessage().startswith(first)
    again = Counter()
    again.reset(seed=1)
    with caplog.at_level("WARNING"), pytest.raises(ToolCrashError):
        again.step("COUNT[pear]")
    assert len(caplog.records) == 1  # the same bug again: logged once


def test_a_tool_crash_reaches_the_trajectory_with_its_traceback():
    if "crashy/Counter-v0" not in gymnasium.registry:
        gymnasium.register(id="crashy/Counter-v0", entry_point=Counter)
    (trajectory,) = play("crashy/Counter-v0", seeds=[0], group_size=1)
    assert trajectory.stop_reason.value == "env_error"
    error = trajectory.error or ""
    assert error.startswith("ToolCrashError: tool count raised KeyError: 'cnts' on the call count(word='apple')\n")
    assert "Traceback (most recent call last):" in error and error.endswith("KeyError: 'cnts'")
    assert trajectory.transitions[-1].info["error"] == error


@pytest.mark.parametrize(
    ("value", "shown", "said"),
    [
        ({"b", "a"}, None, "returned a set"),
        ({"tags": frozenset({1})}, '{"tags":[1]}', "returned a frozenset"),
        (b"\x00\x01", '"AAE="', "returned bytes"),
        ([1.0, float("nan")], "[1.0,null]", "returned a non-finite float"),
    ],
)
def test_a_result_the_observation_cannot_show_faithfully_warns_once_naming_the_tool(
    value, shown, said, monkeypatch
):
    monkeypatch.setattr(typed, "_WARNED_RESULTS", set())

    def odd(x: str):
        """Return an odd value."""
        return value

    class Env(ToolEnv):
        def __init__(self):
            super().__init__(tools=[odd], instructions="x", max_turns=10)

        def new_task(self):
            return Task("q", 1)

    env = Env()
    env.reset(seed=0)
    with pytest.warns(RuntimeWarning, match=f"tool odd {said}") as warned:
        observation = env.step("ODD[a]")[0]
    assert len(warned) == 1 and "observation shows it as" in str(warned[0].message)
    if shown is not None:
        assert observation == f"ODD[a] = {shown}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env.step("ODD[b]")  # once per tool and type
