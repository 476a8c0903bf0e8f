"""ToolEnv's documented policy: error observations, penalties, limits, grading and the info contract."""

import json

import pytest

from toolgym.envs import Call, Task, Tool, ToolEnv, ToolError, ZorplexEnv
from toolgym.envs.tools.typed import ToolCrashError

INFO_KEYS = {
    "reward_components",
    "tool_calls",
    "errors",
    "consecutive_errors",
    "turn",
    "step_errors",
    "metrics",
}
FINAL_KEYS = INFO_KEYS | {"failure_mode", "end_reason", "error_counts"}
NO_CALL = "ERROR: no tool call and no answer. Call a tool or finish with [ANSWER] <number>."
EMPTY = "ERROR: empty action. Call a tool or finish with [ANSWER] <number>."
BAD_CALL = "ERROR: malformed tool call. Write it like LOOKUP[word]."
UNBALANCED = (
    "ERROR: malformed tool call (unbalanced '[' at column 7: brackets inside an argument must pair up; "
    "fence any other text: LOOKUP[```...```]). Write it like LOOKUP[word]."
)
BAD_ANSWER = "ERROR: malformed answer (expected a number, got '{}'). Finish with [ANSWER] <number>."


def zorplex(**kwargs):
    env = ZorplexEnv(**kwargs)
    env.reset(seed=0)
    return env


@pytest.mark.parametrize(
    ("action", "observation", "kind"),
    [
        ("", EMPTY, "empty_action"),
        (" \n\t ", EMPTY, "empty_action"),
        ("I am not sure what to do.", NO_CALL, "no_call_no_answer"),
        ("\x00\x01\ufffd\U0001f600 binary junk", NO_CALL, "no_call_no_answer"),
        ("LOOKUP[", BAD_CALL, "malformed_call"),
        ("LOOKUP[apple", BAD_CALL, "malformed_call"),
        ("LOOKUP [apple]", BAD_CALL, "malformed_call"),
        ("lookup(apple)", BAD_CALL, "malformed_call"),
        ("LOOKUP[[apple", UNBALANCED, "malformed_call"),
        ("[ANSWER]", BAD_ANSWER.format(""), "malformed_answer"),
        ("[ANSWER] -", BAD_ANSWER.format("-"), "malformed_answer"),
        ("[answer] forty-two", BAD_ANSWER.format("forty-two"), "malformed_answer"),
        ("SEARCH[apple]", "SEARCH[apple] = UNKNOWN_TOOL", "unknown_tool"),
        ("LOOKUP[]", "LOOKUP[] = EMPTY_ARGUMENT", "empty_argument"),
        ("LOOKUP['  ']", "LOOKUP[] = EMPTY_ARGUMENT", "empty_argument"),
    ],
)
def test_bad_action_gets_error_observation_counter_and_penalty(action, observation, kind):
    env = zorplex()
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs == observation
    assert info["step_errors"] == [kind]
    assert (info["errors"], info["consecutive_errors"], info["turn"]) == (1, 1, 1)
    assert reward == pytest.approx(-0.1)
    assert info["reward_components"]["error_penalty"] == pytest.approx(-0.1)
    assert not terminated and not truncated


def test_a_call_with_the_argument_answer_is_a_call():
    env = zorplex()
    obs, reward, terminated, truncated, info = env.step("LOOKUP[answer]")
    assert obs == "LOOKUP[answer] = UNKNOWN"
    assert info["step_errors"] == [] and info["tool_calls"] == 1 and reward == 0.0
    assert not terminated and not truncated


def test_balanced_brackets_inside_an_argument_are_part_of_it():
    """The bracket grammar's rule (DESIGN): `LOOKUP[[apple]]` looks up `[apple]`, not a malformed call."""
    env = zorplex()
    obs, reward, *_, info = env.step("LOOKUP[[apple]]")
    assert obs == "LOOKUP[[apple]] = UNKNOWN" and info["step_errors"] == [] and info["tool_calls"] == 1
    assert reward == 0.0


def test_unknown_tool_costs_a_call_and_an_error():
    env = zorplex()
    env.step("LOOKUP[apple]")  # the one needed call
    _, reward, *_, info = env.step("SEARCH[apple]")
    assert reward == pytest.approx(-0.2)  # beyond the needed call (-0.1) and an error (-0.1)
    assert info["tool_calls"] == 2 and info["errors"] == 1


