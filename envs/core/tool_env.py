"""`ToolEnv`: the text env with tools, graded answers, rewards and error/turn limits.

A new tool environment subclasses `ToolEnv`, passes its tools (or marks its methods `@tool`) and a
prompt to `__init__`, and implements `new_task()`; the README's custom-env section has a whole
one (tests/envs/core/test_envs_custom_example.py).

How `ToolEnv.step` treats an action (the formats are in tools/call_formats.py, tools in
tools/typed.py, graders in grading.py, the reward in ledger.py, the limits in limits.py, the
text it writes in prompts.py):

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
  (`ToolResult.rewards`) that land at that step, and report counts of their own as env metrics
  (`ToolResult.metrics`, `ToolCallError.metrics`: the sandbox's `sandbox_timeout`, ...).
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

Tools with per-episode state (the sandbox's persistent interpreter, `python_tool(persistent=True)`):
a tool with `per_env` is copied per env (`per_env()`), so that envs never share its state, and
its `end_episode()` runs when an episode ends: settled (answered, a limit, abandoned), at
`reset` and at `close`.

Notes (`notes=True`): the env gets a `NOTE` tool (`NOTE[text]` in brackets, a `NOTE` call in
json) that answers `noted` and puts the text in the step's info `note` (envs/core/info.py); a
note is not a tool call (no budget, no penalty) but it is a turn. The env declares the context
policy that reads it (`context_policy`, {"policy": "notes"}: rollouts/context.py), so after each
note the model sees only the system prompt, the task and its notes.

Episodes the caller stops (the optional `abandon()` protocol): a runner that ends an episode the
env has not ended, for a limit of its own (a token or context budget, its own turn limit), calls
`env.unwrapped.abandon() -> (reward, info)` if the env has it. `ToolEnv.abandon` settles the
episode as unanswered, exactly like the env's own limits (incorrect_reward, final_reward) and
returns the reward to add to the episode's last step; info has the final `reward_components`,
the counters, failure_mode and `error_counts`, and no end_reason (the caller knows why it
stopped); the episode is over (step() raises). Envs without the method (plain Gymnasium envs)
are simply not settled. Not meant for infrastructure failures: those episodes are not trained on.

Conversations (the `user_turn(kind, action)` hook, default None): an env whose user speaks
several times (envs/adapters/bfcl.py) returns a `UserTurn` for an action without a call: the
policy ended its turn, the env's reply is the user's next message (its named rewards land at
that step; no error, the error streak broken; its step info says `observation_role: "user"`,
envs/core/info.py, so a chat template renders it as a user message even where tool results are
tool messages), or, with a grade, the graded end of the conversation. Tools that depend on the
task: `set_tools(tools, instructions)` from `new_task()` rebuilds the tools and the system prompt
(without instructions, only the tools).

Metrics (info `metrics`, every step; the generic contract is envs/core/info.py): `accuracy` (the
grade's score once an answer is graded), `tag_rate` (1.0 once the graded answer came in the
env's answer format), `success` (the env's `success()`, decided when the episode ends; by
default a fully right answer in the format), `tool_calls` and `env_errors` (the counts so far),
and the tools' own counts (summed over the episode's calls, present once a call reported one).

Final-step info adds `failure_mode` (success, wrong_format, wrong_answer, goal_not_met,
tool_spam, no_answer), `end_reason` and `error_counts`. end_reason is `answered`, `max_turns`
(turn or tool budget), `parse_error` (error streak with a malformed action in it) or
`no_tool_call` (error streak of actions with neither a call nor an answer, or a single-turn env
whose one action had neither). A single-turn env (`max_turns=1`) always TERMINATES after its one
step: that step is the whole episode, not a cut-short one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..tools.call_formats import (
    ANSWER,
    BAD_CALL,
    CALLS,
    EMPTY,
    MIXED,
    OTHER,
    ParsedAction,
    ParsedCall,
    get_format,
)
from ..tools.typed import Call, Tool, ToolCallError, as_tool, marked_methods, result_text
from . import prompts
from .grading import Grade, Unreadable, answer_text, default_grader, is_reader, to_grade
from .info import CREDIT_STATE, NOTE, OBSERVATION_ROLE
from .ledger import RewardLedger
from .limits import Ending, limit_reached
from .task import Example, Task
from .text_env import TextEnv

NOTE_TOOL = "NOTE"
NOTE_DESCRIPTION = "write a note; after it you see only the task and your notes"
NOTED = "noted"
_SHOWN_ANSWER_CHARS = 200  # info `graded_answer` keeps this much of a text response

# The errors an action as a whole can make, by the kind the format parsed it as.
_ACTION_ERRORS = {
    OTHER: "no_call_no_answer",
    EMPTY: "empty_action",
    BAD_CALL: "malformed_call",
    MIXED: "mixed_call_and_answer",
}

_UNDECLARED = object()  # ToolEnv.context_policy: no policy set on the instance


class _Answer(NamedTuple):
    """A graded response, and whether it came in the env's answer format."""

    response: Any
    tagged: bool
    grade: Grade


