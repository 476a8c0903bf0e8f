"""BFCL's stateful multi-turn tool use as a toolgym env: `toolgym/BFCL-v0`.

    gymnasium.make("toolgym/BFCL-v0", category="base")   # or miss_func, miss_param, long_context, all

The Berkeley Function Calling Leaderboard's multi-turn categories (`bfcl-eval`, installed with
`pip install --no-deps bfcl-eval mpmath`: its own dependencies pull CUDA torch), 200 tasks each.
A seed picks one task (`seed % 200`; reset without a seed draws one). `category="all"` interleaves
the four: seed s plays category `s % 4`, task `(s // 4) % 200`; every step's info names the
task's category as its `metric_group` (envs/core/info.py), so summaries report each category's
accuracy (`by_group/<category>/success`). The task's tools are the
function docs of its classes (GorillaFileSystem, MathAPI, MessageAPI, TwitterAPI, TicketAPI,
TradingBot, TravelAPI, VehicleControlAPI), as JSON-schema tools whose arguments are checked
before the call (a wrong type is `bad_arguments`, that call only), bound to this episode's
instances of the library's simulated classes, loaded from the task's `initial_config`.

One episode is the whole conversation. The first observation is the first user message; the
policy calls tools, and ends its turn by replying without a call (plain text, empty, or an
[ANSWER] tag): the env then speaks as the user again with the next message (step info
`observation_role: "user"`, ToolEnv's: chat templates show it as a user message, the tool
results as tool messages). `miss_func`: the held-out function is added at the turn the data
says, its spec in that turn's user message (as BFCL's prompting mode writes it); it is callable
before, undescribed, as BFCL's executor runs any method of the task's classes (miss_func_49's
ground truth calls `tail` a turn before the data adds it). JSON calls by default; the brackets
format is refused (it cannot write lists and objects).

Grading is BFCL's multi-turn checker, at the end of each user turn whose ground truth has calls:
the ground-truth calls of that turn run on ground-truth instances (state carried from turn to
turn), then `turn_calls` (the policy ran a call this turn), `turn_state` (every instance's public
attributes equal the ground truth's) and `turn_response` (the turn's ground-truth results all
appear among the policy's results so far, as a multiset) each earn `turn_reward / (3 * checked
turns)`. When the last turn ends the conversation is graded: correct (`correct_reward`, metric
`success`) when every checked turn passed all three, BFCL's accuracy. Results are BFCL's strings
(a str as it is, a dict as JSON, else `str()`; an exception `Error during execution: ...`, a
tool_error). Ground-truth call strings are parsed with `ast` (literals only), never evaluated.

Determinism: the classes draw from their own seeded RNGs; TravelAPI's age check reads today's
date, pinned here to TradingBot's CURRENT_TIME (2024-09-01 10:30) through a private copy of its
module, so BFCL's own module is left as it is. A task naming a class this adapter does not run
raises `BFCLTaskError` (one line) at reset; the env takes the next reset.

Where this differs from BFCL: a call whose arguments do not fit the doc is refused before it
runs (BFCL runs it; a task whose own ground truth does that, base_173's `close_ticket(ticket_id=
'ticket_001')`, gets that parameter widened to the type it passes, in that task only); a failed
turn does not end the conversation (later turns still earn their criteria; the task is failed);
BFCL's 20 steps per user turn are not enforced (ToolEnv's `max_turns` and `max_tool_calls` are).

The oracle (`oracle_actions()`) plays each turn's ground-truth calls in one action, then ends the
turn with `TURN_END`; `tools/bfcl_check.py` checks it on every task, and that leaving out any one
call fails the task (`ACCEPTED_WITHOUT`: the one call BFCL's own checker does not need).
"""

from __future__ import annotations

import ast
import copy
import datetime
import importlib
import importlib.util
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import bfcl_eval
from bfcl_eval.constants.executable_backend_config import (
    CLASS_FILE_PATH_MAPPING,
    MULTI_TURN_FUNC_DOC_FILE_MAPPING,
    STATELESS_CLASSES,
)

from ..core.grading import Grade
from ..core.info import METRIC_GROUP
from ..core.task import Task
from ..core.tool_env import ToolEnv, UserTurn
from ..tools.call_formats import ANSWER, EMPTY, OTHER
from ..tools.typed import Call, Tool, ToolCallError, ToolError, check_arguments

