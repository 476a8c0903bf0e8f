"""Replaying recordings: readable transcripts, summaries, verification, and Episodes to train on.

Transcripts show the exact token stream the model saw, decoded turn by turn: the prompt and env
spans as they are, and the spans the policy SAMPLED (the loss-masked, trained tokens) marked:
in colour on a terminal (rich), and between `⟦` and `⟧` in plain text. A line after each turn
gives the step's reward and the env's metrics so far; the header gives the stop reason, reward
and its components, and the episode's env metrics.

Verification re-runs each episode through the runner's own episode loop (rollouts/episode/:
`replay_episode`, a fresh env made from the recorded id and kwargs, reset with the recorded task
seed, fed the recorded actions), so it steps, ends and settles the episode by the runner's rules
(a turn cut by a token limit is never given to the env; a step is checked by `step_env`; an
episode a runner limit ended is settled, its reward on the last turn), and reports every
observation, reward or end flag that differs, and every trajectory-level field training reads
(total_reward, reward_components, stop_reason) that disagrees with the steps or the re-run.
Given the recording's tokenizer, verification also
checks the tokens training reads against that text (`verify_tokens`), through the renderer the
recording was made with (`recorded_renderer`: the chat template its header records, or plain
ChatML).

A recording never causes an import: gymnasium imports the module of a `module:Env-v0` id, so
verification makes only envs whose module is already imported (toolgym's own, and modules the
user names, `--env-module`); any other such id is refused, naming the module (`check_env_id`).
"""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Iterable, Sequence

import gymnasium
from rich.text import Text
from tokenizers import Tokenizer

from ... import envs  # noqa: F401 (registers the toolgym/* envs with gymnasium)
from ...agents.chat import ChatRenderer, Renderer
from ...agents.harmony import HARMONY, HarmonyRenderer
from ...agents.types import Role
from ...envs.core.info import ABANDON_ERROR, ERROR, METRICS, REWARD_COMPONENTS, SUCCESS_METRIC
from ...envs.registry import EnvModuleNotAllowed, check_env_id
from ..context import context_policy
from ..episode.context import EpisodeContext
from ..episode.loop import EpisodeState
from ..episode.match import seated_game
from ..episode.recorded import RecordedActor, replay_episode, replay_match
from ..episode.rendering import env_replies, first_messages
from ..episodes import Advantage, EpisodeStats, OverlongEpisodeRule, build_episodes
from ..metrics import batch_metrics
from ..scoring.advantages import AdvantageConfig
from ..scoring.distill import DistillConfig
from ..scoring.scorer import score_recorded
from ..types import CONTEXT_REWRITE, CUT_TURN_STEPPED, SEQUENCE_START, Episode, StopReason, Trajectory
from .format import CHAT_TEMPLATE, RecordingError, RecordingHeader

SAMPLED_OPEN, SAMPLED_CLOSE = "⟦", "⟧"
_STYLES = {"prompt": "", "sampled": "bold green", "note": "dim italic", "header": "bold cyan"}


def transcript_segments(trajectory: Trajectory, renderer: Renderer) -> list[tuple[str, str]]:
    """(text, kind) pieces of one episode's transcript; kind: header, prompt, sampled, note."""
    t = trajectory
    components = ", ".join(f"{k} {v:+.2f}" for k, v in t.reward_components.items())
    header = (
        f"=== {t.env_id} {t.env_kwargs}  task seed {t.task_seed}  group {t.group_id}"
        f"  sample {t.sample_index}  policy v{t.policy_version}"
        f"{f'  seat {t.seat}' if t.seat else ''}{'' if t.trained else ' (not trained: an opponent seat)'}"
        f"{' (played by the env oracle: a guided sample)' if t.guided else ''}\n"
        f"stop: {t.stop_reason.value}  reward {t.total_reward:+.3f} ({components or 'no components'})"
        f"  turns {len(t.transitions)}  failure mode: {t.metrics.get('failure_mode')}"
        f"  metrics: {_format_metrics(t.metrics.get('env'))}\n"
    )
    if t.error:
        header += f"error: {t.error}\n"
    pieces: list[tuple[str, str]] = [(header, "header")]
    for i, transition in enumerate(t.transitions):
        if i and transition.info.get(SEQUENCE_START) is True:
            rewrite = transition.info.get(CONTEXT_REWRITE)
            why = "the context policy rewrote" if rewrite else "the chat template re-rendered"
            pieces.append((f"    [a new segment: {why} the history]\n", "note"))
        pieces.append((renderer.decode(transition.observation_tokens), "prompt"))
        pieces.append((renderer.decode(transition.action.tokens), "sampled"))
        info = transition.info
        if _raised_when_recorded(t, i):
            note = f"env raised: {info['error']}"
        elif not _was_stepped(t, i):
            note = f"not given to the env (finish: {transition.action.finish_reason})"
        else:
            note = f"reward {transition.reward:+.3f}  {_format_metrics(info.get(METRICS))}"
        pieces.append((f"\n    [turn {i}: {note}]\n", "note"))
    if t.final_observation:
        pieces.append((f"    [env's last reply, not shown to the model: {t.final_observation!r}]\n", "note"))
    return pieces