@dataclass(slots=True)
class _Turn:
    """What one step has handled so far: the observation's parts, the errors (info
    `step_errors`), one result text per call (info `tool_results`), and the limits it met."""

    parts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    ran_a_tool: bool = False
    out_of_calls: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class UserTurn:
    """The env's reply as the user when the policy ends its turn (`ToolEnv.user_turn`): with no
    `grade`, `message` is the user's next message and the conversation goes on; with a `grade`,
    the conversation is over and graded as an answer in the format (`message` is the last
    observation). `rewards` are named components landing at this step, `info` extra step info."""

    message: str
    grade: Grade | None = None
    rewards: Mapping[str, float] = field(default_factory=dict)
    info: Mapping[str, Any] = field(default_factory=dict)


def _check_count(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_magnitude(name: str, value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} is a magnitude (subtracted per occurrence): a float >= 0, got {value!r}")


class ToolEnv(TextEnv):
    """A text env with tools, graded answers, rewards and error/turn limits (see the module doc).

    Subclasses call `super().__init__(instructions=..., tools=..., **knobs)` and implement
    `new_task() -> Task`, drawing from `self.np_random` only. Methods marked `@tool` are tools
    too (bound to the env). Optional hooks: `final_reward(grade)` and `success(grade, tagged)`.

    Knobs: tool_format (a name in tools/call_formats.py: "brackets", "json", "llama3_json",
    "mistral", "pythonic", "qwen3_coder"), grader (a callable `(response, task, state) ->
    bool | float | Grade`; default: by the answer's type, grading.default_grader), answer_tool
    (a tool name: answers come as `answer_tool(answer=...)` calls instead of the `[ANSWER]` tag),
    max_turns, max_tool_calls, max_consecutive_errors (None: never), correct_reward,
    format_reward, incorrect_reward, tool_call_penalty, error_penalty, accept_untagged_answer,
    max_action_chars (longer actions are parsed up to this many characters), max_observation_chars,
    notes (a NOTE tool and the notes context policy: see the module doc).
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
        notes: bool = False,
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
        self.notes = bool(notes)
        self._answer_tool_name = answer_tool
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
        self.set_tools(tools, instructions, example)
        self._task: Task | None = None
        self._done = True

    def set_tools(
        self,
        tools: Sequence[Tool | Callable[..., Any]],
        instructions: str | None = None,
        example: str | Example = "",
        finish: str | None = None,
    ) -> None:
        """Build the env's tools (`tools`, the methods marked `@tool`, NOTE, the answer tool) and,
        given `instructions`, the system prompt over them (`finish`: the line saying how to end,
        by default the answer format's). `__init__` calls it; an env whose tools depend on the
        task calls it from `new_task()`, and without `instructions` mid-episode (tools added at
        a later user turn: the prompt already shown stays as it is)."""
        built: dict[str, Tool] = {}
        for value in [*tools, *marked_methods(self)]:
            t = as_tool(value)
            if t.per_env is not None:  # state within an episode: this env's own copy
                t = t.per_env()
            if t.name.upper() in built:
                raise ValueError(f"two tools are named {t.name}")
            built[t.name.upper()] = t
        if self.notes:
            if NOTE_TOOL in built:
                raise ValueError(f"notes=True adds a {NOTE_TOOL} tool, which clashes with one of that name")
            built[NOTE_TOOL] = Tool(NOTE_TOOL, NOTE_DESCRIPTION, _noted, arg="text")
        answer_tool = self._answer_tool_name
        if answer_tool is not None:
            if answer_tool.upper() in built:
                raise ValueError(f"answer_tool {answer_tool!r} clashes with a tool of that name")
            submit = Tool.from_function(_submit, name=answer_tool, description="Submit the final answer.")
            built[submit.name.upper()] = submit
        self.tools: dict[str, Tool] = built
        self._near_miss = self.format.near_miss(self.tools)
        self._tool_list = [t for key, t in self.tools.items() if key != self.answer_tool]
        if instructions is not None:
            answering = self.tools[self.answer_tool] if self.answer_tool is not None else None
            self._finish = finish if finish is not None else prompts.finish_line(answering, self.grader)
            self._system_prompt = self.build_system_prompt(instructions, example)
            # For a chat template that writes the tools block itself (reset info `instructions`).
            shown_example = self.render_example(example) if isinstance(example, Example) else example
            self._instructions = prompts.instructions_text(instructions, self._finish, shown_example)
        self._error_lines = prompts.error_lines(self.format, self._tool_list, self._finish)

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

    def user_turn(self, kind: str, action: str) -> UserTurn | None:
        """A conversation's hook: the action made no tool call (`kind`, the format's parse
        outcome: other, empty, answer, bad_call, mixed). None (the default): ToolEnv handles it
        (an answer, an error). A `UserTurn`: the policy ended its turn and the env speaks as the
        user (see `UserTurn`); the step is no error and breaks any error streak."""
        return None

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
    def step_waits(self) -> bool:
        """Whether `step` may wait on something outside the process (a tool that `waits_outside`:
        a sandbox, an MCP server): the rollout runner then steps this env in a worker thread."""
        return any(t.waits_outside for t in self.tools.values())

    @property
    def context_policy(self) -> Mapping[str, Any] | None:
        """The context policy this env declares (rollouts/context.py): what a subclass set
        (`self.context_policy = {...}` in `__init__`, e.g. from its knobs, or a class attribute),
        else the notes policy when it has the NOTE tool, else none (the runner keeps everything
        unless a config says otherwise)."""
        declared = self.__dict__.get("_declared_context_policy", _UNDECLARED)
        if declared is not _UNDECLARED:
            return declared
        return {"policy": "notes"} if self.notes else None

    @context_policy.setter
    def context_policy(self, value: Mapping[str, Any] | None) -> None:
        self._declared_context_policy = value

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
        self._end_tool_episodes()
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
        self._tool_metrics: dict[str, float] = {}
        self._consecutive_errors = 0
        self._consecutive_no_call = 0
        self._grade: Grade | None = None
        self._tagged = False
        self._success = False
        self._ledger = RewardLedger(self)
        info: dict[str, Any] = {"system_prompt": self._system_prompt}
        if self.format.template_tools:  # a template's JSON tools block would contradict brackets
            info.update(instructions=self._instructions, tools=self.tool_specs)
        info.update(
            question=task.question,
            answer=task.answer,
            needed_tool_calls=task.needed_tool_calls,
            max_turns=self.max_turns,
        )
        return task.question, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Parse the action; run its calls in order, or read the answer it states; grade an
        answer (the episode terminates), else check the limits (see the module doc)."""
        action = self._accept(action)
        self._ledger.start_step()
        self._turn += 1
        parsed = self.format.parse(action, self._near_miss)
        turn = _Turn()
        if parsed.kind == CALLS:
            answer = self._run_calls(parsed.calls or [], turn)
        else:
            spoken = self.user_turn(parsed.kind, action)
            if spoken is not None:
                return self._user_spoke(spoken, action)
            answer = self._stated_answer(parsed, action, turn)
        if answer is not None:
            return self._graded(answer)
        return self._end_turn(parsed.kind, turn)

    def abandon(self) -> tuple[float, dict[str, Any]]:
        """The runner stopped this episode before the env ended it: settle it as unanswered.

        Returns (reward to add to the last step, final info); see the module doc."""
        if self._done:
            if self._task is None:
                raise RuntimeError(f"{type(self).__name__}: call reset() before abandon()")
            raise RuntimeError(f"{type(self).__name__}: abandon() called after the episode ended")
        self._ledger.start_step()
        self._settle(None)
        info = self._info([])
        del info["step_errors"]  # no step happened; the caller merges this into its last step's info
        info["failure_mode"] = "success" if self._success else "no_answer"
        info["error_counts"] = dict(self._error_counts)
        return self._ledger.take_step(), info

    # ---- one step, in order --------------------------------------------------------------------

    def _accept(self, action: Any) -> str:
        """The action as a str of at most max_action_chars; raises when no episode is running."""
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
        return action

    def _stated_answer(self, parsed: ParsedAction, action: str, turn: _Turn) -> _Answer | None:
        """The answer the action states outside any call (tagged, or untagged when accepted), or
        None after recording the action's own error (malformed answer, no call, ...)."""
        kind = parsed.kind
        if kind == ANSWER:
            try:
                return self._grade_response(self._read(parsed.answer or ""), tagged=self.answer_tool is None)
            except Unreadable as unreadable:
                self._count_error("malformed_answer", turn)
                turn.parts.append(prompts.malformed_answer(unreadable, self._finish))
                return None
        if kind == OTHER:
            reader = self._task_reader
            found = reader.find(action) if self.accept_untagged_answer and reader is not None else None
            if found is not None:
                try:
                    return self._grade_response(found, tagged=False)
                except Unreadable:  # the grader takes back what its `find` found: no answer
                    pass
        error = _ACTION_ERRORS.get(kind)
        if error is not None:
            self._count_error(error, turn)
            if parsed.reason:  # a malformed call the format can say more about
                first = self._tool_list[0] if self._tool_list else None
                turn.parts.append(prompts.malformed_call(self.format, first, parsed.reason))
            else:
                turn.parts.append(self._error_lines[error])
        return None

    def _run_calls(self, calls: Sequence[ParsedCall], turn: _Turn) -> _Answer | None:
        """Handle the calls in order until one answers or the tool budget runs out."""
        for call in calls:
            answer = self._handle_call(call, turn)
            if answer is not None or turn.out_of_calls:
                return answer
        return None

    def _handle_call(self, call: ParsedCall, turn: _Turn) -> _Answer | None:
        """One call: an unreadable call's error, the tool budget, an unknown tool, a refused or
        failed call, an answer (returned), or the tool's result and awards."""
        if call.error is not None:  # unreadable: an error, not a call of any tool
            self._count_error(call.error, turn)
            self._show(turn, "", call, call.message)
            return None
        tool = self.tools.get(call.name.upper())
        answering = tool is not None and tool.name.upper() == self.answer_tool
        noting = tool is not None and self.notes and tool.name.upper() == NOTE_TOOL
        if not (answering or noting) and not self._spend_tool_call():  # an answer is never over budget
            turn.out_of_calls = True
            return None
        if tool is None:
            self._count_error("unknown_tool", turn)
            turn.parts.append(self.format.unknown_tool(call, self._tool_list))
            turn.results.append(self.format.unknown_tool_text(call, self._tool_list))
            return None
        try:
            result = self._run(tool, call)
        except ToolCallError as refused:
            self._add_tool_metrics(refused.metrics)
            self._count_error(refused.kind, turn)
            self._show(turn, tool.name, call, prompts.refused_call(refused.kind, str(refused)))
            return None
        if answering:
            try:
                return self._grade_response(self._read(result.content), tagged=True)
            except Unreadable as unreadable:
                self._count_error("malformed_answer", turn)
                self._show(turn, tool.name, call, prompts.malformed_answer(unreadable))
                return None
        turn.ran_a_tool = True
        if noting:
            turn.notes.append(str(result.content))
            self._show(turn, tool.name, call, NOTED)
            return None
        self._add_tool_metrics(result.metrics)
        self._ledger.award(result.rewards, f"tool {tool.name}")
        self._show(turn, tool.name, call, result_text(result.content))
        return None

    def _spend_tool_call(self) -> bool:
        """Count one tool call (penalised beyond needed_tool_calls); False when the budget is spent."""
        if self._tool_calls >= self.max_tool_calls:
            return False
        self._tool_calls += 1
        if self._tool_calls > self._current_task().needed_tool_calls:
            self._ledger.extra_tool_call()
        return True

    def _user_spoke(self, spoken: UserTurn, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """The policy ended its turn: the user's awards land, then the conversation goes on with the
        user's next message (the turn limit still applies) or, graded, ends as an answer."""
        self._consecutive_errors = 0
        self._consecutive_no_call = 0
        self._ledger.award(spoken.rewards, f"{type(self).__name__}.user_turn")
        if spoken.grade is not None:
            observation, reward, terminated, truncated, info = self._graded(
                _Answer(action, True, spoken.grade), spoken.message
            )
            return observation, reward, terminated, truncated, {**info, **spoken.info}
        ending = limit_reached(
            out_of_calls=False,
            consecutive_errors=0,
            consecutive_no_call=0,
            max_consecutive_errors=self.max_consecutive_errors,
            turn=self._turn,
            max_turns=self.max_turns,
            no_call=False,
            errored=False,
        )
        observation = prompts.with_stop(spoken.message, ending.stop if ending is not None else None)
        info = {**self._info([]), **spoken.info}
        if ending is None:  # the user's next message: a user message, whatever the run's observation role
            info = {OBSERVATION_ROLE: "user", **info}
            return self._clip(observation), self._ledger.take_step(), False, False, info
        return self._ended(self._clip(observation), ending, _Turn(), info)

    def _end_turn(self, kind: str, turn: _Turn) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """A step without an answer: the error streaks, then a limit may end the episode."""
        if turn.ran_a_tool:
            self._consecutive_errors = 0
        elif turn.errors:
            self._consecutive_errors += 1
        no_call = kind in (OTHER, EMPTY)
        self._consecutive_no_call = self._consecutive_no_call + 1 if no_call else 0
        ending = limit_reached(
            out_of_calls=turn.out_of_calls,
            consecutive_errors=self._consecutive_errors,
            consecutive_no_call=self._consecutive_no_call,
            max_consecutive_errors=self.max_consecutive_errors,
            turn=self._turn,
            max_turns=self.max_turns,
            no_call=no_call,
            errored=bool(turn.errors),
        )
        observation = prompts.with_stop(
            self.format.join(turn.parts), ending.stop if ending is not None else None
        )
        info = self._info(turn.errors)
        if kind == CALLS:
            info["tool_results"] = turn.results
        if turn.notes:
            info[NOTE] = "\n".join(turn.notes)
        if ending is None:
            return self._clip(observation), self._ledger.take_step(), False, False, info
        return self._ended(self._clip(observation), ending, turn, info)

    def _ended(
        self, observation: str, ending: Ending, turn: _Turn, info: dict[str, Any]
    ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """A limit ended the episode: settle it unanswered; a single-turn env terminates."""
        self._settle(None)
        info.update(self._info(turn.errors))
        info["failure_mode"] = "success" if self._success else ending.failure_mode
        info["end_reason"] = ending.end_reason
        info["error_counts"] = dict(self._error_counts)
        single_turn = self.max_turns == 1
        return observation, self._ledger.take_step(), single_turn, not single_turn, info

    def _graded(
        self, answer: _Answer, observation: str | None = None
    ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Grade the answer; the episode terminates (the last observation: `observation`, by
        default the verdict)."""
        response, tagged, grade = answer
        self._ledger.answered(grade, tagged)
        self._grade, self._tagged = grade, tagged
        self._settle(grade)
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
        if observation is None:
            observation = prompts.verdict(grade, answer_text(self._current_task().answer))
        return self._clip(observation), self._ledger.take_step(), True, False, info

    # ---- helpers -------------------------------------------------------------------------------

    def _grade_response(self, response: Any, tagged: bool) -> _Answer:
        """The response graded. Unreadable from the grader (a plain callable's way to say "no
        answer at all", as a reader's `read` does) reaches the caller: a malformed answer."""
        task = self._current_task()
        grade = to_grade(self._task_grader(response, task, task.state), f"{type(self).__name__}'s grader")
        return _Answer(response, tagged, grade)

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

    def _show(self, turn: _Turn, name: str, call: ParsedCall, text: str) -> None:
        """One call's part of the observation (as the format writes it) and its result text."""
        turn.parts.append(self.format.result(name, call, text))
        turn.results.append(text)

    def _add_tool_metrics(self, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._tool_metrics[name] = self._tool_metrics.get(name, 0.0) + float(value)

    def _clip(self, observation: str) -> str:
        return observation[: self._max_observation_chars]

    def _count_error(self, kind: str, turn: _Turn) -> None:
        """Record one error: counted, penalised, and listed in the step's errors."""
        self._errors += 1
        self._error_counts[kind] = self._error_counts.get(kind, 0) + 1
        self._ledger.error()
        turn.errors.append(kind)

    def _settle(self, grade: Grade | None) -> None:
        """End the episode: the unanswered penalty, final_reward and success; the tools' episode
        state (a persistent interpreter) is let go."""
        self._done = True
        self._end_tool_episodes()
        final = self.final_reward(grade)
        self._ledger.settle(grade is not None, final, f"{type(self).__name__}.final_reward")
        self._success = bool(self.success(grade, self._tagged))

    def _end_tool_episodes(self) -> None:
        for t in self.tools.values():
            if t.end_episode is not None:
                t.end_episode()

    def close(self) -> None:
        """End the tools' episode state (a persistent interpreter's process)."""
        self._end_tool_episodes()
        super().close()

    def credit_state(self) -> Any:
        """Where the episode stands now, for turn-level credit by state (`credit_state` in the step
        info, envs/core/info.py): a JSON scalar fixed by the history so far, or None (the default:
        not declared, and the exact history is used)."""
        return None

    def _info(self, step_errors: list[str]) -> dict[str, Any]:
        grade = self._grade
        state = self.credit_state()
        return {
            **({CREDIT_STATE: state} if state is not None else {}),
            "reward_components": self._ledger.parts,
            "tool_calls": self._tool_calls,
            "errors": self._errors,
            "consecutive_errors": self._consecutive_errors,
            "turn": self._turn,
            "step_errors": step_errors,
            "metrics": {
                **self._tool_metrics,  # the env's own names below win
                "accuracy": grade.score if grade is not None else 0.0,
                "tag_rate": float(grade is not None and self._tagged),
                "success": float(self._success),
                "tool_calls": float(self._tool_calls),
                "env_errors": float(self._errors),
            },
        }


def _noted(text: str) -> str:
    return text.strip()


def _submit(answer: Any) -> Any:
    """Submit the final answer."""
    return answer
