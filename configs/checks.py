"""The checks a config must pass before anything starts, beyond what the schema checks alone:
the environment (env.module imports, the env exists, files and packages are there, the batch
splits over the ranks), async mode's layout, and against the machine (the KV cache fits, the
context holds the first prompt). Each raises ConfigError naming the field; none allocates.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gymnasium
import msgspec
import torch

from .. import envs  # noqa: F401 (registers toolgym/*)
from ..agents.chat import Renderer
from ..agents.chat_template import TemplateRenderer
from ..agents.harmony import HARMONY, HarmonyRenderer
from ..agents.model.config import NAMED_CONFIGS, ModelConfig
from ..agents.tokenizer import load_tokenizer, tokenizer_fingerprint
from ..agents.vllm.engine import INSTALL_HINT
from ..envs.core.text_env import env_hooks
from ..envs.core.tool_env import NOTE_TOOL, ToolEnv
from ..envs.registry import import_env_modules
from ..envs.tools.call_formats import template_tool_format
from ..rollouts.batches import TaskSeedStream
from ..rollouts.context import context_policy
from ..rollouts.endpoint.program import load_program
from ..rollouts.env_io import reset_env
from ..rollouts.episode.rendering import first_messages
from ..rollouts.episode.runner import RolloutRunner
from ..rollouts.recording.format import RecordingError, RecordingReader, check_recording
from ..rollouts.scoring.teacher import TeacherError, teacher_fingerprint
from ..rollouts.scripted import OraclePolicy
from ..rollouts.types import StopReason
from .assembly.demos import check_demo_rendering, demo_rollout, rl_stream, sft_stream
from .assembly.parts import policy_max_seq_len
from .assembly.placement import check_async
from .load import ConfigError, tokenizer_path
from .schema import Config

__all__ = [
    "check_against_machine",
    "check_async",
    "check_environment",
    "check_sft_recording",
    "command_format_notes",
    "format_notes",
    "schedule_notes",
    "start_env",
    "tool_format_notes",
]


def _import_env_modules(config: Config) -> None:
    try:
        import_env_modules(config.env.modules, where="env.module")
    except ValueError as exc:
        raise ConfigError("", str(exc)) from None


def _make_env(config: Config, where: str, kwargs: dict[str, Any]) -> gymnasium.Env:
    try:
        return gymnasium.make(config.env.id, **kwargs)
    except Exception as exc:
        raise ConfigError(where, f"cannot make env {config.env.id!r} with {kwargs}: {exc}") from None


@contextmanager
def start_env(config: Config) -> Iterator[gymnasium.Env]:
    """config.env's env with env.kwargs (env.module imported first: it registers the user's envs),
    made once for the checks and notes at start that read or reset it (check_environment,
    check_against_machine, tool_format_notes each take it as `env`) and closed when they are done;
    ConfigError (env) when it cannot be made."""
    _import_env_modules(config)
    env = _make_env(config, "env", config.env.kwargs)
    try:
        yield env
    finally:
        env.close()


def _check_selfplay(config: Config, env: gymnasium.Env) -> None:
    """[selfplay] needs a game of seats (envs/core/seats.py), and its opponent one of its bots."""
    from ..envs.core.seats import SeatedGame

    game = getattr(env.unwrapped, "game", None)
    if not isinstance(game, SeatedGame):
        where = "selfplay.enabled" if config.selfplay.enabled else "selfplay.eval_opponents"
        raise ConfigError(where, f"env {config.env.id!r} is not a game of seats (envs/core/seats.py SeatedGame)")
    opponent = config.selfplay.opponent
    if opponent not in ("self", "pool") and opponent not in game.bots:
        raise ConfigError(
            "selfplay.opponent", f"{opponent!r} is not one of the game's bots {list(game.bots)}, 'self' or 'pool'"
        )
    for where in ("eval_opponents", "pool_bots"):
        for bot in getattr(config.selfplay, where):
            if bot not in game.bots:
                raise ConfigError(f"selfplay.{where}", f"{bot!r} is not one of the game's bots {list(game.bots)}")
    if config.selfplay.pool_checkpoints:
        _check_pool_checkpoints(config)


def _check_pool_checkpoints(config: Config) -> None:
    """Each pool checkpoint is a HF directory of the policy's own model (the same config.json
    shape) and tokenizer (the same fingerprint), so the policy's engine can sample it; not with
    LoRA (a snapshot then holds the adapters alone, and a checkpoint would replace the base)."""
    from ..agents.model.checkpoint import load_config

    where = "selfplay.pool_checkpoints"
    if config.policy.lora.enabled:
        raise ConfigError(where, "checkpoint opponents need full weights: not with policy.lora (rank > 0; snapshots only)")
    ours = tokenizer_fingerprint(load_tokenizer(tokenizer_path(config)))
    if config.model.path:
        model = load_config(config.model.path)
    else:
        model = ModelConfig(**{**NAMED_CONFIGS[config.model.name], **config.model.overrides})
    names = set()
    for directory in map(Path, config.selfplay.pool_checkpoints):
        if not (directory / "config.json").is_file():
            raise ConfigError(where, f"{directory} is not a Hugging Face directory (no config.json)")
        if directory.name in names:
            raise ConfigError(where, f"two checkpoints named {directory.name!r}: members are named by directory")
        names.add(directory.name)
        try:
            theirs = tokenizer_fingerprint(load_tokenizer(directory / "tokenizer.json"))
        except Exception as exc:  # a missing or damaged file: tokenizers raises a plain Exception
            raise ConfigError(where, f"{directory}: no readable tokenizer.json ({exc})") from None
        if theirs != ours:
            raise ConfigError(
                where,
                f"{directory}: its tokenizer {theirs[:16]} is not the policy's {ours[:16]} ({tokenizer_path(config)})",
            )
        other = load_config(directory)
        if other != model:
            mine, their = msgspec.structs.asdict(model), msgspec.structs.asdict(other)
            differ = [k for k in mine if mine[k] != their[k]]
            raise ConfigError(
                where,
                f"{directory}: another model than the policy's ({other.model_type} vs {model.model_type}; "
                f"differs in {', '.join(differ[:4])}): the policy's engine samples the pool",
            )


def check_environment(config: Config, world_size: int = 1, env: gymnasium.Env | None = None) -> None:
    """What the schema cannot know: env.module imports (it registers the user's envs, so it is
    imported first), the env exists, files exist, packages are installed, the batch splits over
    the ranks. Raises ConfigError; cheap (nothing heavy is imported beyond env.module). `env`:
    config.env's, made already (`start_env`; else one is made here and closed)."""
    _import_env_modules(config)
    if config.agent_program.module:  # the agent program's module and functions exist
        try:
            load_program(config.agent_program)
        except ValueError as exc:
            raise ConfigError("", str(exc)) from None
    for where, kwargs in (("env", config.env.kwargs), ("sft.env_kwargs", config.sft.env_kwargs)):
        if kwargs is None:
            continue
        given = env if where == "env" else None
        made = given if given is not None else _make_env(config, where, kwargs)
        try:
            if where == "env":
                _check_env_context(config, made)
                _check_guided(config, made)
                if config.selfplay.enabled or config.selfplay.eval_opponents:
                    _check_selfplay(config, made)
        finally:
            if given is None:
                made.close()
    if config.model.path:
        if not (Path(config.model.path) / "config.json").is_file():
            raise ConfigError(
                "model.path", f"{config.model.path} is not a Hugging Face directory (no config.json)"
            )
    else:
        if config.model.name not in NAMED_CONFIGS:
            raise ConfigError(
                "model.name",
                f"unknown named config {config.model.name!r} (known: {', '.join(sorted(NAMED_CONFIGS))})",
            )
        try:
            ModelConfig(**{**NAMED_CONFIGS[config.model.name], **config.model.overrides})
        except (TypeError, ValueError) as exc:
            raise ConfigError("model.overrides", str(exc)) from None
    if not tokenizer_path(config).is_file():
        raise ConfigError("tokenizer.path", f"no such file: {tokenizer_path(config)}")
    if config.sft.enabled and config.sft.source == "recording" and not Path(config.sft.recording).is_file():
        raise ConfigError("sft.recording", f"no such file: {config.sft.recording}")
    if config.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "logging.tensorboard", "needs the tensorboard package: pip install 'toolgym[tensorboard]'"
        )
    if config.policy.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("policy.backend", f"'vllm' needs vllm: {INSTALL_HINT}")
    if config.distill.enabled:
        _check_teacher(config)
    if config.judge.enabled:
        from ..rollouts.scoring.judge import Judge, JudgeError

        try:  # its key's variable is set, and it lists its models (the one to use)
            Judge(config.judge)
        except JudgeError as exc:
            raise ConfigError("judge.url", str(exc)) from None
    if config.batch.groups_per_batch % world_size:
        raise ConfigError(
            "batch.groups_per_batch",
            f"{config.batch.groups_per_batch} groups do not split evenly over {world_size} processes",
        )