def test_error_streak_truncates_with_parse_error():
    env = zorplex()
    for turn, action in enumerate(["LOOKUP[", "hello", "[ANSWER]"], start=1):
        obs, _, terminated, truncated, info = env.step(action)
        assert info["consecutive_errors"] == turn
    assert truncated and not terminated
    assert obs == BAD_ANSWER.format("") + "\nSTOP: too many errors in a row."
    assert info["end_reason"] == "parse_error" and info["failure_mode"] == "no_answer"
    assert info["error_counts"] == {"malformed_call": 1, "no_call_no_answer": 1, "malformed_answer": 1}
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("LOOKUP[apple]")


def test_no_call_streak_ends_with_no_tool_call():
    env = zorplex()
    results = [env.step(action) for action in ["hi", "", "thinking..."]]
    assert results[-1][3] and results[-1][4]["end_reason"] == "no_tool_call"


def test_a_tool_that_runs_resets_the_streak():
    env = zorplex(max_consecutive_errors=2)
    env.step("hello")
    _, _, _, _, info = env.step("LOOKUP[apple] SEARCH[x]")
    assert info["consecutive_errors"] == 0 and info["errors"] == 2
    _, _, _, truncated, info = env.step("hello")
    assert not truncated and info["consecutive_errors"] == 1


def test_streak_limit_can_be_disabled():
    env = zorplex(max_consecutive_errors=None, max_turns=6)
    for _ in range(5):
        assert not env.step("hello")[3]
    *_, truncated, info = env.step("hello")
    assert truncated and info["end_reason"] == "max_turns" and info["errors"] == 6


def test_max_turns_truncates_without_an_answer():
    env = zorplex(max_turns=3, incorrect_reward=-1.0)
    rewards = [env.step("LOOKUP[apple]")[1] for _ in range(2)]
    obs, reward, terminated, truncated, info = env.step("LOOKUP[cat]")
    assert (terminated, truncated) == (False, True)
    assert obs.endswith("\nSTOP: turn limit reached.")
    assert info["end_reason"] == "max_turns" and info["failure_mode"] == "no_answer"
    assert reward == pytest.approx(-0.1 - 1.0)  # an extra call, and incorrect_reward at the end
    assert sum([*rewards, reward]) == pytest.approx(sum(info["reward_components"].values()))


def test_abandon_settles_like_the_env_s_own_turn_limit():
    actions = ["LOOKUP[apple]", "hello", "LOOKUP[cat]"]
    limited = zorplex(max_turns=3, incorrect_reward=-1.0)
    own = [limited.step(action) for action in actions]
    cut = zorplex(max_turns=5, incorrect_reward=-1.0)  # a caller stops it after the same actions
    steps = [cut.step(action) for action in actions]
    reward, info = cut.abandon()
    assert reward == -1.0
    assert [r for _, r, *_ in steps[:-1]] + [steps[-1][1] + reward] == [r for _, r, *_ in own]
    assert info["reward_components"] == own[-1][4]["reward_components"]
    assert info["reward_components"]["correct"] == -1.0
    assert sum(r for _, r, *_ in steps) + reward == pytest.approx(sum(info["reward_components"].values()))
    assert info["failure_mode"] == "no_answer" and info["error_counts"] == {"no_call_no_answer": 1}
    assert (info["tool_calls"], info["errors"], info["turn"]) == (2, 1, 3)
    assert "end_reason" not in info and "step_errors" not in info  # the caller knows why it stopped
    json.dumps(info)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        cut.step("LOOKUP[apple]")
    with pytest.raises(RuntimeError, match="abandon\\(\\) called after the episode ended"):
        cut.abandon()
    with pytest.raises(RuntimeError, match="abandon\\(\\) called after the episode ended"):
        limited.abandon()  # the env ended it itself: nothing left to settle
    with pytest.raises(RuntimeError, match="call reset"):
        ZorplexEnv().abandon()


def test_abandon_before_any_step_settles_the_whole_episode():
    env = zorplex(incorrect_reward=-0.5)
    reward, info = env.abandon()
    assert reward == -0.5 and info["reward_components"]["correct"] == -0.5 and info["turn"] == 0


def test_tool_budget_truncates_as_tool_spam():
    env = zorplex(max_tool_calls=3)
    env.step("LOOKUP[apple]")
    obs, reward, terminated, truncated, info = env.step("LOOKUP[cat] LOOKUP[dog] LOOKUP[sun]")
    assert obs.splitlines()[-1] == "STOP: tool call limit reached."
    assert len(obs.splitlines()) == 3  # two calls ran, the third was over the budget
    assert (terminated, truncated) == (False, True)
    assert info["tool_calls"] == 3 and info["failure_mode"] == "tool_spam"
    assert info["end_reason"] == "max_turns"
    assert reward == pytest.approx(-0.2)