CATEGORIES: Final = ("base", "miss_func", "miss_param", "long_context")
ALL: Final = "all"  # every category, interleaved: seed s plays category s % 4, task (s // 4) % 200
# The classes of the multi-turn categories (the library's others need the network or models).
CLASSES: Final = (
    "GorillaFileSystem",
    "MathAPI",
    "MessageAPI",
    "TwitterAPI",
    "TicketAPI",
    "TradingBot",
    "TravelAPI",
    "VehicleControlAPI",
)
DATA: Final = Path(bfcl_eval.__file__).parent / "data"
# BFCL's words (bfcl_eval/constants/default_prompts.py), kept here so its prompt module (which
# the handlers import) is not needed.
INSTRUCTIONS: Final = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls to "
    "achieve the purpose. If none of the functions can be used, point it out. If the given question "
    "lacks the parameters required by the function, also point it out.\n"
    "At each turn, you should try your best to complete the tasks requested by the user within the "
    "current turn. Continue to output functions to call until you have fulfilled the user's request "
    "to the best of your ability. Once you have no more functions to call, the system will consider "
    "the current turn complete and proceed to the next turn or task."
)
FINISH: Final = (
    "When you have no more functions to call, reply in plain text without a tool call: that ends your turn."
)
ADDED_FUNCTIONS: Final = "I have updated some more functions you can choose from. What about now?"
TURN_END: Final = "Done."
EXECUTION_ERROR: Final = "Error during execution: "
# (task id, call index) whose dropping BFCL's own checker still accepts: base_113's turn-1
# get_watchlist() answers exactly what turn 0's add_to_watchlist() did, and the response check
# looks at every result so far. Every other call of the 800 tasks is needed (tools/bfcl_check.py).
ACCEPTED_WITHOUT: Final = frozenset(
    {("multi_turn_base_113", 1), ("multi_turn_miss_func_113", 1), ("multi_turn_miss_param_113", 1)}
)
_TYPES: Final = {"dict": "object", "float": "number", "tuple": "array", "any": None}
_MISSING: Final = object()


class BFCLTaskError(ValueError):
    """A BFCL task this env cannot run (str: one line saying why)."""


# ---- the library's data and classes ----------------------------------------------------------


def _data_file(folder: Path, category: str) -> Path:
    """The newest `BFCL_v*_multi_turn_<category>.json` in `folder`."""
    found = sorted(folder.glob(f"BFCL_v*_multi_turn_{category}.json"))
    if not found:
        raise FileNotFoundError(f"bfcl_eval ships no multi_turn_{category} data under {folder}")
    return found[-1]


def _json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


_TASKS: dict[str, list[tuple[dict[str, Any], list[list[str]]]]] = {}
_DOCS: dict[str, list[dict[str, Any]]] = {}
_CLASS_CACHE: dict[str, type] = {}


def tasks(category: str) -> list[tuple[dict[str, Any], list[list[str]]]]:
    """The category's tasks, in the data's order: (entry, ground truth per turn), read once."""
    if category not in CATEGORIES:
        raise ValueError(f"category must be one of {', '.join(CATEGORIES)}, got {category!r}")
    if category not in _TASKS:
        entries = _json_lines(_data_file(DATA, category))
        answers = {
            a["id"]: a["ground_truth"] for a in _json_lines(_data_file(DATA / "possible_answer", category))
        }
        _TASKS[category] = [(e, answers.get(e["id"], [])) for e in entries]
    return _TASKS[category]


def function_docs(class_name: str) -> list[dict[str, Any]]:
    """The class's function docs (bfcl_eval/data/multi_turn_func_doc), read once."""
    if class_name not in _DOCS:
        _DOCS[class_name] = _json_lines(
            DATA / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]
        )
    return _DOCS[class_name]


class _PinnedDatetime(datetime.datetime):
    """`datetime` whose today() and now() are BFCL's pinned time (TradingBot's CURRENT_TIME)."""

    pinned: datetime.datetime = datetime.datetime(2024, 9, 1, 10, 30)

    @classmethod
    def today(cls) -> _PinnedDatetime:
        return cls.combine(cls.pinned.date(), cls.pinned.time())

    @classmethod
    def now(cls, tz: datetime.tzinfo | None = None) -> _PinnedDatetime:
        return cls.today() if tz is None else cls.today().replace(tzinfo=tz)