def _check_teacher(config: Config) -> None:
    """distill.teacher is a HF directory whose tokenizer is the student's (the same fingerprint),
    or an endpoint that answers prompt_logprobs (and, if it says, has the student's tokenizer)."""
    if config.distill.endpoint:
        from ..rollouts.scoring.endpoint_teacher import EndpointTeacher

        ours = tokenizer_fingerprint(load_tokenizer(tokenizer_path(config)))
        try:
            EndpointTeacher(config.distill, student_fingerprint=ours, temperature=config.policy.temperature)
        except TeacherError as exc:
            raise ConfigError("distill.teacher", str(exc)) from None
        return
    teacher = Path(config.distill.teacher)
    if not (teacher / "config.json").is_file():
        raise ConfigError("distill.teacher", f"{teacher} is not a Hugging Face directory (no config.json)")
    try:
        theirs = teacher_fingerprint(teacher)
    except (TeacherError, OSError, ValueError) as exc:
        raise ConfigError("distill.teacher", str(exc)) from None
    ours = tokenizer_fingerprint(load_tokenizer(tokenizer_path(config)))
    if theirs != ours:
        raise ConfigError(
            "distill.teacher",
            f"its tokenizer {theirs[:16]} ({teacher / 'tokenizer.json'}) is not the student's {ours[:16]} "
            f"({tokenizer_path(config)})",
        )