def test_answer_terminates_and_ignores_calls_in_the_same_action():
    env = zorplex()
    obs, reward, terminated, truncated, info = env.step(f"LOOKUP[cat] [ANSWER] {env.answer}\nLOOKUP[dog]")
    assert (obs, reward, terminated, truncated) == ("CORRECT", pytest.approx(1.2), True, False)
    assert info["tool_calls"] == 0 and info["graded_answer"] == env.answer


@pytest.mark.parametrize(
    ("template", "reward", "failure_mode"),
    [
        ("[ANSWER] {a}", 1.2, "success"),
        ("[answer]: {a}", 1.2, "success"),
        ("[ ANSWER ]={a}.", 1.2, "success"),
        ("[ANSWER] {a} [ANSWER] 0", 1.2, "success"),  # the first tag counts
        ("[ANSWER] 0 [ANSWER] {a}", 0.2, "wrong_answer"),
        ("[ANSWER] {wrong}", 0.2, "wrong_answer"),
        ("[ANSWER] -{a}", 0.2, "wrong_answer"),
        ("[ANSWER] 000{a}", 1.2, "success"),
        ("[ANSWER] 1234567890123456789012345", 0.2, "wrong_answer"),
        ("The answer is {a}.", 1.0, "wrong_format"),
        ("I think 7, no wait: {a}", 1.0, "wrong_format"),  # the last integer counts
        ("It is {wrong}.", 0.0, "wrong_answer"),
    ],
)
def test_grading(template, reward, failure_mode):
    env = zorplex()
    action = template.format(a=env.answer, wrong=env.answer + 1)
    obs, got, terminated, _, info = env.step(action)
    assert terminated and info["end_reason"] == "answered"
    assert got == pytest.approx(reward) and info["failure_mode"] == failure_mode
    assert obs == (
        "CORRECT" if failure_mode in ("success", "wrong_format") else f"INCORRECT (answer: {env.answer})"
    )


def test_negative_answers_are_graded():
    env = ZorplexEnv(tier="compositional", difficulty="medium")
    for seed in range(100):
        env.reset(seed=seed)
        if env.answer < 0:
            break
    assert env.answer < 0
    assert env.step(f"[ANSWER] {env.answer}")[4]["failure_mode"] == "success"


def test_untagged_answers_can_be_refused():
    env = zorplex(accept_untagged_answer=False)
    obs, _reward, terminated, _, info = env.step(f"The answer is {env.answer}.")
    assert obs == NO_CALL and not terminated and info["step_errors"] == ["no_call_no_answer"]


def test_huge_and_odd_actions_never_raise():
    env = zorplex(max_consecutive_errors=None, max_turns=5)
    obs, *_, _info = env.step("x" * 1_000_000 + f"[ANSWER] {env.answer}")  # tag beyond the parse cap
    assert obs == NO_CALL
    obs, *_ = env.step("LOOKUP[" + "a" * 5000 + "]")  # never closed within the cap
    assert obs == BAD_CALL
    obs, *_ = env.step("LOOKUP[" + "a" * 100 + "]")  # echoed arguments are shortened
    assert obs == "LOOKUP[" + "a" * 37 + "...] = UNKNOWN"
    obs, *_ = env.step(b"\xff\xfeLOOKUP[apple]")  # bytes are decoded, invalid bytes replaced
    assert obs == f"LOOKUP[apple] = {env.table['apple']}"
    with pytest.raises(TypeError, match="action must be a str"):
        env.step(42)


def test_step_before_reset_is_a_clear_error():
    with pytest.raises(RuntimeError, match="call reset"):
        ZorplexEnv().step("LOOKUP[apple]")
    with pytest.raises(RuntimeError, match="call reset"):
        ZorplexEnv().oracle_actions()