def _private_copy(module_name: str) -> ModuleType:
    """A fresh copy of a library module (not in sys.modules), so patching it leaves the library's
    own module as it is."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot find {module_name}")
    private = importlib.util.spec_from_file_location(
        f"toolgym_bfcl_{module_name.rsplit('.', 1)[-1]}", spec.origin
    )
    if private is None or private.loader is None:
        raise ImportError(f"cannot load {module_name}")
    module = importlib.util.module_from_spec(private)
    private.loader.exec_module(module)
    return module


def simulated_class(name: str) -> type:
    """The library's class `name` (TravelAPI with its date pinned). Raises BFCLTaskError for a
    class outside the multi-turn suite or one whose module cannot be imported."""
    if name not in _CLASS_CACHE:
        if name not in CLASSES:
            raise BFCLTaskError(
                f"BFCL class {name!r} is not one this env runs; the classes: {', '.join(CLASSES)}"
            )
        try:
            if name == "TravelAPI":
                trading = importlib.import_module(CLASS_FILE_PATH_MAPPING["TradingBot"])
                _PinnedDatetime.pinned = trading.CURRENT_TIME
                module = _private_copy(CLASS_FILE_PATH_MAPPING[name])
                module.datetime = _PinnedDatetime  # type: ignore[attr-defined]
            else:
                module = importlib.import_module(CLASS_FILE_PATH_MAPPING[name])
        except ImportError as exc:
            raise BFCLTaskError(
                f"BFCL class {name!r} cannot be imported ({exc}); install it with "
                "`pip install --no-deps bfcl-eval mpmath`"
            ) from None
        _CLASS_CACHE[name] = getattr(module, name)
    return _CLASS_CACHE[name]


# ---- calls ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroundTruthCall:
    """One ground-truth call string parsed: the function, its positional and keyword arguments."""

    text: str
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def parse_call(text: str) -> GroundTruthCall:
    """`f(1, b=[2])` as a GroundTruthCall: a plain function name and literal arguments only
    (`ast.literal_eval`); anything else raises BFCLTaskError."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise ValueError("not a call of a function by name")
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            raise ValueError("* or ** arguments")
        args = tuple(ast.literal_eval(a) for a in node.args)
        kwargs = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as exc:
        raise BFCLTaskError(f"ground-truth call {text[:80]!r} cannot be read: {exc}") from None
    return GroundTruthCall(text, node.func.id, args, kwargs)


def result_string(result: Any) -> str:
    """A result as BFCL's executor writes it: a str as it is, a dict as JSON (str() where JSON
    cannot), anything else str()."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


def run_call(
    methods: Mapping[str, Callable[..., Any]], name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[str, bool]:
    """Run one call on the instances' methods: (BFCL's result string, whether it raised)."""
    method = methods.get(name)
    if method is None:
        return f"{EXECUTION_ERROR}name '{name}' is not defined", True
    try:
        return result_string(method(*args, **kwargs)), False
    except Exception as exc:  # the simulated class refusing the call: BFCL's error string
        return f"{EXECUTION_ERROR}{exc}", True


def _public_state(instance: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(instance).items() if not k.startswith("_")}


def same_state(model: Any, truth: Any) -> bool:
    """BFCL's state check for one class: every public attribute of the ground truth's instance
    equals the model's."""
    return all(getattr(model, k, _MISSING) == v for k, v in _public_state(truth).items())


def contains_all(found: Sequence[str], wanted: Sequence[str]) -> bool:
    """Whether every item of `wanted` is in `found`, as multisets (BFCL's unordered subsequence)."""
    left = list(found)
    for item in wanted:
        try:
            left.remove(item)
        except ValueError:
            return False
    return True


def json_schema(schema: Any) -> Any:
    """A BFCL parameter schema as JSON Schema: dict -> object, float -> number, tuple -> array,
    any -> no type; nested properties and items alike."""
    if isinstance(schema, list):
        return [json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            kind = _TYPES.get(value, value)
            if kind is not None:
                out["type"] = kind
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: json_schema(v) for name, v in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "oneOf"):
            out[key] = json_schema(value)
        else:
            out[key] = value
    return out


_JSON_TYPES: Final = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
}


def widened(tool: Tool, arguments: Mapping[str, Any]) -> Tool:
    """`tool`, its parameters also taking the JSON type of each argument in `arguments` that the
    doc's type refuses (a ground-truth call written against its own doc: base_173's
    `close_ticket(ticket_id='ticket_001')`); `tool` itself when every argument fits."""
    properties = dict(tool.parameters.get("properties", {}))
    changed = False
    for name, value in arguments.items():
        prop = properties.get(name)
        if not isinstance(prop, dict) or "type" not in prop:
            continue
        try:
            check_arguments({name: value}, {"type": "object", "properties": {name: prop}})
        except ToolCallError:
            declared = prop["type"] if isinstance(prop["type"], list) else [prop["type"]]
            properties[name] = {**prop, "type": [*declared, _JSON_TYPES.get(type(value), "string")]}
            changed = True
    if not changed:
        return tool
    parameters = {**tool.parameters, "properties": properties}
    return Tool.from_schema(tool.name, tool.description, parameters, tool.fn)