def _check_env_context(config: Config, env: gymnasium.Env) -> None:
    """The context policy the run will use: the env's own declaration (when the config sets none)
    must build, as rollout.context is checked at load time, and a notes policy needs an env with
    the NOTE tool (otherwise it never rewrites anything)."""
    declared = env_hooks(env).context_policy
    field, spec = "rollout.context", config.rollout.context
    if spec is None and declared is not None:
        field, spec = "env", declared
        try:
            context_policy(declared)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                "env", f"{config.env.id!r} declares context_policy {declared!r}, which is refused: {exc}"
            ) from None
    if isinstance(spec, Mapping):
        name = spec.get("policy")
    else:  # a config's tagged policy Struct
        name = spec.__struct_config__.tag if isinstance(spec, msgspec.Struct) else None
    tools = env.unwrapped.tools if isinstance(env.unwrapped, ToolEnv) else None
    if name == "notes" and tools is not None and NOTE_TOOL not in {t.upper() for t in tools}:
        raise ConfigError(
            field,
            f"the notes policy keeps the turns that wrote a note, but {config.env.id!r} has no "
            f"{NOTE_TOOL} tool (with env.kwargs {config.env.kwargs}): it would never rewrite the context",
        )


def _check_guided(config: Config, env: gymnasium.Env) -> None:
    """rollout.guided_samples needs the env runner (not self-play's or an agent program's) and an
    env with an oracle: its `oracle_actions()` after a reset."""
    if not config.rollout.guided_samples:
        return
    if config.selfplay.enabled or config.agent_program.module:
        what = "self-play's matches" if config.selfplay.enabled else "an [agent_program]'s episodes"
        raise ConfigError("rollout.guided_samples", f"the env's oracle plays env episodes, not {what}")
    try:
        env.reset(seed=0)
        actions = list(env_hooks(env).oracle_actions())
    except Exception as exc:
        cause = f"{type(exc).__name__}: {exc}"
        raise ConfigError(
            "rollout.guided_samples", f"needs the env's oracle, and {config.env.id!r} gave none: {cause}"
        ) from None
    if not actions:
        raise ConfigError("rollout.guided_samples", f"{config.env.id!r}'s oracle returned no actions")


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_bytes(config: Config, model: ModelConfig) -> int:
    """The torch engine's KV cache for `config` and `model`, in bytes, computed (never allocated)
    as agents/engine/kv_cache.py lays it out: (max_batch_size + 1) slots (one holds a shared
    prefix) of max_seq_len positions, plus the history pool (policy.history_capacity; -1 =
    max_batch_size x max_seq_len positions), each position k and v for every layer and kv head,
    once per engine (policy.replicas)."""
    policy = config.policy
    seq = policy_max_seq_len(config, model)
    history = policy.max_batch_size * seq if policy.history_capacity == -1 else policy.history_capacity
    per_position = model.num_hidden_layers * model.num_key_value_heads * model.head_dim * 2
    per_position *= _DTYPE_BYTES[config.model.dtype]
    return per_position * ((policy.max_batch_size + 1) * seq + history) * policy.replicas