def test_info_contract_and_reward_bookkeeping():
    env = ZorplexEnv(tier="compositional", difficulty="hard")
    _question, info = env.reset(seed=4)
    # a bracket env's tools are in its system prompt; no template gets a JSON tools block for them
    assert set(info) == {"system_prompt", "question", "answer", "needed_tool_calls", "max_turns"}
    assert "LOOKUP[word]: the zorplex value of a word" in info["system_prompt"]
    _question, info = ZorplexEnv(tier="compositional", difficulty="hard", tool_format="json").reset(seed=4)
    assert set(info) == {
        "system_prompt",
        "instructions",
        "tools",
        "question",
        "answer",
        "needed_tool_calls",
        "max_turns",
    }
    assert [t["function"]["name"] for t in info["tools"]] == ["LOOKUP"]
    instructions = info["instructions"].splitlines()  # the system prompt without its tools block
    assert instructions[:2] == [info["system_prompt"].splitlines()[0], "Finish with [ANSWER] <number>."]
    assert "LOOKUP[word]: the zorplex value of a word" not in instructions and "Example:" in instructions
    actions = ["LOOKUP[cat] FOO[x]", "", "LOOKUP[", "LOOKUP[dog]", "[ANSWER] 3"]
    total = 0.0
    for action in actions:
        _obs, reward, terminated, truncated, info = env.step(action)
        total += reward
        calls = {"tool_results"} if action.startswith("LOOKUP[") and action != "LOOKUP[" else set()
        assert set(info) == (FINAL_KEYS | {"graded_answer"} if terminated else INFO_KEYS | calls)
        if calls:
            assert len(info["tool_results"]) == action.count("[")
        assert set(info["reward_components"]) == {"correct", "format", "tool_penalty", "error_penalty"}
        assert total == pytest.approx(sum(info["reward_components"].values()))
        json.dumps(info)
        if terminated or truncated:
            break
    assert info["errors"] == 3 and info["tool_calls"] == 3 and info["turn"] == 5


class Echo(ToolEnv):
    """A ToolEnv with tools that reject arguments, to test ToolError handling."""

    def __init__(self, **knobs):
        tools = [
            Tool("NUM", "parses an integer", lambda s: str(int(s)), arg="n"),
            Tool("STRICT", "only takes 'ok'", self.strict),
            Tool("BROKEN", "a buggy tool", lambda s: 1 / 0),
        ]
        super().__init__(tools=tools, instructions="Test env.", **knobs)

    def strict(self, arg):
        if arg != "ok":
            raise ToolError("NOT_OK")
        return "fine"

    def new_task(self):
        return Task("Say 1.", 1, ("NUM[1]",))


def test_tool_errors_become_error_observations():
    env = Echo()
    env.reset(seed=0)
    obs, _reward, *_, info = env.step("NUM[x] STRICT[no] STRICT[ok]")
    assert obs.splitlines()[1:] == ["STRICT[no] = NOT_OK", "STRICT[ok] = fine"]
    assert obs.splitlines()[0].startswith("NUM[x] = invalid literal for int()")
    assert info["step_errors"] == ["tool_error", "tool_error"] and info["consecutive_errors"] == 0
    with pytest.raises(ToolCrashError, match="tool BROKEN raised ZeroDivisionError") as crashed:
        env.step("BROKEN[x]")  # a bug in a tool is not the policy's fault: an env error naming it
    assert isinstance(crashed.value.__cause__, ZeroDivisionError)


def test_tool_and_task_validation():
    with pytest.raises(ValueError, match="identifier"):
        Tool("LOOK UP", "x", str)
    with pytest.raises(ValueError, match="reserved"):
        Tool("answer", "x", str)
    with pytest.raises(ValueError, match="one non-empty line"):
        Tool("A", "two\nlines", str)
    with pytest.raises(TypeError, match="solution steps"):
        Task("q", 3, (42,))
    with pytest.raises(TypeError, match="JSON value"):
        Task("q", object())
    with pytest.raises(ValueError, match="finite"):
        Task("q", float("nan"))
    assert Task("q", 3, ("A[x]", [Call("B", {}), Call("C", {})])).needed_tool_calls == 3
    with pytest.raises(ValueError, match="two tools are named"):
        ToolEnv(tools=[Tool("A", "x", str), Tool("a", "y", str)], instructions="x")


def test_metrics_and_oracle_methods():
    env = zorplex(tier="simple")
    assert env.step("LOOKUP[apple]")[4]["metrics"] == {
        "accuracy": 0.0, "tag_rate": 0.0, "success": 0.0, "tool_calls": 1.0, "env_errors": 0.0,
    }  # fmt: skip
    assert env.step(f"The answer is {env.answer}.")[4]["metrics"]["accuracy"] == 1.0
    env.reset(seed=1)
    final = env.step(env.oracle_actions()[-1])[4]["metrics"]
    assert final["success"] == final["tag_rate"] == final["accuracy"] == 1.0
    assert env.answer_action(7) == env.oracle_actions()[-1].replace(str(env.answer), "7")
    assert env.answer_action(7, tagged=False) == "The answer is 7."
    assert env.malformed_action("LOOKUP[cat]") == "LOOKUP(cat)" and env.malformed_action("hi") is None
    assert "" in env.mistaken_actions() and len(env.mistaken_actions()) == 7