# ---- the episode ---------------------------------------------------------------------------


def _instances(classes: Sequence[str], config: Mapping[str, Any], long_context: bool) -> dict[str, Any]:
    made = {}
    for name in classes:
        instance = simulated_class(name)()
        if name not in STATELESS_CLASSES:
            instance._load_scenario(copy.deepcopy(config.get(name, {})), long_context=long_context)
        made[name] = instance
    return made


def _methods(instances: Mapping[str, Any]) -> dict[str, Callable[..., Any]]:
    """Public methods by name, a later class's winning a clash (as BFCL's executor maps them)."""
    methods: dict[str, Callable[..., Any]] = {}
    for instance in instances.values():
        for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
            if not name.startswith("_"):
                methods[name] = method
    return methods


@dataclass(slots=True)
class Conversation:
    """One episode's state (`env.state`): the task, the policy's and the ground truth's instances,
    and how far the conversation is."""

    task_id: str
    messages: list[str]  # the user's message per turn ("" at a held-out-function turn)
    ground_truth: list[list[GroundTruthCall]]
    missed: dict[int, list[str]]  # turn -> functions added at it
    model: dict[str, Any]
    truth: dict[str, Any]
    model_methods: dict[str, Callable[..., Any]]
    truth_methods: dict[str, Callable[..., Any]]
    turn: int = 0
    turn_calls: int = 0
    results: list[str] = field(default_factory=list)  # the policy's results, all turns
    checked: int = 0  # turns graded so far
    failed: list[int] = field(default_factory=list)  # turns that failed a criterion

    @property
    def checked_turns(self) -> int:
        return sum(1 for calls in self.ground_truth if calls)