def _format_metrics(metrics: object) -> str:
    """An env's metrics as `name 1, other 2` (`-` when it reported none)."""
    if not isinstance(metrics, dict) or not metrics:
        return "-"
    return ", ".join(
        f"{name} {value:g}" if isinstance(value, int | float) else f"{name} {value!r}"
        for name, value in metrics.items()
    )


def format_transcript(trajectory: Trajectory, renderer: Renderer) -> str:
    """Plain text: sampled spans between ⟦ and ⟧."""
    return "".join(
        f"{SAMPLED_OPEN}{text}{SAMPLED_CLOSE}" if kind == "sampled" else text
        for text, kind in transcript_segments(trajectory, renderer)
    )


def rich_transcript(trajectory: Trajectory, renderer: Renderer) -> Text:
    """For a terminal: sampled spans in colour."""
    out = Text()
    for text, kind in transcript_segments(trajectory, renderer):
        out.append(text, style=_STYLES[kind])
    return out


def summarize(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """`batch_metrics` without the prefix: reward mean, the env's metrics, turns, stop reasons,
    failure modes."""
    return {k.removeprefix("rollout/"): v for k, v in batch_metrics(trajectories).items()}


# ---- verification ------------------------------------------------------------------------------


def errored(trajectory: Trajectory) -> bool:
    """Whether an episode is error-only: it ended in an env error (stop reason env_error) or has
    no steps. `record` fails when every episode is; `replay --verify` counts them as errors, never
    as replaying exactly."""
    return trajectory.stop_reason == StopReason.ENV_ERROR or not trajectory.transitions


def _was_stepped(trajectory: Trajectory, index: int) -> bool:
    """Whether the runner gave transition `index`'s action to the env: all but a last turn that
    did not end on a stop token (cut by a limit, or aborted), unless the loop says it stepped that
    cut turn (`cut_turn_stepped`)."""
    last = index == len(trajectory.transitions) - 1
    transition = trajectory.transitions[index]
    return not (last and transition.action.finish_reason != "stop" and CUT_TURN_STEPPED not in transition.info)


def _raised_when_recorded(trajectory: Trajectory, index: int) -> bool:
    last = index == len(trajectory.transitions) - 1
    return (
        last
        and trajectory.stop_reason == StopReason.ENV_ERROR
        and ERROR in trajectory.transitions[index].info
    )


# Reasons only the env gives (through end_reason); the runner's own limits never end an episode so.
_ENV_STOP_REASONS = frozenset({StopReason.ANSWERED, StopReason.NO_TOOL_CALL, StopReason.PARSE_ERROR})


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def verify_trajectory(trajectory: Trajectory) -> list[str]:
    """Differences between the recording and a fresh env fed the recorded actions ([] if none).

    Per step: the observation, reward and end flags. Per episode (what training reads): total_reward
    against the sum of the recorded step rewards and the re-run's, reward_components against the
    re-run's last reported ones, and stop_reason against how the re-run ended (the runner's
    mapping when the env ended it; otherwise a reason of the runner's, consistent with a cut last
    turn's finish reason). The re-run is the episode loop's (`replay_episode`). An env id that
    would import a module is reported, not made (`check_env_id`)."""
    t, problems = trajectory, _sum_problems(trajectory)
    try:
        check_env_id(t.env_id)
    except EnvModuleNotAllowed as exc:
        return [*problems, str(exc)]
    if t.seat:  # its env's replies held another seat's moves, which a lone env re-run cannot
        return [
            *problems,
            f"seat {t.seat!r} of a match whose other seats are not in the recording: not verified",
        ]
    return problems + _rerun_problems(t, *replay_episode(t))


def verify_match(trajectories: Sequence[Trajectory]) -> list[list[str]]:
    """`verify_trajectory` for every seat of one recorded match, its seats played again together
    (`replay_match`); one list of problems per trajectory, in order."""
    problems = [_sum_problems(t) for t in trajectories]
    try:
        check_env_id(trajectories[0].env_id)
        reruns = replay_match(trajectories)
    except (EnvModuleNotAllowed, ValueError, gymnasium.error.Error) as exc:
        return [
            [*p, f"seat {t.seat!r}: its match cannot be replayed: {exc}"]
            for p, t in zip(problems, trajectories, strict=True)
        ]
    return [
        p + _rerun_problems(t, *rerun) for p, t, rerun in zip(problems, trajectories, reruns, strict=True)
    ]


def match_key(t: Trajectory) -> tuple:
    """What the seats of one recorded match share: the env, its kwargs, the task seed and the
    sample index."""
    return (t.env_id, json.dumps(t.env_kwargs, sort_keys=True, default=str), t.task_seed, t.sample_index)


def game_seats(env_id: str, env_kwargs: dict) -> int:
    """How many seats the recorded env's game has (1 for an env that is no game of seats, or
    whose id imports a module: its seats are then checked one by one)."""
    try:
        check_env_id(env_id)
        return len(seated_game(env_id, env_kwargs).seats)
    except (EnvModuleNotAllowed, ValueError, gymnasium.error.Error):
        return 1


def _sum_problems(t: Trajectory) -> list[str]:
    steps_sum = math.fsum(tr.reward for tr in t.transitions)
    if not _close(t.total_reward, steps_sum):
        return [f"total_reward {t.total_reward!r} != the sum of its step rewards {steps_sum!r}"]
    return []


def _rerun_problems(t: Trajectory, rerun: EpisodeState, actor: RecordedActor) -> list[str]:
    """The recording against its re-run (verify_trajectory's doc)."""
    problems: list[str] = []
    if actor.reset is None:
        if t.stop_reason == StopReason.ENV_ERROR and not t.transitions:
            return problems  # it failed at reset when recorded, and still does
        return [*problems, f"env make/reset raised {rerun.error}"]
    observation, system_prompt = actor.reset
    if t.transitions and observation != t.transitions[0].observation:
        problems.append(f"reset observation differs: {observation!r} != {t.transitions[0].observation!r}")
    if system_prompt != t.system_prompt:
        problems.append("system prompt differs")
    again = rerun.transitions  # the re-run's turns: the recorded actions, until the loop ended it
    rewards: dict[int, float] = {}  # turn -> the reward the re-run gives it
    complete = True  # the re-run went as recorded (no unexpected raise)
    for i, transition in enumerate(t.transitions):
        if i >= len(again):
            break
        flags = (again[i].terminated, again[i].truncated)
        recorded_flags = (transition.terminated, transition.truncated)
        if not _was_stepped(t, i):  # a cut turn: the env never saw it, so it never ended there
            if flags != recorded_flags:
                problems.append(f"turn {i}: (terminated, truncated) differs: {flags} != {recorded_flags}")
            break
        recorded_error = _raised_when_recorded(t, i)
        if i == len(again) - 1 and rerun.stop_reason == StopReason.ENV_ERROR and ERROR in again[i].info:
            if not recorded_error:
                problems.append(f"turn {i}: step raised {again[i].info[ERROR]}")
                complete = False
            break
        if recorded_error:
            problems.append(f"turn {i}: the env raised when recorded, not now")
            complete = False
            break
        rewards[i] = again[i].reward
        expected = t.transitions[i + 1].observation if i + 1 < len(t.transitions) else t.final_observation
        shown = again[i + 1].observation if i + 1 < len(again) else rerun.final_observation
        if (i + 1 < len(t.transitions) or t.final_observation) and shown != expected:
            problems.append(f"turn {i}: observation differs: {shown!r} != {expected!r}")
        if flags != recorded_flags:
            problems.append(f"turn {i}: (terminated, truncated) differs: {flags} != {recorded_flags}")
    # The loop's settlement of an episode a runner limit ended (env_io.abandon_env) lands on the last turn.
    last = len(t.transitions) - 1
    abandon_failed = (
        t.stop_reason == StopReason.ENV_ERROR and last >= 0 and ABANDON_ERROR in t.transitions[last].info
    )
    if complete and rerun.abandoned:
        if ABANDON_ERROR in again[-1].info:
            if not abandon_failed:
                problems.append(f"abandon() raised {again[-1].info[ABANDON_ERROR]}")
        elif abandon_failed:
            problems.append("abandon() raised when recorded, not now")
        elif rerun.settled:
            rewards[len(again) - 1] = again[-1].reward
    for i, reward in sorted(rewards.items()):
        if reward != t.transitions[i].reward:
            problems.append(f"turn {i}: reward differs: {reward!r} != {t.transitions[i].reward!r}")
    if complete:
        reported = any(REWARD_COMPONENTS in tr.info for tr in again)  # by a step, or by the settlement
        ending = rerun.stop_reason if again and (again[-1].terminated or again[-1].truncated) else None
        components = rerun.reward_components if reported else None
        problems += _episode_problems(t, math.fsum(rewards.values()), components, ending)
    return problems


def _episode_problems(
    t: Trajectory, rerun_total: float, components: dict[str, float] | None, ending: StopReason | None
) -> list[str]:
    """The trajectory-level fields against a re-run that went as recorded."""
    problems = []
    if not _close(t.total_reward, rerun_total):
        problems.append(f"total_reward {t.total_reward!r} != the re-run's {rerun_total!r}")
    if components is not None and (
        components.keys() != t.reward_components.keys()
        or not all(_close(v, t.reward_components[k]) for k, v in components.items())
    ):
        problems.append(f"reward_components differ: {t.reward_components} != the re-run's {components}")
    if ending is not None:
        if t.stop_reason != ending:
            problems.append(
                f"stop_reason {t.stop_reason.value} != {ending.value}, how the env ended the re-run"
            )
    elif t.stop_reason in _ENV_STOP_REASONS:
        problems.append(f"stop_reason {t.stop_reason.value}, but the env did not end the re-run")
    elif (
        t.transitions
        and t.transitions[-1].action.finish_reason in ("length", "abort")
        and CUT_TURN_STEPPED not in t.transitions[-1].info
    ):
        finish = t.transitions[-1].action.finish_reason
        allowed = (
            {StopReason.TIMEOUT}
            if finish == "abort"
            else {StopReason.MAX_TOKENS, StopReason.CONTEXT_OVERFLOW, StopReason.ENV_ERROR}
        )
        if t.stop_reason not in allowed:
            problems.append(f"stop_reason {t.stop_reason.value}, but the last turn was cut ({finish})")
    return problems


def recorded_renderer(
    header: RecordingHeader, tokenizer: Tokenizer, path: str | os.PathLike = ""
) -> Renderer:
    """The renderer a recording was made with, rebuilt from its header (`path` names the file in
    errors): a `TemplateRenderer` of the chat template it records (`extra["chat_template"]`,
    rollouts/recording/format.py: the recorded text runs in the sandbox, as every template does),
    harmony's renderer with its recorded options, or plain ChatML when it records none. Raises RecordingError for an entry that is not a recorded
    template, ChatTemplateError (a ValueError, one line) for a template `tokenizer` cannot use."""
    entry = header.extra.get(CHAT_TEMPLATE)
    if entry is None:
        return ChatRenderer(tokenizer)
    where = f"{path}: " if path else ""
    if isinstance(entry, dict) and entry.get(HARMONY) is True and isinstance(entry.get("template_kwargs"), dict):
        try:
            return HarmonyRenderer.with_options(tokenizer, entry["template_kwargs"])
        except ValueError as exc:
            raise RecordingError(f"{where}the recorded harmony options do not build a renderer: {exc}") from None
    special = entry.get("special_tokens", {}) if isinstance(entry, dict) else None
    kwargs = entry.get("template_kwargs", {}) if isinstance(entry, dict) else None
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("text"), str)
        or not isinstance(special, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in special.items())
        or not isinstance(kwargs, dict)
    ):
        raise RecordingError(
            f"{where}the header's extra[{CHAT_TEMPLATE!r}] is not a recorded chat template "
            "(an object with text, special_tokens and template_kwargs)"
        )
    from ...agents.chat_template import ChatTemplate, TemplateRenderer

    source = f"{where}the recorded chat template ({entry.get('source', '?')})"
    return TemplateRenderer(tokenizer, ChatTemplate(entry["text"], source, special), kwargs)