def machine_memory(device: torch.device, replicas: int = 1) -> tuple[int, str]:
    """(bytes, what they are) a policy's KV cache can live in: the GPU's memory for a CUDA engine,
    else the machine's RAM (replicas decode on CPU). No psutil: sysconf reads it on Linux and
    macOS; where it cannot, (0, "") and the caller checks nothing."""
    if device.type == "cuda" and replicas == 1:
        return torch.cuda.get_device_properties(device).total_memory, "the GPU's memory"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
    except (AttributeError, OSError, ValueError):
        return 0, ""


def check_memory(config: Config, model: ModelConfig, device: torch.device) -> None:
    """Refuse a torch-engine KV cache larger than the memory it would be allocated in (in RAM,
    every local rank makes its own; on CUDA each rank has its GPU), naming the fields that size it. Without this the allocator fails
    after SFT, with a traceback, or a 64-bit size overflows. The vLLM backend sizes its own cache
    (policy.vllm.kv_cache_gib, gpu_memory_utilization)."""
    if config.policy.backend != "torch":
        return
    available, what = machine_memory(device, config.policy.replicas)
    on_gpu = device.type == "cuda" and config.policy.replicas == 1
    ranks = 1 if on_gpu else int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    needed = kv_cache_bytes(config, model) * ranks
    if not available or needed <= available:
        return
    policy = config.policy
    # the field that sizes most of it: an explicit history pool larger than the slots, else the slots
    slots_positions = policy.max_batch_size * policy_max_seq_len(config, model)
    history_is_larger = policy.history_capacity > slots_positions
    field = "policy.history_capacity" if history_is_larger else "policy.max_batch_size"
    per_ranks = f" ({ranks} local processes, a cache each)" if ranks > 1 else ""
    raise ConfigError(
        field,
        f"must keep the KV cache within {what} ({available:,} bytes): policy.max_batch_size = "
        f"{policy.max_batch_size:,}, policy.max_seq_len = {policy.max_seq_len or 'the model default'}, "
        f"policy.history_capacity = {policy.history_capacity:,} and policy.replicas = {policy.replicas} "
        f"need {needed:,} bytes{per_ranks}",
    )


def first_prompt_length(
    config: Config, renderer: Renderer, env_kwargs: dict[str, Any], env: gymnasium.Env | None = None
) -> tuple[int, int]:
    """(tokens, task seed): the env's first prompt for the run's first training task (the
    system prompt and the reset observation, rendered as the runner renders them). `env`: one
    made with `env_kwargs` already (reset here, left open; else one is made here and closed)."""
    (seed,), _ = TaskSeedStream(stream=rl_stream(config)).take(1)
    made = env if env is not None else gymnasium.make(config.env.id, **env_kwargs)
    try:
        observation, info, system_prompt = reset_env(made, seed)
    finally:
        if env is None:
            made.close()
    messages, tools = first_messages(renderer, observation, info, system_prompt)
    return len(renderer.start_episode(messages, tools).prompt), seed