class BFCLEnv(ToolEnv):
    """`gymnasium.make("toolgym/BFCL-v0", category="base", **toolenv_knobs)`; see the module doc.

    Knobs: category (base, miss_func, miss_param, long_context, or all: seed s plays category
    s % 4, task s // 4; each step's info names the category as its `metric_group`), turn_reward (the per-turn
    criteria's total over the conversation), and ToolEnv's (tool_format defaults to json)."""

    def __init__(
        self,
        category: str = "base",
        *,
        turn_reward: float = 0.5,
        tool_format: str = "json",
        max_turns: int = 100,
        max_tool_calls: int = 200,
        format_reward: float = 0.0,
        tool_call_penalty: float = 0.0,
        max_action_chars: int = 16384,
        max_observation_chars: int = 32768,
        **knobs: Any,
    ):
        if "tools" in knobs or "instructions" in knobs:
            raise ValueError("BFCLEnv's tools and instructions come from the task")
        if tool_format == "brackets":
            raise ValueError(
                "BFCLEnv's tools take lists, objects and free text, which the brackets format cannot "
                "write; use json, pythonic, llama3_json, mistral or qwen3_coder"
            )
        if not isinstance(turn_reward, int | float) or isinstance(turn_reward, bool) or turn_reward < 0:
            raise ValueError(f"turn_reward must be a float >= 0, got {turn_reward!r}")
        self.category = category
        if category == ALL:
            per_category = [tasks(c) for c in CATEGORIES]
            self.tasks = [found[k] for k in range(min(map(len, per_category))) for found in per_category]
        else:
            self.tasks = tasks(category)
        self._task_category = category if category != ALL else CATEGORIES[0]
        self.turn_reward = float(turn_reward)
        self._tool_cache: dict[str, Tool] = {}
        self._hidden: set[str] = set()  # held-out functions not yet described (miss_func)
        self._conversation: Conversation | None = None
        self._seed: int | None = None
        super().__init__(
            tools=[],
            instructions=INSTRUCTIONS,
            tool_format=tool_format,
            max_turns=max_turns,
            max_tool_calls=max_tool_calls,
            format_reward=format_reward,
            tool_call_penalty=tool_call_penalty,
            max_action_chars=max_action_chars,
            max_observation_chars=max_observation_chars,
            **knobs,
        )

    # ---- tools -------------------------------------------------------------------------------

    def _tool(self, doc: Mapping[str, Any]) -> Tool:
        """The function doc as a tool calling this episode's instance (built once per env)."""
        name = doc["name"]
        if name not in self._tool_cache:
            parameters = json_schema(doc.get("parameters", {}))
            parameters = {**parameters, "type": "object", "additionalProperties": False}
            description = " ".join(str(doc.get("description", "")).split()) or name

            def run(**arguments: Any) -> str:
                return self._execute(name, arguments)

            self._tool_cache[name] = Tool.from_schema(name, description, parameters, run)
        return self._tool_cache[name]

    def _execute(self, name: str, arguments: dict[str, Any]) -> str:
        conversation = self._current()
        text, raised = run_call(conversation.model_methods, name, (), arguments)
        conversation.results.append(text)
        conversation.turn_calls += 1
        if raised:
            raise ToolError(text)
        return text

    def _current(self) -> Conversation:
        if self._conversation is None:
            raise RuntimeError("BFCLEnv: call reset() first")
        return self._conversation

    # ---- the task ----------------------------------------------------------------------------

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        self._seed = seed
        return super().reset(seed=seed, options=options)

    def new_task(self) -> Task:
        if self._seed is not None:
            index = self._seed % len(self.tasks)
        else:
            index = int(self.np_random.integers(len(self.tasks)))
        entry, truth = self.tasks[index]
        self._task_category = CATEGORIES[index % len(CATEGORIES)] if self.category == ALL else self.category
        self._conversation = None
        conversation = self._conversation_of(entry, truth)
        named = [[self._named_call(conversation, c) for c in calls] for calls in conversation.ground_truth]
        tools = {d["name"]: self._tool(d) for name in entry["involved_classes"] for d in function_docs(name)}
        for call in (c for calls in named for c in calls):
            if call.name in tools:
                tools[call.name] = widened(tools[call.name], call.arguments)
        self._hidden = {name for names in conversation.missed.values() for name in names}
        self.set_tools(
            [t for name, t in tools.items() if name not in self._hidden], INSTRUCTIONS, finish=FINISH
        )
        self.set_tools(list(tools.values()))  # the held-out ones callable, not described (module doc)
        self._conversation = conversation
        solution: list[Call | list[Call] | str] = []
        for turn, calls in enumerate(named):
            if calls:
                solution.append(calls)
            if turn < len(named) - 1:
                solution.append(TURN_END)
        return Task(
            conversation.messages[0],
            None,
            solution=solution,
            needed_tool_calls=sum(len(calls) for calls in conversation.ground_truth),
            state=conversation,
        )

    def _conversation_of(self, entry: Mapping[str, Any], truth: list[list[str]]) -> Conversation:
        task_id = str(entry.get("id", "?"))
        classes = list(entry.get("involved_classes", []))
        for name in classes:
            simulated_class(name)  # an unknown class: BFCLTaskError, this task only
        questions = entry.get("question", [])
        if len(questions) != len(truth) or not questions:
            raise BFCLTaskError(
                f"BFCL task {task_id}: {len(questions)} user turns but ground truth for {len(truth)}"
            )
        messages = ["\n\n".join(str(m.get("content", "")) for m in turn) for turn in questions]
        missed = {int(turn): list(names) for turn, names in entry.get("missed_function", {}).items()}
        long_context = "long_context" in task_id
        config = entry.get("initial_config", {})
        try:
            model = _instances(classes, config, long_context)
            truth_instances = _instances(classes, config, long_context)
        except BFCLTaskError:
            raise
        except Exception as exc:  # the library's loader refusing the data
            raise BFCLTaskError(
                f"BFCL task {task_id}: its initial_config cannot be loaded: {exc!r:.200}"
            ) from None
        return Conversation(
            task_id=task_id,
            messages=messages,
            ground_truth=[[parse_call(c) for c in calls] for calls in truth],
            missed=missed,
            model=model,
            truth=truth_instances,
            model_methods=_methods(model),
            truth_methods=_methods(truth_instances),
        )

    @staticmethod
    def _named_call(conversation: Conversation, call: GroundTruthCall) -> Call:
        """The ground-truth call with its positional arguments named (by the method's signature)."""
        method = conversation.model_methods.get(call.name)
        if not call.args or method is None:
            return Call(call.name, dict(call.kwargs))
        try:
            bound = inspect.signature(method).bind(*call.args, **call.kwargs)
        except TypeError as exc:
            raise BFCLTaskError(
                f"ground-truth call {call.text[:80]!r} does not fit {call.name}: {exc}"
            ) from None
        return Call(call.name, dict(bound.arguments))

    @property
    def tool_specs(self) -> list[dict[str, Any]]:
        """The described tools' specs (held-out functions only from the turn that adds them)."""
        return [t.spec for t in self.tools.values() if t.name not in self._hidden]

    # ---- the conversation --------------------------------------------------------------------

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """ToolEnv's step; its info names the task's category as the metric group (envs/core/info.py),
        so that a summary over several categories reports each one's accuracy."""
        observation, reward, terminated, truncated, info = super().step(action)
        info[METRIC_GROUP] = self._task_category
        return observation, reward, terminated, truncated, info

    def abandon(self) -> tuple[float, dict[str, Any]]:
        reward, info = super().abandon()
        return reward, {**info, METRIC_GROUP: self._task_category}

    def user_turn(self, kind: str, action: str) -> UserTurn | None:
        """A reply without a call ends the policy's turn: grade it, then the next user message."""
        if kind not in (OTHER, EMPTY, ANSWER):
            return None
        conversation = self._current()
        rewards, check = self._check_turn(conversation)
        conversation.turn += 1
        conversation.turn_calls = 0
        info: dict[str, Any] = {"bfcl_turn": check}
        if conversation.turn >= len(conversation.messages):
            passed = not conversation.failed
            verdict = "CORRECT" if passed else f"INCORRECT (failed turns: {conversation.failed})"
            return UserTurn(verdict, Grade(1.0 if passed else 0.0), rewards, info)
        return UserTurn(self._next_message(conversation), None, rewards, info)

    def _check_turn(self, conversation: Conversation) -> tuple[dict[str, float], dict[str, Any]]:
        """Run this turn's ground truth; BFCL's three checks where it has calls."""
        turn = conversation.turn
        expected = [
            run_call(conversation.truth_methods, c.name, c.args, c.kwargs)[0]
            for c in conversation.ground_truth[turn]
        ]
        check: dict[str, Any] = {"turn": turn, "checked": bool(expected)}
        if not expected:  # a turn the policy cannot fulfil: BFCL checks nothing here
            return {}, check
        criteria = {
            "turn_calls": conversation.turn_calls > 0,
            "turn_state": all(
                same_state(conversation.model[name], truth) for name, truth in conversation.truth.items()
            ),
            "turn_response": contains_all(conversation.results, expected),
        }
        conversation.checked += 1
        if not all(criteria.values()):
            conversation.failed.append(turn)
        share = self.turn_reward / (len(criteria) * conversation.checked_turns)
        check.update(criteria)
        return {name: share if ok else 0.0 for name, ok in criteria.items()}, check

    def _next_message(self, conversation: Conversation) -> str:
        """The user's next message; at a held-out-function turn the added functions' specs and
        BFCL's line, the functions now callable."""
        turn = conversation.turn
        added = conversation.missed.get(turn)
        message = conversation.messages[turn]
        if not added:
            return message
        new_tools = [t for t in self.tools.values() if t.name in added]
        self._hidden -= set(added)
        specs = "\n".join(json.dumps(t.spec, ensure_ascii=False) for t in new_tools)
        return "\n".join(part for part in (specs, message, ADDED_FUNCTIONS) if part)

    def answer_action(self, answer: Any, tagged: bool = True) -> str:
        """The end of the policy's turn: a reply without a call."""
        return TURN_END

    def mistaken_actions(self) -> tuple[str, ...]:
        """The format's mistakes, less those that here simply end the turn (no call)."""
        ends = (OTHER, EMPTY, ANSWER)
        return tuple(a for a in super().mistaken_actions() if self.format.parse(a, None).kind not in ends)


def actions_without(env: BFCLEnv, drop: int) -> list[str]:
    """The oracle's actions for the current task with its `drop`-th ground-truth call (counted
    over the whole conversation) left out: the check that every call is needed."""
    actions, seen = [], 0
    for step in env.task.solution:
        if isinstance(step, str):
            actions.append(step)
            continue
        calls = [step] if isinstance(step, Call) else list(step)
        kept = [c for i, c in enumerate(calls, seen) if i != drop]
        seen += len(calls)
        if kept:
            actions.append(env.format.render_calls(env.tools, kept))
    return [*actions, env.answer_action(env.answer)]


def play(env: BFCLEnv, actions: Sequence[str]) -> bool:
    """Play `actions` in the current episode; whether the conversation ended graded correct."""
    for action in actions:
        _, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            return bool(terminated and info["metrics"]["success"] == 1.0)
    return False