def verify_tokens(trajectory: Trajectory, renderer: Renderer) -> list[str]:
    """Differences between the recorded token stream and the recorded text ([] if none): what
    training reads (tokens) against what the env graded (text), through `renderer` (the one the
    recording was made with: `recorded_renderer`). Each action's tokens must decode to its text
    (the renderer's `action_text`, as the runner decodes). The episode is rendered again
    as the runner rendered it (rollouts/episode/rendering.py: first_messages, env_replies): the
    first prompt from the system prompt (or, with the tools the renderer was given, `reset_info`'s
    instructions) and the first observation; then after each action its recorded tokens, verbatim, and the
    env's reply (a tool message per recorded `tool_results` entry where the renderer writes
    tools, else the observation), in one chat role for the whole episode ("tool" or "user":
    rollout.observation_role, which the recording does not keep) but where the step's recorded
    info names its own (`observation_role`: `env_replies`' `reply_role`). Every turn's observation
    tokens must be that rendering's, and a turn marked `sequence_start` exactly where the
    rendering restarts (a chat template that is not append-only there, or the recorded context
    policy, `Trajectory.context_policy`, applied again through the runner's `EpisodeContext`,
    rewrites the conversation: marked `context_rewrite` too)."""
    t, problems = trajectory, []
    if not t.transitions:
        return problems
    try:
        policy = context_policy(t.context_policy or None)
    except (ValueError, TypeError) as exc:
        return [f"cannot rebuild the recorded context policy {t.context_policy}: {exc}"]
    try:
        messages, tools = first_messages(
            renderer, t.transitions[0].observation, t.reset_info, t.system_prompt
        )
        roles: list[Role] = ["tool", "user"]  # the roles that still explain every turn so far
        renderings = [EpisodeContext(renderer, messages, tools, policy) for _ in roles]
        if t.transitions[0].observation_tokens != renderings[0].prompt:
            problems.append("turn 0: observation tokens are not the rendered prompt")
        for i in range(1, len(t.transitions)):
            before, transition = t.transitions[i - 1], t.transitions[i]
            restart = bool(transition.info.get(SEQUENCE_START))
            rewrite = bool(transition.info.get(CONTEXT_REWRITE))
            extended = [
                rendering.extend(
                    before.action.tokens,
                    before.action.text,
                    env_replies(renderer, transition.observation, before.info, role),
                    before.info,
                )
                for role, rendering in zip(roles, renderings, strict=True)
            ]
            turns = [turn for turn, _ in extended]
            same = [turn.tokens == transition.observation_tokens for turn in turns]
            keep = [
                k
                for k, (turn, rewritten) in enumerate(extended)
                if same[k] and turn.restarted == restart and rewritten == rewrite
            ]
            if not keep:
                if any(same) and any(turn.restarted == restart for turn in turns):
                    problems.append(
                        f"turn {i}: context_rewrite is {rewrite}, but the context policy "
                        f"{'does not rewrite' if rewrite else 'rewrites'} there"
                    )
                elif any(same):
                    problems.append(
                        f"turn {i}: sequence_start is {restart}, but the rendering "
                        f"{'does not restart' if restart else 'restarts'} there"
                    )
                else:
                    problems.append(f"turn {i}: observation tokens are not the rendered env reply")
                break
            roles = [roles[k] for k in keep]
            renderings = [renderings[k] for k in keep]
        for i, transition in enumerate(t.transitions):
            text = renderer.action_text(transition.action.tokens)
            if text != transition.action.text:
                problems.append(
                    f"turn {i}: action tokens decode to {text!r}, not the recorded {transition.action.text!r}"
                )
    except Exception as exc:  # tokens outside the vocabulary, text the renderer cannot encode
        problems.append(f"the renderer failed on the recorded text or tokens: {type(exc).__name__}: {exc}")
    return problems


