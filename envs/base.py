"""Text environments: `TextEnv` (the Gymnasium interface) and `ToolEnv` (tools, grading, limits).

A new tool environment subclasses `ToolEnv`, passes its tools and a prompt to `__init__`, and
implements `new_task()`; see tests/envs/test_envs_custom_example.py for a 30-line one.

How `ToolEnv.step` treats an action (the grammar is in tools.py):

- `[ANSWER] <int>` anywhere: the answer is graded and the episode terminates. Tool calls in the
  same action are ignored. Without the tag, an action that has no tool call but states an integer
  ("The answer is 42.") is graded too (`accept_untagged_answer`): correct credit, no format
  credit, failure_mode `wrong_format` when right.
- Tool calls: every call in the action is handled IN ORDER and each counts toward
  `max_tool_calls`; the observation has one line per call, `NAME[arg] = result`. The call that
  would exceed `max_tool_calls` is not run: the episode is truncated (failure_mode `tool_spam`).
- Errors (each is a line in the observation, one count in info `errors`, and costs
  `error_penalty` at the step it happens):
    unknown_tool      `NAME[arg] = UNKNOWN_TOOL`
    empty_argument    `NAME[] = EMPTY_ARGUMENT`
    tool_error        `NAME[arg] = <message>` (the tool raised ToolError/ValueError)
    malformed_call    `ERROR: malformed tool call. ...` (`LOOKUP[`, `LOOKUP (x)`)
    malformed_answer  `ERROR: [ANSWER] must be followed by an integer, ...`
    no_call_no_answer `ERROR: no tool call and no answer. ...`
    empty_action      `ERROR: empty action. ...`
  An action that runs no tool but has an error extends the error streak (info
  `consecutive_errors`); at `max_consecutive_errors` the episode is truncated.
- Limits end the episode in this order: tool budget, error streak, `max_turns`. When the episode
  ends without an answer, `incorrect_reward` is added to the `correct` component.
- Rewards: `correct_reward` if right, `format_reward` if tagged (right or wrong),
  `incorrect_reward` if neither; `-tool_call_penalty` per call beyond the task's
  `needed_tool_calls`; `-error_penalty` per error. Each lands at the step it happens, so the sum
  of step rewards equals the sum of info `reward_components`.

Episodes the caller stops (the optional `abandon()` protocol): a runner that ends an episode the
env has not ended, for a limit of its own (a token or context budget, its own turn limit), calls
`env.unwrapped.abandon() -> (reward, info)` if the env has it. `ToolEnv.abandon` settles the
episode as unanswered, exactly like the env's own limits: `incorrect_reward` is added to the
`correct` component and returned as the reward (the caller adds it to the episode's last step,
so the sum of rewards still equals the sum of `reward_components`); info has the final
`reward_components`, the counters, failure_mode `no_answer` and `error_counts`, and no
end_reason (the caller knows why it stopped); the episode is over (step() raises). So an
unanswered episode scores the same whichever limit ends it. Envs without the method (plain
Gymnasium envs) are simply not settled. Not meant for infrastructure failures (an env error or
a timeout): those episodes are not trained on.

Metrics (info `metrics`, every step; the generic contract is envs/info.py): `accuracy` (1.0 once
the graded answer is right, tagged or not), `tag_rate` (1.0 once the graded answer carried the
`[ANSWER]` tag, right or wrong), `success` (both), `tool_calls` and `env_errors` (the counts so
far). An unanswered episode keeps accuracy, tag_rate and success at 0.

Final-step info adds `failure_mode` (success, wrong_format, wrong_answer, tool_spam, no_answer),
`end_reason` and `error_counts`. end_reason is `answered` (an answer was graded), `max_turns`
(turn or tool budget), `parse_error` (error streak with a malformed action in it) or
`no_tool_call` (error streak of actions with neither a call nor an answer, or a single-turn env
whose one action had neither). A single-turn env (`max_turns=1`) always TERMINATES after its one
step: that step is the whole episode, not a cut-short one.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium

from .info import REPLACED_CHARS
from .spaces import UnicodeText
from .tools import (
    ANSWER,
    BAD_ANSWER,
    BAD_CALL,
    CALLS,
    EMPTY,
    MISTAKEN_ACTIONS,
    NOTHING,
    UNTAGGED,
    Task,
    Tool,
    ToolError,
    answer_action,
    clean_argument,
    malformed_call,
    near_miss_pattern,
    parse_action,
)

_SHOWN_ARG_CHARS = 40  # arguments echoed in observations are cut to this (observations stay short)
_SHOWN_NAME_CHARS = 24
_ERROR_KINDS = {
    EMPTY: "empty_action",
    NOTHING: "no_call_no_answer",
    BAD_CALL: "malformed_call",
    BAD_ANSWER: "malformed_answer",
}


_SURROGATE = re.compile("[\ud800-\udfff]")


def encodable_text(text: str) -> tuple[str, int]:
    """`text` with every surrogate code point (which UTF-8 cannot encode, so no tokenizer or
    recording can take it) replaced by U+FFFD, and how many were replaced."""
    return _SURROGATE.subn("\ufffd", text)


def _encodable_reset(
    reset: Callable[..., tuple[Any, dict[str, Any]]],
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    @functools.wraps(reset)
    def wrapped(self: TextEnv, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        observation, info = reset(self, *args, **kwargs)
        if isinstance(observation, str):
            observation, replaced = encodable_text(observation)
            if replaced and isinstance(info, dict):
                info[REPLACED_CHARS] = info.get(REPLACED_CHARS, 0) + replaced
        return observation, info

    return wrapped


def _encodable_step(step: Callable[..., tuple[Any, ...]]) -> Callable[..., tuple[Any, ...]]:
    @functools.wraps(step)
    def wrapped(self: TextEnv, action: Any) -> tuple[Any, ...]:
        replaced = 0
        if isinstance(action, str):
            action, replaced = encodable_text(action)
        observation, reward, terminated, truncated, info = step(self, action)
        if isinstance(observation, str):
            observation, more = encodable_text(observation)
            replaced += more
        if replaced and isinstance(info, dict):  # an outer override's wrapper adds its own count
            info[REPLACED_CHARS] = info.get(REPLACED_CHARS, 0) + replaced
        return observation, reward, terminated, truncated, info

    return wrapped


class TextEnv(gymnasium.Env[str, str]):
    """A Gymnasium env whose observations and actions are Unicode strings.

    Subclasses provide `system_prompt`, `question`, `answer` (after `reset`) and the oracle:
    `oracle_actions()`, `malformed_action()`, `answer_action()` and `mistaken_actions()`, which
    the scripted policy (rollouts/scripted.py) and the tokenizer corpus (configs/build_tokenizer.py)
    use so that they know no env's action grammar. Randomness comes only from `self.np_random`
    (seeded by `reset(seed=...)`). The info keys the runner reads: envs/info.py.

    Only encodable text crosses the env boundary: every subclass's `step` and `reset` are wrapped
    (`__init_subclass__`) so that surrogate code points in the action (which a caller may pass,
    e.g. `"\\ud800LOOKUP[\\udfff]"`) and in the observation are replaced by U+FFFD before the env
    sees or returns them, counted in info `replaced_chars` (present only when > 0).
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (Gymnasium's class attribute)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "step" in cls.__dict__:
            cls.step = _encodable_step(cls.__dict__["step"])  # type: ignore[method-assign]
        if "reset" in cls.__dict__:
            cls.reset = _encodable_reset(cls.__dict__["reset"])  # type: ignore[method-assign]

    def __init__(self, *, max_action_chars: int = 4096, max_observation_chars: int = 8192):
        self.action_space = UnicodeText(max_action_chars)
        self.observation_space = UnicodeText(max_observation_chars)

    @property
    def system_prompt(self) -> str:
        raise NotImplementedError

    @property
    def question(self) -> str:
        raise NotImplementedError

    @property
    def answer(self) -> int:
        raise NotImplementedError

    def oracle_actions(self) -> list[str]:
        """The ideal actions for the current task; the last one states the final answer
        (`answer_action(self.answer)`)."""
        raise NotImplementedError

    def malformed_action(self, action: str) -> str | None:
        """A fumbled version of one of the oracle's non-final actions, which the env answers with
        an error observation (a recoverable mistake), or None when the action has none."""
        return None

    def answer_action(self, answer: int, tagged: bool = True) -> str:
        """The action that states `answer` as the final answer; `tagged=False`: stated without the
        env's answer format (graded for correctness, no format credit)."""
        raise NotImplementedError

    def mistaken_actions(self) -> tuple[str, ...]:
        """Actions with one typical mistake each (malformed, empty, unknown tool, no answer), so
        that corpora and tests can show the env's error observations."""
        return ()


def _check_count(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_magnitude(name: str, value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} is a magnitude (subtracted per occurrence): a float >= 0, got {value!r}")


class ToolEnv(TextEnv):
    """A text env with tools, `[ANSWER]` grading, and error/turn limits (see the module doc).

    Subclasses call `super().__init__(tools=..., instructions=..., example=..., **knobs)` and
    implement `new_task() -> Task`, drawing from `self.np_random` only.

    Knobs: max_turns, max_tool_calls, max_consecutive_errors (None: never), correct_reward,
    format_reward, incorrect_reward, tool_call_penalty, error_penalty, accept_untagged_answer,
    max_action_chars (the action space; longer actions are parsed up to this many characters),
    max_observation_chars.
    """

    def __init__(
        self,
        *,
        tools: Sequence[Tool] = (),
        instructions: str,
        example: str = "",
        max_turns: int = 5,
        max_tool_calls: int = 8,
        max_consecutive_errors: int | None = 3,
        correct_reward: float = 1.0,
        format_reward: float = 0.2,
        incorrect_reward: float = 0.0,
        tool_call_penalty: float = 0.1,
        error_penalty: float = 0.1,
        accept_untagged_answer: bool = True,
        max_action_chars: int = 4096,
        max_observation_chars: int = 8192,
        render_mode: str | None = None,
    ):
        super().__init__(max_action_chars=max_action_chars, max_observation_chars=max_observation_chars)
        if render_mode is not None:
            raise ValueError(f"{type(self).__name__} has no render modes, got render_mode={render_mode!r}")
        _check_count("max_turns", max_turns, 1)
        _check_count("max_tool_calls", max_tool_calls, 0)
        if max_consecutive_errors is not None:
            _check_count("max_consecutive_errors", max_consecutive_errors, 1)
        rewards = {"correct_reward": correct_reward, "format_reward": format_reward}
        for name, value in {**rewards, "incorrect_reward": incorrect_reward}.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"{name} must be a float, got {value!r}")
        _check_magnitude("tool_call_penalty", tool_call_penalty)
        _check_magnitude("error_penalty", error_penalty)
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if not isinstance(tool, Tool):
                raise TypeError(f"tools must be Tool instances, got {tool!r}")
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name}")
            self.tools[tool.name] = tool
        self.max_turns = max_turns
        self.max_tool_calls = max_tool_calls
        self.max_consecutive_errors = max_consecutive_errors
        self.correct_reward = float(correct_reward)
        self.format_reward = float(format_reward)
        self.incorrect_reward = float(incorrect_reward)
        self.tool_call_penalty = float(tool_call_penalty)
        self.error_penalty = float(error_penalty)
        self.accept_untagged_answer = bool(accept_untagged_answer)
        self._max_action_chars = max_action_chars
        self._max_observation_chars = max_observation_chars
        self._near_miss = near_miss_pattern(self.tools)
        self._system_prompt = self.build_system_prompt(instructions, example)

        first_usage = next(iter(self.tools.values())).usage if self.tools else "NAME[x]"
        hint = (
            "Call a tool or finish with [ANSWER] <number>."
            if self.tools
            else "Finish with [ANSWER] <number>."
        )
        nothing = "no tool call and no answer" if self.tools else "no answer"
        self._error_lines = {
            EMPTY: f"ERROR: empty action. {hint}",
            NOTHING: f"ERROR: {nothing}. {hint}",
            BAD_CALL: f"ERROR: malformed tool call. Write it like {first_usage}.",
            BAD_ANSWER: "ERROR: [ANSWER] must be followed by an integer, like [ANSWER] 42.",
        }
        self._task: Task | None = None
        self._graded: tuple[bool, bool] | None = None
        self._done = True

    # ---- what subclasses provide -------------------------------------------------------------

    def new_task(self) -> Task:
        """Draw this episode's task (and any per-episode tool state) from `self.np_random`."""
        raise NotImplementedError(f"{type(self).__name__} must implement new_task()")

    def build_system_prompt(self, instructions: str, example: str) -> str:
        lines = [instructions.strip()]
        if self.tools:
            lines.append("Tools:")
            lines += [f"{tool.usage}: {tool.description}" for tool in self.tools.values()]
            lines.append("Call one tool per turn and wait for its result. Finish with [ANSWER] <number>.")
        else:
            lines.append("Finish with [ANSWER] <number>.")
        if example:
            lines += ["Example:", example.strip()]
        return "\n".join(lines)

    # ---- the task ------------------------------------------------------------------------------

    def _current_task(self) -> Task:
        if self._task is None:
            raise RuntimeError(f"{type(self).__name__}: call reset() first; there is no task yet")
        return self._task

    @property
    def system_prompt(self) -> str:
        return self._system_prompt

    @property
    def question(self) -> str:
        return self._current_task().question

    @property
    def answer(self) -> int:
        return self._current_task().answer

    @property
    def needed_tool_calls(self) -> int:
        return self._current_task().needed_tool_calls

    def oracle_actions(self) -> list[str]:
        return list(self._current_task().oracle_actions)

    def malformed_action(self, action: str) -> str | None:
        """The action's first tool call with parentheses for brackets (`LOOKUP[cat]` ->
        `LOOKUP(cat)`: a malformed call), or None when it has no call."""
        return malformed_call(action)

    def answer_action(self, answer: int, tagged: bool = True) -> str:
        """`[ANSWER] <answer>`, or untagged `The answer is <answer>.` (correct credit only)."""
        return answer_action(answer, tagged)

    def mistaken_actions(self) -> tuple[str, ...]:
        return MISTAKEN_ACTIONS

    # ---- Gymnasium API -------------------------------------------------------------------------

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if options:
            raise ValueError(f"{type(self).__name__}.reset takes no options, got {sorted(options)}")
        task = self.new_task()
        if not isinstance(task, Task):
            raise TypeError(f"{type(self).__name__}.new_task() must return a Task, got {task!r}")
        if len(task.question) > self._max_observation_chars:
            raise ValueError(f"question is longer than max_observation_chars={self._max_observation_chars}")
        self._task = task
        self._done = False
        self._turn = 0
        self._tool_calls = 0
        self._errors = 0
        self._error_counts: dict[str, int] = {}
        self._consecutive_errors = 0
        self._consecutive_no_call = 0
        self._graded = None  # (right, tagged) once an answer is graded
        self._correct = 0.0
        self._format = 0.0
        self._tool_penalty = 0.0
        self._error_penalty = 0.0
        info = {
            "system_prompt": self._system_prompt,
            "question": task.question,
            "answer": task.answer,
            "needed_tool_calls": task.needed_tool_calls,
            "max_turns": self.max_turns,
        }
        return task.question, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            if self._task is None:
                raise RuntimeError(f"{type(self).__name__}: call reset() before step()")
            raise RuntimeError(
                f"{type(self).__name__}: step() called after the episode ended "
                "(terminated or truncated); call reset() to start a new one"
            )
        if type(action) is not str:
            if not isinstance(action, str | bytes | bytearray):
                raise TypeError(f"action must be a str, got {type(action).__name__}")
            action = action.decode("utf-8", "replace") if not isinstance(action, str) else str(action)
        if len(action) > self._max_action_chars:
            action = action[: self._max_action_chars]
        self._turn += 1
        parsed = parse_action(action, self._near_miss, self.accept_untagged_answer)
        kind = parsed.kind
        if kind in (ANSWER, UNTAGGED):
            return self._grade(parsed.answer, tagged=kind == ANSWER)

        reward = 0.0
        lines: list[str] = []
        step_errors: list[str] = []
        ran_a_tool = False
        out_of_calls = False
        if kind == CALLS:
            for name, raw_arg in parsed.calls:  # type: ignore[union-attr]
                if self._tool_calls >= self.max_tool_calls:
                    out_of_calls = True
                    break
                self._tool_calls += 1
                if self._tool_calls > self._task.needed_tool_calls:  # type: ignore[union-attr]
                    self._tool_penalty -= self.tool_call_penalty
                    reward -= self.tool_call_penalty
                arg = clean_argument(raw_arg)
                shown = arg if len(arg) <= _SHOWN_ARG_CHARS else arg[: _SHOWN_ARG_CHARS - 3] + "..."
                tool = self.tools.get(name.upper())
                if tool is None:
                    reward -= self._count_error("unknown_tool", step_errors)
                    lines.append(f"{name[:_SHOWN_NAME_CHARS]}[{shown}] = UNKNOWN_TOOL")
                elif not arg:
                    reward -= self._count_error("empty_argument", step_errors)
                    lines.append(f"{tool.name}[] = EMPTY_ARGUMENT")
                else:
                    try:
                        result = tool.fn(arg)
                        ran_a_tool = True
                    except (ToolError, ValueError) as rejected:
                        reward -= self._count_error("tool_error", step_errors)
                        result = str(rejected) or "ERROR"
                    lines.append(f"{tool.name}[{shown}] = {result}")
        else:
            reward -= self._count_error(_ERROR_KINDS[kind], step_errors)
            lines.append(self._error_lines[kind])

        if ran_a_tool:
            self._consecutive_errors = 0
        elif step_errors:
            self._consecutive_errors += 1
        no_call = kind in (NOTHING, EMPTY)
        self._consecutive_no_call = self._consecutive_no_call + 1 if no_call else 0

        end_reason = None
        failure_mode = "no_answer"
        limit = self.max_consecutive_errors
        if out_of_calls:
            end_reason, failure_mode = "max_turns", "tool_spam"
            lines.append("STOP: tool call limit reached.")
        elif limit is not None and self._consecutive_errors >= limit:
            end_reason = "no_tool_call" if self._consecutive_no_call >= limit else "parse_error"
            lines.append("STOP: too many errors in a row.")
        elif self._turn >= self.max_turns:
            if self.max_turns == 1 and no_call:
                end_reason = "no_tool_call"
            elif self.max_turns == 1 and step_errors:
                end_reason = "parse_error"
            else:
                end_reason = "max_turns"
            lines.append("STOP: turn limit reached.")

        observation = "\n".join(lines)
        if len(observation) > self._max_observation_chars:
            observation = observation[: self._max_observation_chars]
        info = self._info(step_errors)
        if end_reason is None:
            return observation, reward, False, False, info
        self._done = True
        self._correct += self.incorrect_reward
        reward += self.incorrect_reward
        info["reward_components"]["correct"] = self._correct
        info["failure_mode"] = failure_mode
        info["end_reason"] = end_reason
        info["error_counts"] = dict(self._error_counts)
        single_turn = self.max_turns == 1
        return observation, reward, single_turn, not single_turn, info

    def abandon(self) -> tuple[float, dict[str, Any]]:
        """The runner stopped this episode before the env ended it: settle it as unanswered.

        Returns (reward to add to the last step, final info); see the module doc."""
        if self._done:
            if self._task is None:
                raise RuntimeError(f"{type(self).__name__}: call reset() before abandon()")
            raise RuntimeError(f"{type(self).__name__}: abandon() called after the episode ended")
        self._done = True
        self._correct += self.incorrect_reward
        info = self._info([])
        del info["step_errors"]  # no step happened; the caller merges this into its last step's info
        info["failure_mode"] = "no_answer"
        info["error_counts"] = dict(self._error_counts)
        return self.incorrect_reward, info

    # ---- helpers -------------------------------------------------------------------------------

    def _count_error(self, kind: str, step_errors: list[str]) -> float:
        """Record one error; returns the penalty magnitude (the caller subtracts it)."""
        self._errors += 1
        self._error_counts[kind] = self._error_counts.get(kind, 0) + 1
        self._error_penalty -= self.error_penalty
        step_errors.append(kind)
        return self.error_penalty

    def _grade(self, value: int | None, *, tagged: bool) -> tuple[str, float, bool, bool, dict[str, Any]]:
        truth = self._task.answer  # type: ignore[union-attr]
        correct = value == truth
        reward = 0.0
        if correct:
            self._correct += self.correct_reward
            reward += self.correct_reward
        if tagged:
            self._format += self.format_reward
            reward += self.format_reward
        if not correct and not tagged:
            self._correct += self.incorrect_reward
            reward += self.incorrect_reward
        self._done = True
        self._graded = (correct, tagged)
        info = self._info([])
        info["failure_mode"] = ("success" if tagged else "wrong_format") if correct else "wrong_answer"
        info["end_reason"] = "answered"
        info["error_counts"] = dict(self._error_counts)
        if value is not None:
            info["graded_answer"] = value
        observation = "CORRECT" if correct else f"INCORRECT (answer: {truth})"
        return observation, reward, True, False, info

    def _info(self, step_errors: list[str]) -> dict[str, Any]:
        right, tagged = self._graded or (False, False)
        return {
            "reward_components": {
                "correct": self._correct,
                "format": self._format,
                "tool_penalty": self._tool_penalty,
                "error_penalty": self._error_penalty,
            },
            "tool_calls": self._tool_calls,
            "errors": self._errors,
            "consecutive_errors": self._consecutive_errors,
            "turn": self._turn,
            "step_errors": step_errors,
            "metrics": {
                "accuracy": float(right),
                "tag_rate": float(tagged),
                "success": float(right and tagged),
                "tool_calls": float(self._tool_calls),
                "env_errors": float(self._errors),
            },
        }
