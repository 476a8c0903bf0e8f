"""Text environments: `TextEnv` (the Gymnasium interface) and `ToolEnv` (tools, grading, limits).

A new tool environment subclasses `ToolEnv`, passes its tools (or marks its methods `@tool`) and a
prompt to `__init__`, and implements `new_task()`; the README's custom-env section has a whole
one (tests/envs/test_envs_custom_example.py).

How `ToolEnv.step` treats an action (the formats are in tools/call_formats.py, tools in tools/typed.py,
graders in grading.py):

- An answer (`[ANSWER] <answer>`, or a call of the `answer_tool` when the env has one): the
  grader reads and grades it and the episode terminates. A response the grader cannot read
  (`[ANSWER] ten` for a number) is a malformed answer: an error, and the episode goes on.
  Without the env's answer format, an action with no call that states an answer the grader can
  find (`The answer is 42.`) is graded too (`accept_untagged_answer`): correct credit, no format
  credit.
- Tool calls: every call in the action is handled IN ORDER and each counts toward
  `max_tool_calls`; the observation has one part per call (the format writes it). The call that
  would exceed `max_tool_calls` is not run: the episode is truncated (failure_mode `tool_spam`).
  Arguments are validated before the call; a tool may award named reward components
  (`ToolResult.rewards`) that land at that step.
- Errors (each costs `error_penalty` at its step and is counted in info `errors` and
  `error_counts`): unknown_tool, empty_argument, bad_arguments, tool_error, tool_timeout,
  malformed_call, malformed_answer, mixed_call_and_answer, no_call_no_answer, empty_action.
  An action that runs no tool but has an error extends the error streak (info
  `consecutive_errors`); at `max_consecutive_errors` the episode is truncated.
- Limits end the episode in this order: tool budget, error streak, `max_turns`. When the episode
  ends without an answer, `incorrect_reward` is added to the `correct` component.
- Rewards: `correct_reward * score` for a graded answer (`incorrect_reward` for a wrong one stated
  outside the answer format), `format_reward` if in the format; `-tool_call_penalty` per call
  beyond the task's `needed_tool_calls`; `-error_penalty` per error; tool awards; the grade's
  components; and `final_reward()`'s components, run once however the episode ends (answered, a
  limit, or abandoned). Each lands at the step it happens, so the sum of step rewards equals the
  sum of info `reward_components`.

Episodes the caller stops (the optional `abandon()` protocol): a runner that ends an episode the
env has not ended, for a limit of its own (a token or context budget, its own turn limit), calls
`env.unwrapped.abandon() -> (reward, info)` if the env has it. `ToolEnv.abandon` settles the
episode as unanswered, exactly like the env's own limits (incorrect_reward, final_reward) and
returns the reward to add to the episode's last step; info has the final `reward_components`,
the counters, failure_mode and `error_counts`, and no end_reason (the caller knows why it
stopped); the episode is over (step() raises). Envs without the method (plain Gymnasium envs)
are simply not settled. Not meant for infrastructure failures: those episodes are not trained on.

Metrics (info `metrics`, every step; the generic contract is envs/info.py): `accuracy` (the
grade's score once an answer is graded), `tag_rate` (1.0 once the graded answer came in the
env's answer format), `success` (the env's `success()`, decided when the episode ends; by
default a fully right answer in the format), `tool_calls` and `env_errors` (the counts so far).

Final-step info adds `failure_mode` (success, wrong_format, wrong_answer, goal_not_met,
tool_spam, no_answer), `end_reason` and `error_counts`. end_reason is `answered`, `max_turns`
(turn or tool budget), `parse_error` (error streak with a malformed action in it) or
`no_tool_call` (error streak of actions with neither a call nor an answer, or a single-turn env
whose one action had neither). A single-turn env (`max_turns=1`) always TERMINATES after its one
step: that step is the whole episode, not a cut-short one.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium
import msgspec

from ..tools.call_formats import ANSWER, BAD_CALL, CALLS, EMPTY, MIXED, OTHER, ParsedCall, get_format
from ..tools.typed import Call, Tool, ToolCallError, as_tool, marked_methods, result_text
from .grading import Grade, Unreadable, answer_text, default_grader, is_reader, to_grade
from .info import REPLACED_CHARS
from .spaces import UnicodeText

_BUILTIN_COMPONENTS = ("correct", "format", "tool_penalty", "error_penalty")
_SHOWN_ANSWER_CHARS = 200  # info `graded_answer` keeps this much of a text response


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
    def answer(self) -> Any:
        raise NotImplementedError

    def oracle_actions(self) -> list[str]:
        """The ideal actions for the current task; the last one states the final answer
        (`answer_action(self.answer)`)."""
        raise NotImplementedError

    def malformed_action(self, action: str) -> str | None:
        """A fumbled version of one of the oracle's non-final actions, which the env answers with
        an error observation (a recoverable mistake), or None when the action has none."""
        return None

    def answer_action(self, answer: Any, tagged: bool = True) -> str:
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


def _plain(value: Any) -> Any:
    """numpy scalars (from rng draws) as Python ones: `int64(3)` -> 3, `float64(1.864)` -> 1.864."""
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        return item()
    return value


@dataclass(frozen=True, slots=True)
class Task:
    """One episode's task, made by `ToolEnv.new_task`.

    question: the first observation. answer: the ground truth, any JSON value (a float is kept
    exactly; numpy scalars become Python ones). solution: the ideal steps before the answer, one
    entry per turn: a `Call`, a list of Calls (several in one turn) or a literal action string;
    the env writes them in its tool-call format and adds the answer (`env.oracle_actions()`).
    needed_tool_calls: calls beyond this many are penalised; by default the solution's calls.
    state: the episode's mutable state (`env.state`), which tools read and change and the grader
    and `final_reward` see.
    """

    question: str
    answer: Any
    solution: Sequence[Call | Sequence[Call] | str] = ()
    needed_tool_calls: int = -1
    state: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.question, str):
            raise TypeError(f"Task.question must be a str, got {type(self.question).__name__}")
        answer = _plain(self.answer)
        if isinstance(answer, float) and not math.isfinite(answer):
            raise ValueError(f"Task.answer must be finite, got {answer!r}")
        try:
            msgspec.json.encode(answer)
        except (TypeError, msgspec.EncodeError):
            raise TypeError(f"Task.answer must be a JSON value, got {type(answer).__name__}") from None
        object.__setattr__(self, "answer", answer)
        steps = [self.solution] if isinstance(self.solution, str | Call) else list(self.solution)
        calls = 0
        for step in steps:
            if isinstance(step, str | Call):
                calls += 1
            elif isinstance(step, Sequence) and step and all(isinstance(c, Call) for c in step):
                calls += len(step)
            else:
                raise TypeError(
                    f"Task.solution steps are Calls, lists of Calls or action strings, got {step!r:.80}"
                )
        object.__setattr__(self, "solution", tuple(steps))
        if self.needed_tool_calls < 0:
            object.__setattr__(self, "needed_tool_calls", calls)


class Example(msgspec.Struct, frozen=True):
    """A worked example for the system prompt, which the env writes in its own tool-call format:
    the question, the (call, result) steps, the answer."""

    question: str
    steps: Sequence[tuple[Call, Any]] = ()
    answer: Any = None


class ToolEnv(TextEnv):
    """A text env with tools, graded answers, rewards and error/turn limits (see the module doc).

    Subclasses call `super().__init__(instructions=..., tools=..., **knobs)` and implement
    `new_task() -> Task`, drawing from `self.np_random` only. Methods marked `@tool` are tools
    too (bound to the env). Optional hooks: `final_reward(grade)` and `success(grade, tagged)`.

    Knobs: tool_format ("brackets" or "json"), grader (a callable `(response, task, state) ->
    bool | float | Grade`; default: by the answer's type, grading.default_grader), answer_tool
    (a tool name: answers come as `answer_tool(answer=...)` calls instead of the `[ANSWER]` tag),
    max_turns, max_tool_calls, max_consecutive_errors (None: never), correct_reward,
    format_reward, incorrect_reward, tool_call_penalty, error_penalty, accept_untagged_answer,
    max_action_chars (longer actions are parsed up to this many characters), max_observation_chars.
    """

    def __init__(
        self,
        *,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        instructions: str,
        example: str | Example = "",
        tool_format: str = "brackets",
        grader: Callable[[Any, Task, Any], Any] | None = None,
        answer_tool: str | None = None,
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
        if grader is not None and not callable(grader):
            raise TypeError(f"grader must be a callable (response, task, state) -> score, got {grader!r}")
        self.format = get_format(tool_format)
        self.tools: dict[str, Tool] = {}
        for value in [*tools, *marked_methods(self)]:
            t = as_tool(value)
            if t.name.upper() in self.tools:
                raise ValueError(f"two tools are named {t.name}")
            self.tools[t.name.upper()] = t
        if answer_tool is not None:
            if answer_tool.upper() in self.tools:
                raise ValueError(f"answer_tool {answer_tool!r} clashes with a tool of that name")
            submit = Tool.from_function(_submit, name=answer_tool, description="Submit the final answer.")
            self.tools[submit.name.upper()] = submit
        self.answer_tool = answer_tool.upper() if answer_tool is not None else None
        self.grader = grader
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
        self._near_miss = self.format.near_miss(self.tools)
        self._tool_list = [t for key, t in self.tools.items() if key != self.answer_tool]
        hint = getattr(grader, "hint", "<answer>") if grader is not None else "<answer>"
        if self.answer_tool is not None:
            self._finish = f"Finish by calling {self.tools[self.answer_tool].name} with the answer."
        else:
            self._finish = f"Finish with [ANSWER] {hint}."
        self._system_prompt = self.build_system_prompt(instructions, example)
        # For a chat template that writes the tools block itself (reset info `instructions`).
        shown_example = self.render_example(example) if isinstance(example, Example) else example
        self._instructions = "\n".join(
            [
                instructions.strip(),
                self._finish,
                *(["Example:", shown_example.strip()] if shown_example else []),
            ]
        )
        first = self._tool_list[0] if self._tool_list else None
        call_or = "Call a tool or f" if self._tool_list else "F"
        nothing = "no tool call and no answer" if self._tool_list else "no answer"
        finish = call_or + self._finish[1:]
        self._error_lines = {
            "empty_action": f"ERROR: empty action. {finish}",
            "no_call_no_answer": f"ERROR: {nothing}. {finish}",
            "malformed_call": f"ERROR: malformed tool call. Write it like {self.format.call_example(first)}.",
            "mixed_call_and_answer": "ERROR: tool calls and an answer in one turn. Call the tools, "
            "wait for their results, then answer.",
        }
        self._task: Task | None = None
        self._done = True

    # ---- what subclasses provide -------------------------------------------------------------

    def new_task(self) -> Task:
        """Draw this episode's task (and its per-episode state) from `self.np_random`."""
        raise NotImplementedError(f"{type(self).__name__} must implement new_task()")

    def final_reward(self, grade: Grade | None) -> Mapping[str, float]:
        """Named reward components for the final state (`self.state`), run once when the episode
        ends however it ends; `grade` is None when it ended unanswered. Default: none."""
        return {}

    def success(self, grade: Grade | None, tagged: bool) -> bool:
        """Whether the episode reached its goal (metric `success`, failure_mode `success`), decided
        when it ends. Default: a fully right answer in the env's answer format."""
        return grade is not None and grade.correct and tagged

    def build_system_prompt(self, instructions: str, example: str | Example) -> str:
        lines = [instructions.strip(), *self.format.describe(self._tool_list, self._finish)]
        if isinstance(example, Example):
            example = self.render_example(example)
        if example:
            lines += ["Example:", example.strip()]
        return "\n".join(lines)

    def render_example(self, example: Example) -> str:
        """`User: ...`, then `Assistant: <call>` / `Tool: <result>` per step, then the answer."""
        lines = [f"User: {example.question}"]
        for call, result in example.steps:
            tool = self.tools.get(call.name.upper())
            written = self.format.render_call(tool, call)
            shown = ParsedCall(call.name, "", written)
            lines += [
                f"Assistant: {written}",
                f"Tool: {self.format.result(call.name, shown, result_text(result))}",
            ]
        lines.append(f"Assistant: {self.answer_action(example.answer)}")
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
    def answer(self) -> Any:
        return self._current_task().answer

    @property
    def task(self) -> Task:
        """The current episode's Task."""
        return self._current_task()

    @property
    def state(self) -> Any:
        """The current task's per-episode state (`Task.state`)."""
        return self._current_task().state

    @property
    def needed_tool_calls(self) -> int:
        return self._current_task().needed_tool_calls

    @property
    def tool_specs(self) -> list[dict[str, Any]]:
        """Every tool as an OpenAI-style function spec (what a chat template's `tools` takes)."""
        return [t.spec for t in self.tools.values()]

    def oracle_actions(self) -> list[str]:
        task = self._current_task()
        actions = []
        for step in task.solution:
            if isinstance(step, str):
                actions.append(step)
            else:
                actions.append(
                    self.format.render_calls(self.tools, [step] if isinstance(step, Call) else step)
                )
        return [*actions, self.answer_action(task.answer)]

    def malformed_action(self, action: str) -> str | None:
        """The action's first tool call fumbled by the format (`LOOKUP[cat]` -> `LOOKUP(cat)`), or
        None when it has no call."""
        return self.format.malformed(action)

    def answer_action(self, answer: Any, tagged: bool = True) -> str:
        """`[ANSWER] <answer>` (or the answer tool's call); untagged: `The answer is <answer>.`"""
        if not tagged:
            return f"The answer is {answer_text(answer)}."
        if self.answer_tool is not None:
            return self.format.render_call(
                self.tools[self.answer_tool], Call(self.answer_tool, {"answer": answer})
            )
        return f"[ANSWER] {answer_text(answer)}"

    def mistaken_actions(self) -> tuple[str, ...]:
        return self.format.mistakes(self._tool_list)

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
        for step in task.solution:
            if isinstance(step, str) and self.format.parse(step, self._near_miss).kind == ANSWER:
                raise ValueError(
                    f"Task.solution ends with the answer ({step[:40]!r}); leave it out: the env adds "
                    "the answer in its own format (env.oracle_actions())"
                )
        self._task = task
        self._task_grader = self.grader if self.grader is not None else default_grader(task.answer)
        self._task_reader = self._task_grader if is_reader(self._task_grader) else None
        self._done = False
        self._turn = 0
        self._tool_calls = 0
        self._errors = 0
        self._error_counts: dict[str, int] = {}
        self._consecutive_errors = 0
        self._consecutive_no_call = 0
        self._grade: Grade | None = None
        self._tagged = False
        self._success = False
        self._components: dict[str, float] = dict.fromkeys(_BUILTIN_COMPONENTS, 0.0)
        info = {
            "system_prompt": self._system_prompt,
            "instructions": self._instructions,
            "tools": self.tool_specs,
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
        parsed = self.format.parse(action, self._near_miss)
        kind = parsed.kind
        reward = 0.0
        parts: list[str] = []
        step_errors: list[str] = []
        if kind == ANSWER:
            text = parsed.answer or ""
            try:
                response = self._read(text)
            except Unreadable as unreadable:
                reward -= self._count_error("malformed_answer", step_errors)
                parts.append(f"ERROR: malformed answer ({unreadable}). {self._finish}")
            else:
                return self._graded(response, tagged=self.answer_tool is None, reward=reward)
        elif kind == OTHER:
            reader = self._task_reader
            found = reader.find(action) if self.accept_untagged_answer and reader is not None else None
            if found is not None:
                return self._graded(found, tagged=False, reward=reward)
            reward -= self._count_error("no_call_no_answer", step_errors)
            parts.append(self._error_lines["no_call_no_answer"])
        elif kind == EMPTY:
            reward -= self._count_error("empty_action", step_errors)
            parts.append(self._error_lines["empty_action"])
        elif kind == BAD_CALL:
            reward -= self._count_error("malformed_call", step_errors)
            parts.append(self._error_lines["malformed_call"])
        elif kind == MIXED:
            reward -= self._count_error("mixed_call_and_answer", step_errors)
            parts.append(self._error_lines["mixed_call_and_answer"])

        ran_a_tool = False
        out_of_calls = False
        results: list[str] = []  # one text per call handled, for info `tool_results`
        for call in (parsed.calls or []) if kind == CALLS else []:
            if call.error is not None:  # unreadable: an error, not a call of any tool
                reward -= self._count_error(call.error, step_errors)
                parts.append(self.format.result("", call, call.message))
                results.append(call.message)
                continue
            tool = self.tools.get(call.name.upper())
            answering = tool is not None and tool.name.upper() == self.answer_tool
            if not answering:  # an answer is no tool call: it is never over budget
                if self._tool_calls >= self.max_tool_calls:
                    out_of_calls = True
                    break
                self._tool_calls += 1
                if self._tool_calls > self._task.needed_tool_calls:  # type: ignore[union-attr]
                    self._components["tool_penalty"] -= self.tool_call_penalty
                    reward -= self.tool_call_penalty
            if tool is None:
                reward -= self._count_error("unknown_tool", step_errors)
                parts.append(self.format.unknown_tool(call, self._tool_list))
                results.append(self.format.unknown_tool_text(call, self._tool_list))
                continue
            try:
                result = self._run(tool, call)
            except ToolCallError as refused:
                reward -= self._count_error(refused.kind, step_errors)
                message = str(refused)
                text = (
                    message
                    if refused.kind in ("tool_error", "empty_argument", "tool_timeout")
                    else f"ERROR: {message}"
                )
                parts.append(self.format.result(tool.name, call, text))
                results.append(text)
                continue
            if answering:
                try:
                    response = self._read(result.content)
                except Unreadable as unreadable:
                    reward -= self._count_error("malformed_answer", step_errors)
                    text = f"ERROR: malformed answer ({unreadable})."
                    parts.append(self.format.result(tool.name, call, text))
                    results.append(text)
                    continue
                return self._graded(response, tagged=True, reward=reward)
            ran_a_tool = True
            for name, value in result.rewards.items():
                if name in _BUILTIN_COMPONENTS:
                    raise ValueError(
                        f"tool {tool.name}: reward name {name!r} is one of the env's own components"
                    )
                self._components[name] = self._components.get(name, 0.0) + float(value)
                reward += float(value)
            text = result_text(result.content)
            parts.append(self.format.result(tool.name, call, text))
            results.append(text)

        if ran_a_tool:
            self._consecutive_errors = 0
        elif step_errors:
            self._consecutive_errors += 1
        no_call = kind in (OTHER, EMPTY)
        self._consecutive_no_call = self._consecutive_no_call + 1 if no_call else 0

        end_reason = None
        failure_mode = "no_answer"
        limit = self.max_consecutive_errors
        stop = None
        if out_of_calls:
            end_reason, failure_mode = "max_turns", "tool_spam"
            stop = "STOP: tool call limit reached."
        elif limit is not None and self._consecutive_errors >= limit:
            end_reason = "no_tool_call" if self._consecutive_no_call >= limit else "parse_error"
            stop = "STOP: too many errors in a row."
        elif self._turn >= self.max_turns:
            if self.max_turns == 1 and no_call:
                end_reason = "no_tool_call"
            elif self.max_turns == 1 and step_errors:
                end_reason = "parse_error"
            else:
                end_reason = "max_turns"
            stop = "STOP: turn limit reached."

        observation = self.format.join(parts)
        if stop is not None:
            observation = f"{observation}\n{stop}" if observation else stop
        if len(observation) > self._max_observation_chars:
            observation = observation[: self._max_observation_chars]
        info = self._info(step_errors)
        if kind == CALLS:
            info["tool_results"] = results
        if end_reason is None:
            return observation, reward, False, False, info
        reward += self._settle(None)
        info.update(self._info(step_errors))
        info["failure_mode"] = "success" if self._success else failure_mode
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
        reward = self._settle(None)
        info = self._info([])
        del info["step_errors"]  # no step happened; the caller merges this into its last step's info
        info["failure_mode"] = "success" if self._success else "no_answer"
        info["error_counts"] = dict(self._error_counts)
        return reward, info

    # ---- helpers -------------------------------------------------------------------------------

    def _read(self, response: Any) -> Any:
        """The response as the grader reads it; Unreadable when it is no answer at all."""
        if self._task_reader is not None:
            return self._task_reader.read(response)
        if isinstance(response, str) and not response.strip():
            raise Unreadable("nothing after the tag")
        return response

    def _run(self, tool: Tool, call: ParsedCall) -> Any:
        try:
            arguments, strict = self.format.arguments(tool, call)
        except ValueError as wrong:
            raise ToolCallError("bad_arguments", str(wrong)) from None
        return tool(arguments, strict=strict)

    def _count_error(self, kind: str, step_errors: list[str]) -> float:
        """Record one error; returns the penalty magnitude (the caller subtracts it)."""
        self._errors += 1
        self._error_counts[kind] = self._error_counts.get(kind, 0) + 1
        self._components["error_penalty"] -= self.error_penalty
        step_errors.append(kind)
        return self.error_penalty

    def _add_components(self, components: Mapping[str, float], who: str) -> float:
        total = 0.0
        for name, value in components.items():
            if not isinstance(name, str) or not name.isidentifier() or name in _BUILTIN_COMPONENTS:
                raise ValueError(
                    f"{who}: component name {name!r} is not an identifier or is one of the env's own"
                )
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{who}: component {name!r} = {value!r} is not a finite number")
            self._components[name] = self._components.get(name, 0.0) + float(value)
            total += float(value)
        return total

    def _settle(self, grade: Grade | None) -> float:
        """End the episode: the unanswered penalty, final_reward and success. Returns the reward."""
        self._done = True
        reward = 0.0
        if grade is None:
            self._components["correct"] += self.incorrect_reward
            reward += self.incorrect_reward
        reward += self._add_components(self.final_reward(grade), f"{type(self).__name__}.final_reward")
        self._success = bool(self.success(grade, self._tagged))
        return reward

    def _graded(
        self, response: Any, *, tagged: bool, reward: float
    ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        task = self._current_task()
        grade = to_grade(self._task_grader(response, task, task.state), f"{type(self).__name__}'s grader")
        if grade.score > 0:
            self._components["correct"] += self.correct_reward * grade.score
            reward += self.correct_reward * grade.score
        elif not tagged:
            self._components["correct"] += self.incorrect_reward
            reward += self.incorrect_reward
        if tagged:
            self._components["format"] += self.format_reward
            reward += self.format_reward
        reward += self._add_components(grade.components, "the grade")
        self._grade, self._tagged = grade, tagged
        reward += self._settle(grade)
        info = self._info([])
        if self._success:
            failure_mode = "success"
        elif grade.correct:
            failure_mode = "goal_not_met" if tagged else "wrong_format"
        else:
            failure_mode = "wrong_answer"
        info["failure_mode"] = failure_mode
        info["end_reason"] = "answered"
        info["error_counts"] = dict(self._error_counts)
        shown = response[:_SHOWN_ANSWER_CHARS] if isinstance(response, str) else response
        if not (isinstance(shown, float) and not math.isfinite(shown)):
            info["graded_answer"] = shown
        truth = answer_text(task.answer)
        if grade.correct:
            observation = "CORRECT"
        elif grade.score > 0:
            observation = f"PARTLY CORRECT (score {grade.score:.2f}; answer: {truth})"
        else:
            observation = f"INCORRECT (answer: {truth})"
        if len(observation) > self._max_observation_chars:
            observation = observation[: self._max_observation_chars]
        return observation, reward, True, False, info

    def _info(self, step_errors: list[str]) -> dict[str, Any]:
        grade = self._grade
        return {
            "reward_components": dict(self._components),
            "tool_calls": self._tool_calls,
            "errors": self._errors,
            "consecutive_errors": self._consecutive_errors,
            "turn": self._turn,
            "step_errors": step_errors,
            "metrics": {
                "accuracy": grade.score if grade is not None else 0.0,
                "tag_rate": float(grade is not None and self._tagged),
                "success": float(self._success),
                "tool_calls": float(self._tool_calls),
                "env_errors": float(self._errors),
            },
        }


def _submit(answer: Any) -> Any:
    """Submit the final answer."""
    return answer