def check_context(
    config: Config, model: ModelConfig, renderer: Renderer, env: gymnasium.Env | None = None
) -> None:
    """Refuse a context (rollout.context_length, else policy.max_seq_len) that cannot hold the
    env's first prompt plus one turn: every episode would overflow before its first action,
    and the run would train on 0 tokens (or SFT find no trainable demonstration). `env`:
    config.env's, made already (`start_env`)."""
    seq = policy_max_seq_len(config, model)
    length = config.rollout.context_length
    field, context = "policy.max_seq_len", seq  # the runner takes the smaller of the two
    if length is not None and length < seq:
        field, context = "rollout.context_length", length
    turn = min(config.rollout.max_tokens_per_turn, config.rollout.max_tokens_per_episode)
    checks = [("env.kwargs", config.env.kwargs)]
    if config.sft.enabled and config.sft.source == "oracle" and config.sft.env_kwargs is not None:
        checks.append(("sft.env_kwargs", config.sft.env_kwargs))
    for where, kwargs in checks:
        try:
            prompt, seed = first_prompt_length(config, renderer, kwargs, env if where == "env.kwargs" else None)
        except Exception as exc:
            raise ConfigError(where, f"cannot reset env {config.env.id!r} with {kwargs}: {exc}") from None
        if prompt + turn > context:
            raise ConfigError(
                field,
                f"must be >= {prompt + turn} to hold the env's first prompt ({prompt} tokens, "
                f"{config.env.id} with {where} at task seed {seed}) and one turn "
                f"(rollout.max_tokens_per_turn = {config.rollout.max_tokens_per_turn}), got {context}",
            )


# The runner's own limits: an episode stopped by one of these was cut short, not finished.
_RUNNER_LIMITS = (StopReason.MAX_TOKENS, StopReason.CONTEXT_OVERFLOW, StopReason.MAX_TURNS)


def check_demo_limits(config: Config, model: ModelConfig, renderer: Renderer, sample: int = 4) -> None:
    """Refuse oracle SFT demonstrations that the run's token, turn and context limits would cut
    short, every one of them: SFT would train on nothing but cut-off episodes (and report their
    accuracy as 0). Rolls out the first `sample` demonstrations under the run's limits (the
    oracle is cheap); where all are cut, again without them, and names each limit with the value
    the demonstrations need."""
    sft = config.sft
    if not (sft.enabled and sft.source == "oracle"):
        return
    seq = policy_max_seq_len(config, model)
    context = min(config.rollout.context_length or seq, seq)
    rollout = demo_rollout(config, context_length=context)
    seeds, group_ids = TaskSeedStream(stream=sft_stream(config)).take(min(sample, sft.num_tasks))
    policy = OraclePolicy(renderer, sft.oracle)
    cut = RolloutRunner(policy, renderer, rollout).run(seeds, group_ids=group_ids)
    if not cut or any(t.stop_reason not in _RUNNER_LIMITS for t in cut):
        return
    free = msgspec.structs.replace(
        rollout, max_turns=1024, max_tokens_per_turn=1 << 20, max_tokens_per_episode=1 << 24, context_length=None
    )
    whole = RolloutRunner(policy, renderer, free).run(seeds, group_ids=group_ids)
    needs = {
        "rollout.max_turns": (config.rollout.max_turns, max(len(t.transitions) for t in whole)),
        "rollout.max_tokens_per_turn": (
            config.rollout.max_tokens_per_turn,
            max((len(tr.action.tokens) for t in whole for tr in t.transitions), default=0),
        ),
        "rollout.max_tokens_per_episode": (
            config.rollout.max_tokens_per_episode,
            max(sum(len(tr.action.tokens) for tr in t.transitions) for t in whole),
        ),
        "rollout.context_length" if context < seq else "policy.max_seq_len": (
            context,
            max(sum(len(tr.observation_tokens) + len(tr.action.tokens) for tr in t.transitions) for t in whole),
        ),
    }
    short = [f"{key} >= {need} (it is {have})" for key, (have, need) in needs.items() if need > have]
    field = short[0].split(" ")[0] if short else "rollout"
    reasons = sorted({str(t.stop_reason) for t in cut})
    spec = config.rollout.context
    if spec is not None and reasons == [str(StopReason.CONTEXT_OVERFLOW)]:
        # the run's own context policy was to keep the context within bounds: it is the cause
        name = spec.__struct_config__.tag
        whole_tokens = needs["rollout.context_length" if context < seq else "policy.max_seq_len"][1]
        raise ConfigError(
            "rollout.context",
            f"every sampled SFT demonstration of {config.env.id} overflows the context (context_overflow) "
            f"under the {name!r} policy: it does not keep them within {context} tokens (a whole "
            f"demonstration is {whole_tokens}); choose a policy that bounds the context (window, notes) "
            f"or give them more room ({', '.join(short) or 'longer limits'})",
        )
    raise ConfigError(
        field,
        f"every sampled SFT demonstration of {config.env.id} is cut short ({', '.join(reasons)}); "
        f"they need {', '.join(short) or 'longer limits'}",
    )