def replay_problems(trajectory: Trajectory, renderer: Renderer | None = None) -> list[str]:
    """What `replay --verify` reports for one trajectory: `verify_trajectory`'s problems and, with
    the recording's renderer, `verify_tokens`'s ([] if it replays exactly)."""
    return verify_trajectory(trajectory) + (verify_tokens(trajectory, renderer) if renderer else [])


def verify_trajectories(
    trajectories: Iterable[Trajectory], renderer: Renderer | None = None
) -> list[tuple[int, Trajectory, list[str]]]:
    """(index, trajectory, problems) for every trajectory with `replay_problems`; the seats of a
    match (same env, task seed and sample index) are replayed together (`verify_match`) when the
    recording holds every seat once, and reported as not verified otherwise."""
    items = list(trajectories)
    found: dict[int, list[str]] = {}
    matches: dict[tuple, list[int]] = {}
    for i, t in enumerate(items):
        if t.seat:
            matches.setdefault(match_key(t), []).append(i)
        else:
            found[i] = replay_problems(t, renderer)
    for indices in matches.values():
        seats = [items[i] for i in indices]
        if len(seats) > 1 and len({t.seat for t in seats}) == len(seats):
            results = verify_match(seats)
        else:  # one seat recorded (a match that trained one seat), or a seat twice
            results = [verify_trajectory(t) for t in seats]
        for i, t, problems in zip(indices, seats, results, strict=True):
            found[i] = problems + (verify_tokens(t, renderer) if renderer else [])
    return [(i, items[i], found[i]) for i in sorted(found) if found[i]]


