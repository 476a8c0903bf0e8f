"""The `info` contract: what the rollout runner reads from an env's `reset` and `step` infos.

This is the one place that lists it. The runner (rollouts/), replay and the training loop read
these keys and nothing else; every other key an env puts in `info` is recorded as it is (made
JSON-safe) and never interpreted. All keys are optional.

reset info:
    system_prompt   str: rendered as the system message before the first observation.
    tools           [OpenAI-style function spec]: the env's tools, for a chat template that writes
                    its own tools block (then it uses `instructions`, not system_prompt). Only
                    where the env takes calls as that block teaches them (JSON): a bracket
                    env's tools are taught by its system prompt, which every renderer then gets.
    instructions    str: the system prompt without the env's own description of its tools.

step info:
    tool_results    [str]: when the action made tool calls, each handled call's result text, in
                    order (what the observation shows per call), for a chat template that renders
                    one tool message per result.
    observation_role  "user" or "tool": the chat role of this step's observation, over the run's
                    `rollout.observation_role` (which covers every reply that names none). An env
                    whose user speaks again mid-episode says "user" (ToolEnv's `user_turn`, BFCL's
                    next request); tool messages per `tool_results` stay `tool` messages. Any
                    other value ends the episode as an env error. Recorded, so replay and the chat
                    export render the step in the same role (`reply_role`,
                    rollouts/episode/rendering.py).

    credit_state    str (or any JSON scalar): a summary of where the episode stands after this
                    step, determined by the history so far, e.g. Zorplex's chain links followed
                    and strayed. Turn-level credit `credit = "turn_state"`
                    (rollouts/scoring/credit.py) takes the next turn's baseline from the group's
                    episodes in the same state.

    note            str: the note the action wrote (a ToolEnv with notes=True): the `notes` context
                    policy (rollouts/context.py) then cuts the conversation to the system prompt,
                    the task and the note turns.

An env may also declare a context policy through its `context_policy` hook (envs/core/text_env.py,
beside `step_waits` and `abandon()`): a spec dict such as {"policy": "notes"} or {"policy":
"window", "turns": 4} (rollouts/context.py), which the runner applies unless the run config sets
`rollout.context`.

step info, read by the runner (and the info of the optional `abandon()`, envs/core/tool_env.py):
    reward_components  {name: float}: the episode's reward split into named parts, so far. The last
                    one reported becomes `Trajectory.reward_components`; their sum should equal the
                    sum of the step rewards. Summaries report each name's mean over the batch's
                    episodes as `rollout/reward/<name>`, `eval/reward/<name>` (0 for an episode
                    that never reported it); names are non-empty printable strings without `/`
                    (else the episode ends as an env error).
    metrics         {name: float}: the env's own metrics of the episode so far (a bool counts as
                    0/1). Per name, the last value reported is the episode's (`Trajectory.metrics
                    ["env"]`). The rollout, eval and replay summaries report the mean over the
                    batch's episodes as `rollout/<name>` and `eval/<name>` (an episode that never
                    reported a name counts 0, so a 0/1 metric's mean is a rate over all
                    episodes); the training loop logs and plots every name, and the console
                    shows those a config names in `logging.headline_metrics`. Names are
                    identifiers (no `/`) other than the runner's own (`RUNNER_METRICS` in
                    rollouts/metrics.py); a value that is not a finite number, or a reserved
                    name, ends the episode as an env error. By convention `success` is 1.0 when
                    the episode fully reached its goal: `sft.only_successful` keeps those.
    end_reason      str: why the env ended the episode, one of answered, no_tool_call, max_turns,
                    parse_error (the StopReason values the env may give); other values map to
                    answered (terminated) or max_turns (truncated).
    metric_group    str: the group the episode belongs to for reporting (BFCL's category): the
                    last one reported is the episode's (`Trajectory.metrics["metric_group"]`), and
                    the summaries also report each env metric's mean over the episodes of each
                    group as `<prefix>by_group/<group>/<name>`, with the group's episode count as
                    `<prefix>by_group/<group>/episodes` (a mean over the group, not over the
                    batch). Groups are non-empty printable strings without '/'.
    failure_mode    str: a short label of how the episode ended (ToolEnv: success, wrong_format,
                    wrong_answer, goal_not_met, tool_spam, no_answer). Summaries count each label
                    (`failure_mode/<label>`) and evals pick example transcripts of distinct labels.

Written by `TextEnv` itself (envs/core/text_env.py), recorded, not read by the runner:
    replaced_chars  int: surrogate code points replaced by U+FFFD in this step's action and
                    observation (or the reset observation), present only when > 0: text that
                    UTF-8 cannot encode never crosses the env boundary.

The runner writes `error` (ERROR: the step raised or returned an unusable output),
`abandon_error` (ABANDON_ERROR: the env's `abandon()` did), `sequence_start` (a chat template
re-rendered the history, or a context policy rewrote it: a new training sequence starts here)
and `context_rewrite` (it was the context policy) into a transition's info itself; an env should
not use those keys.

The scripted oracle (rollouts/scripted.py) plays an env through `TextEnv`'s oracle methods
(`oracle_actions`, `malformed_action`, `answer_action`), so it knows no env's action grammar.
"""

from __future__ import annotations

from typing import TypedDict


class ResetInfo(TypedDict, total=False):
    """The reset-info keys the runner reads (see the module doc)."""

    system_prompt: str
    tools: list[dict[str, object]]
    instructions: str


class StepInfo(TypedDict, total=False):
    """The step-info keys the runner reads (see the module doc)."""

    reward_components: dict[str, float]
    metrics: dict[str, float]
    end_reason: str
    failure_mode: str
    metric_group: str
    observation_role: str


SYSTEM_PROMPT = "system_prompt"
NOTE = "note"
CREDIT_STATE = "credit_state"
TOOLS = "tools"
INSTRUCTIONS = "instructions"
TOOL_RESULTS = "tool_results"
OBSERVATION_ROLE = "observation_role"
OBSERVATION_ROLES = ("user", "tool")
REWARD_COMPONENTS = "reward_components"
METRICS = "metrics"
END_REASON = "end_reason"
FAILURE_MODE = "failure_mode"
METRIC_GROUP = "metric_group"
SUCCESS_METRIC = "success"
REPLACED_CHARS = "replaced_chars"
# Written by the runner into a transition's info (see above), never by an env.
ERROR = "error"
ABANDON_ERROR = "abandon_error"

__all__ = [
    "ABANDON_ERROR",
    "CREDIT_STATE",
    "END_REASON",
    "ERROR",
    "FAILURE_MODE",
    "INSTRUCTIONS",
    "METRICS",
    "METRIC_GROUP",
    "NOTE",
    "OBSERVATION_ROLE",
    "OBSERVATION_ROLES",
    "REPLACED_CHARS",
    "REWARD_COMPONENTS",
    "SUCCESS_METRIC",
    "SYSTEM_PROMPT",
    "TOOLS",
    "TOOL_RESULTS",
    "ResetInfo",
    "StepInfo",
]