def check_against_machine(
    config: Config,
    model: ModelConfig,
    renderer: Renderer,
    device: torch.device,
    env: gymnasium.Env | None = None,
) -> None:
    """The checks that need the model's shape, the renderer and the device (cheap: nothing is
    allocated, one env is reset, a few oracle demonstrations run): the KV cache fits, the context
    holds the first prompt, the limits do not cut every SFT demonstration short. `env`:
    config.env's, made already (`start_env`)."""
    check_memory(config, model, device)
    check_context(config, model, renderer, env)
    check_demo_limits(config, model, renderer)


def check_sft_recording(config: Config, renderer: Renderer) -> None:
    """The SFT recording: every record readable (rollouts/recording/format.py's check_recording), made
    with the run's tokenizer and rendered as the run renders (assembly/demos.py's
    check_demo_rendering); ConfigError (sft.recording) otherwise."""
    if not (config.sft.enabled and config.sft.source == "recording"):
        return
    fingerprint = tokenizer_fingerprint(renderer.tokenizer)
    try:  # every record: a damaged one found after the run directory exists would leave it behind
        check_recording(config.sft.recording, fingerprint)
        header = RecordingReader(config.sft.recording, fingerprint).header
    except (RecordingError, OSError) as exc:
        raise ConfigError("sft.recording", str(exc)) from None
    check_demo_rendering(config, renderer, header)




def schedule_notes(config: Config) -> list[str]:
    """A line for each decaying LR schedule that ends before its phase does: the steps after
    `total_steps` run at lr x min_lr_ratio. This is how a resume with `--set run.steps=N` (more
    steps) behaves, since the stored config.toml fixed total_steps at the old run.steps;
    stretching the schedule mid-run would change the LR of steps already planned, so it is the
    user's call, and the note says how."""
    notes = []
    phases = [("trainer.optimizer", config.trainer.optimizer, "run.steps", config.run.steps)]
    if config.sft.enabled:
        phases.append(("sft.optimizer", config.sft.optimizer, "sft.steps", config.sft.steps))
    for key, optimizer, steps_key, steps in phases:
        if optimizer.decay != "constant" and steps > optimizer.total_steps:
            notes.append(
                f"note: {key}.total_steps={optimizer.total_steps} < {steps_key}={steps}: the {optimizer.decay} "
                f"LR schedule ends at step {optimizer.total_steps} and later steps run at lr x "
                f"min_lr_ratio={optimizer.min_lr_ratio:g} (--set {key}.total_steps={steps} stretches it)"
            )
    return notes