# ---- Episodes from a recording -----------------------------------------------------------------


def _succeeded(trajectory: Trajectory) -> bool:
    env_metrics = trajectory.metrics.get("env")
    value = env_metrics.get(SUCCESS_METRIC) if isinstance(env_metrics, dict) else None
    return isinstance(value, int | float) and value > 0


class OfflineMode(enum.StrEnum):
    SFT = "sft"  # advantage 1.0 on every sampled token: the policy-gradient loss becomes NLL
    PG = "pg"  # the scorer's advantages of the recorded rewards (offline policy gradient)


def episodes_from_trajectories(
    trajectories: Sequence[Trajectory],
    mode: OfflineMode = OfflineMode.SFT,
    advantage: AdvantageConfig | None = None,
    only_successful: bool = False,
    max_seq_len: int | None = None,
    rule: OverlongEpisodeRule = OverlongEpisodeRule.TRUNCATE_TURNS,
    distill: DistillConfig | None = None,
) -> tuple[list[Episode], EpisodeStats]:
    """Training Episodes from recorded trajectories.

    SFT (warm start): every kept trajectory gets advantage 1.0; `only_successful` keeps those
    whose env reported the `success` metric as > 0 (envs/core/info.py). PG: the scorer's
    advantages (rollouts/scoring/scorer.py `score_recorded`) within the recorded groups (group ids
    as recorded) under `advantage`, which PG requires: the run's own, as its recording's header
    records it (rollouts/recording/format.py `recorded_scoring`); ValueError without one. With
    `distill` (the header's `recorded_scoring(header).distill`), the per-token advantages of
    on-policy distillation from the teacher logprobs the transitions carry.
    env_error / timeout episodes are left out either way.
    """
    if only_successful:
        trajectories = [t for t in trajectories if _succeeded(t)]
    advantages: list[Advantage] = [1.0] * len(trajectories)
    if mode == OfflineMode.PG:
        if advantage is None:
            raise ValueError(
                "offline policy gradient needs the advantage config to score with: the run's own "
                "(recorded_scoring(header).advantage), or one given explicitly"
            )
        advantages = score_recorded(trajectories, advantage, train_on_infra_failures=False, distill=distill)
    return build_episodes(trajectories, advantages, max_seq_len, rule)