def tool_format_notes(config: Config, renderer: Renderer, env: gymnasium.Env | None = None) -> list[str]:
    """`format_notes` for a run: the env of config.env (`env`, made already by `start_env`; else
    one is made here and closed), the renderer the run renders with (its chat template is
    `run_chat_template`'s: policy.chat_template, else model.path's own), and the config's fields in
    the lines (`--set env.kwargs.tool_format=...`)."""
    made = env if env is not None else gymnasium.make(config.env.id, **config.env.kwargs)
    try:
        return format_notes(
            made,
            renderer,
            f"model {config.model.path or config.model.name!r}",
            FormatKnobs(
                given="env.kwargs.tool_format = {}" if "tool_format" in config.env.kwargs else "",
                default=f"{config.env.id}'s tool_format is {{}} (its default)",
                unset="policy.chat_template is unset",
                match="--set env.kwargs.tool_format=FORMAT",
            ),
        )
    finally:
        if env is None:
            made.close()


def command_format_notes(env_id: str, env_kwargs: Mapping[str, Any], renderer: Renderer, policy: str) -> list[str]:
    """`format_notes` for a command that renders an env's prompts for `policy` (`toolgym record`,
    `eval`), with its flags in the lines (`--env-kwargs`, `--chat-template`). An env that cannot
    be made gets none: the command reports that itself."""
    try:
        env = gymnasium.make(env_id, **env_kwargs)
    except Exception:
        return []
    try:
        return format_notes(
            env,
            renderer,
            f"policy {policy!r}",
            FormatKnobs(
                given="--env-kwargs' tool_format = {}" if "tool_format" in env_kwargs else "",
                default=f"{env_id}'s tool_format is {{}} (its default)",
                unset="--chat-template is unset",
                match="--env-kwargs '" + json.dumps({**env_kwargs, "tool_format": "FORMAT"}) + "'",
            ),
        )
    finally:
        env.close()


class FormatKnobs(msgspec.Struct, frozen=True):
    """How `format_notes` names the settings of the run or command it speaks for: `given` (the
    env's format, set by the user; "" when it is the env's default) and `default` take the format's
    repr at {}; `unset` says why the renderer is plain ChatML; `match` is the setting that matches a
    template's format (FORMAT: its name)."""

    given: str
    default: str
    unset: str
    match: str


def format_notes(env: gymnasium.Env, renderer: Renderer, model: str, knobs: FormatKnobs) -> list[str]:
    """A line at start where the env's tool-call format and the chat template the prompts are
    rendered with disagree (never a refusal): a warning when the env speaks a family's format (not
    "brackets") but the template has no tools block (`renders_tools` false, or plain ChatML), so
    the model never sees the tools the way its family writes them; else a note when the template
    teaches another format than the env's (envs/tools/call_formats.py's template_tool_format, read
    from the renderer's own template text), with the setting that matches it. Nothing for an env
    that is not a ToolEnv, or when they agree. `model` names the model ("model 'x'")."""
    unwrapped = env.unwrapped
    if not isinstance(unwrapped, ToolEnv):
        return []
    env_format = unwrapped.format.name
    setting = (knobs.given or knobs.default).format(repr(env_format))
    if isinstance(renderer, HarmonyRenderer):
        if env_format == HARMONY:
            return []
        match = knobs.match.replace("FORMAT", HARMONY)
        return [f"note: {model} renders harmony, which speaks 'harmony' tool calls; {setting} ({match} to match)"]
    if isinstance(renderer, TemplateRenderer):
        template = f"the chat template of {model} ({renderer.source})"
        no_tools = None if renderer.renders_tools else f"{template} has no tools block"
    else:
        template = ""
        no_tools = f"{model} renders through plain ChatML ({knobs.unset}), which has no tools block"
    if no_tools is not None:
        if env_format == "brackets":
            return []
        return [
            f"warning: {setting}, but {no_tools}: the model is never shown the tools in that format "
            "(only the env's system prompt describes them)"
        ]
    assert isinstance(renderer, TemplateRenderer)
    spoken = template_tool_format(renderer.text)
    if spoken is None or spoken == env_format:
        return []
    match = knobs.match.replace("FORMAT", spoken)
    return [f"note: {template} speaks {spoken!r} tool calls; {setting} ({match} to match)"]
