"""The typed configuration of a `toolgym train` run: one msgspec Struct per TOML section.

Sections (all optional; every key has a default):

    [run]        name (a name, never a path), steps (RL steps), seed, root (the runs folder), run_dir,
                 export_hf, plot, max_steps_without_learning (a run that cannot learn stops)
    [env]        id, kwargs (a table of the env's keyword arguments), module (a module name or a
                 list of them, imported first: they register the user's envs; `--env-module M`
                 adds one). A preset's or file's kwargs apply only to its own env id
                 (configs/load.py, load_config)
    [model]      name (a named config: tiny, test, ...) or path (a Hugging Face directory; wins when
                 set), overrides (ModelConfig fields for a named config), dtype (the policy's),
                 init_seed
    [tokenizer]  path ("" = the model directory's tokenizer.json, else the shipped one)
    [policy]     the policy that samples: temperature, top_p, top_k (PolicySampling), backend
                 (torch | vllm), max_batch_size, max_seq_len, cuda_graphs, fused_layers,
                 history_capacity, replicas, chat_template ("" = plain ChatML, "harmony" =
                 gpt-oss's format, else a tokenizer_config.json or .jinja file), chat_template_kwargs, [policy.vllm] (VLLMConfig: dtype, kv_cache_gib,
                 gpu_memory_utilization, ...). `[agent]`, its old name, is still read for one
                 release, with a warning (configs/load.py).
    [rollout]    RolloutSettings: group_size, max_turns, max_tokens_per_turn, max_tokens_per_episode,
                 context_length, episode_timeout_s, observation_role, max_concurrent_episodes
    [batch]      BatchConfig: groups_per_batch (per step, over ALL ranks), dynamic_sampling,
                 max_extra_rounds, max_groups_per_round, overlong_rule, train_on_infra_failures,
                 [batch.advantage] estimator (grpo | dr_grpo), eps, overlong = {max_length, cache_length},
                 credit (outcome | turn_loo | turn_state: turn-level credit, rollouts/scoring/credit.py), gamma
    [trainer]    TrainerConfig: micro_batch_tokens, precision, compute_entropy, [trainer.loss] (LossConfig),
                 [trainer.optimizer] (OptimizerConfig; total_steps defaults to run.steps)
    [sft]        enabled, source (oracle | recording), recording, num_tasks, env_kwargs,
                 only_successful, steps, batch_episodes, micro_batch_tokens, log_every,
                 [sft.oracle] (OracleConfig: p_omit_tag, ...), [sft.optimizer] (OptimizerConfig)
    [eval]       every_steps, at_start, at_end, num_tasks, greedy, samples_per_task, num_examples, record
    [logging]    console, headline_metrics, every_steps, progress_bar, jsonl, tensorboard,
                 record_training
    [checkpoint] CheckpointConfig: directory (inside the run dir), every_steps, keep_last
    [parallel]   device (auto | cpu | cuda), threads (torch threads per process; 0 = cores / local ranks)
    [loop]       mode (sync | async), max_staleness, over_stale (drop | downweight), stale_weight,
                 buffer_groups, generator (auto | process | thread), generator_processes,
                 generator_threads, generator_ranks: asynchronous RL (trainers/loop/)
    [distill]    DistillConfig: teacher ("" = off; a HF directory with the student's tokenizer, or
                 an OpenAI-compatible endpoint's URL "http://host:port/v1" that answers vLLM's
                 prompt_logprobs: vLLM, `toolgym serve`), teacher_model (the endpoint's model; "" =
                 its only one), teacher_timeout_s, weight, reward_weight, max_consecutive_failures:
                 on-policy distillation (rollouts/scoring/distill.py, teacher.py, endpoint_teacher.py)
    [judge]      JudgeConfig: url ("" = off; an OpenAI-compatible endpoint), model, api_key_env (the
                 NAME of the key's environment variable), mode (episode | group), criteria (name,
                 prompt, weight: each the reward component judge_<name>), max_concurrent,
                 timeout_s, retries, backoff_s, ...: rewards from a judge (rollouts/scoring/judge.py)
    [selfplay]   SelfPlayConfig: enabled, learn (all: mirror self-play | one), opponent (a bot of the
                 game, self, or pool: snapshots every pool_every steps, pool_size kept, pool_bots,
                 pool_sampling, elo_k): every seat of a game of seats its own episode
                 (rollouts/episode/match.py; the pool and ratings: rollouts/episode/opponents.py)
    [agent_program] module, function, task, request_timeout_s: train an agent program written
                 against the `openai` client through the endpoint instead of rolling out [env]
                 (rollouts/endpoint/agent_runner.py); empty module = env rollouts

Each setting is declared once: the components' own config Structs are the sections where their
shape suits TOML (RolloutSettings, BatchConfig, TrainerConfig, LossConfig, OptimizerConfig,
CheckpointConfig, OracleConfig, VLLMConfig), and the sampling fields of [policy] are the
PolicySampling that both the runner and the trainer read; `Config.rollout_config()` adds the env,
sampling and seed to [rollout]. The eval section is a wrapper that builds EvalConfig. Loading and error reporting: configs/load.py.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import msgspec

from ..agents.model.lora import LoraConfig, check_native_targets
from ..agents.vllm.engine import VLLM_LORA_RANKS, VLLMConfig, check_lora_targets
from ..rollouts.batches import EVAL_SEED_COUNT, BatchConfig
from ..rollouts.endpoint.program import AgentProgram
from ..rollouts.episode.config import EnvRolloutConfig
from ..rollouts.episode.match import SelfPlayConfig
from ..rollouts.evaluation import EvalConfig
from ..rollouts.scoring.distill import DistillConfig
from ..rollouts.scoring.judge import JudgeConfig
from ..rollouts.scripted import OracleConfig
from ..rollouts.types import PolicySampling, RolloutSettings
from ..trainers.config import CheckpointConfig, OptimizerConfig, TrainerConfig
from ..trainers.loop.rl import EvalSchedule
from ..trainers.metrics_log import LoggingConfig

_STRICT = {"kw_only": True, "forbid_unknown_fields": True}


def _positive(section: str, **values: float | int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"{section}.{name} must be >= 1, got {value}")


class RunSection(msgspec.Struct, **_STRICT):
    name: str = ""  # "" = the config file's stem; a name, never a path (no separator, not . or ..)
    steps: int = 100  # RL steps (optimizer updates, one batch each)
    seed: int = 0  # task stream, sampling seeds, model init
    root: str = "runs"  # the folder new run directories go in: <root>/<name>-<timestamp>
    run_dir: str = ""  # this run's directory, exactly; "" = <root>/<name>-<timestamp>
    export_hf: bool = True  # write the final policy as a Hugging Face directory
    plot: bool = True  # write plots/*.png at the end
    # Consecutive RL steps that cannot change the policy (0 trainable tokens, every group dropped
    # by dynamic sampling, or the update skipped as non-finite) before the run stops with an
    # error (trainers/loop/rl.py); 0 = never stop.
    max_steps_without_learning: int = 5

    def __post_init__(self) -> None:
        for name in ("steps", "seed", "max_steps_without_learning"):
            if getattr(self, name) < 0:
                raise ValueError(f"run.{name} must be >= 0, got {getattr(self, name)}")
        if self.name in (".", "..") or any(sep in self.name for sep in ("/", "\\", "\0")):
            raise ValueError(
                f"run.name must be a name, not a path (no '/' or '\\', not '.' or '..'; the folder "
                f"runs go in is run.root): got {self.name!r}"
            )


class EnvSection(msgspec.Struct, **_STRICT):
    """The env: `gymnasium.make(id, **kwargs)`, after importing `module` (the user's modules that
    register their envs with gymnasium; a name or a list, kept as a list; the current directory
    is importable). A module that cannot be imported is a ConfigError naming env.module before
    anything starts (configs/checks.py, check_environment); config.toml keeps the list, so
    `--resume` imports them again."""

    id: str = "toolgym/Zorplex-v0"
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    module: str | list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.module, str):  # one name; "" = none
            self.module = [self.module] if self.module else []
        for name in self.module:
            if not name or not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"env.module must be module names like 'mypkg.bank_env', got {name!r}")

    @property
    def modules(self) -> list[str]:
        """`module` as a list (a single name is one element)."""
        return [self.module] if isinstance(self.module, str) else list(self.module)


class ModelSection(msgspec.Struct, **_STRICT):
    name: str = "tiny"  # ModelConfig.named(name), randomly initialised with init_seed
    path: str = ""  # a Hugging Face directory (config.json + safetensors); wins over name when set
    overrides: dict[str, Any] = msgspec.field(default_factory=dict)  # ModelConfig fields (named only)
    dtype: Literal["float32", "bfloat16", "float16"] = (
        "float32"  # the policy's weights (the trainer's are float32)
    )
    init_seed: int = 0

    def __post_init__(self) -> None:
        if self.path:
            self.name = ""
            if self.overrides:
                raise ValueError(
                    "model.overrides must be empty with model.path (they apply to a named config)"
                )
        elif not self.name:
            raise ValueError("set model.name (a named config) or model.path (a Hugging Face directory)")


class TokenizerSection(msgspec.Struct, **_STRICT):
    # "" = the model directory's tokenizer.json if it has one, else the shipped one; a shipped
    # tokenizer's name ("copy": configs/assets/tokenizers/) or a tokenizer.json path
    path: str = ""


class PolicySection(PolicySampling, frozen=True, **_STRICT):
    """The policy that samples: its PolicySampling fields (temperature, top_p, top_k; declared
    once in rollouts/types.py, read by the runner and the trainer) and the backend's settings."""

    backend: Literal["torch", "vllm"] = "torch"
    # Trainer's model: "native" (agents/model/, the families in agents/model/families/) or
    # "transformers" (agents/model/hf_fallback.py: any AutoModelForCausalLM at model.path; needs
    # backend "vllm" and the `transformers` extra; no trainer.compile; LoRA on any of its linears).
    implementation: Literal["native", "transformers"] = "native"
    max_batch_size: int = 256  # torch engine: KV-cache slots (episodes decoded together)
    max_seq_len: int = 0  # prompt + completion tokens per episode; 0 = min(model max, 4096)
    cuda_graphs: bool = True  # torch engine on a GPU: replay decode steps from CUDA graphs (CPU: ignored)
    # torch engine on a GPU: decoder layers with fused GEMMs and torch.compile'd pointwise kernels
    # (agents/kernels/fused_layer.py; CPU: ignored)
    fused_layers: bool = True
    # torch engine: KV-cache positions that keep finished turns' k/v for their episode's next turn
    # (agents/engine/history.py); -1 = max_batch_size * max_seq_len (doubles the KV cache), 0 = off.
    history_capacity: int = -1
    # torch engine on CPU: this many engine processes, each with the cores / replicas threads and
    # max_batch_size slots (agents/engine/replicas.py); 1 = one engine in the training process.
    # Async mode's "process" generator: this many generator processes (loop.generator).
    replicas: int = 1
    # The chat rendering: "" = plain ChatML (agents/chat.py; the shipped tiny models), "harmony" =
    # gpt-oss's format (agents/harmony.py; chat_template_kwargs are its options), else a path
    # to a tokenizer_config.json or .jinja file whose chat template renders every prompt, token in
    # and token out (agents/chat_template.py), with chat_template_kwargs as template variables.
    chat_template: str = ""
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    vllm: VLLMConfig = msgspec.field(default_factory=VLLMConfig)
    # LoRA for RL (agents/model/lora.py): rank > 0 trains adapters over the frozen base (after SFT,
    # which stays full), syncs only them to the policy, exports them as a PEFT directory.
    # target_modules: q_proj ... down_proj for a native family, and "experts" for every expert of its
    # MoE blocks (torch backend); with implementation = "transformers" any of the model's linear
    # names (qkv_proj, gate_up_proj, query_key_value, ...).
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.implementation == "native":
            check_native_targets(self.lora, "policy.lora")
        if self.lora.enabled and self.backend == "vllm":
            check_lora_targets(self.lora.target_modules)
        if self.lora.enabled and self.backend == "vllm" and self.lora.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(
                f"policy.lora.rank must be <= {VLLM_LORA_RANKS[-1]} with backend 'vllm' (vLLM's largest "
                f"max_lora_rank), got {self.lora.rank}"
            )
        if not self.temperature > 0:
            raise ValueError(f"policy.temperature must be > 0 for RL sampling, got {self.temperature}")
        _positive("policy", max_batch_size=self.max_batch_size, replicas=self.replicas)
        if self.max_seq_len < 0:
            raise ValueError(f"policy.max_seq_len must be >= 0, got {self.max_seq_len}")
        if self.history_capacity < -1:
            raise ValueError(
                f"policy.history_capacity must be -1 (default), 0 (off) or > 0, got {self.history_capacity}"
            )


class SFTSection(msgspec.Struct, **_STRICT):
    """Supervised warm start before RL: cross-entropy on the demonstrations' sampled tokens."""

    enabled: bool = False
    source: Literal["oracle", "recording"] = "oracle"
    recording: str = ""  # a `toolgym record` file (source = "recording")
    num_tasks: int = 512  # oracle demos: task seeds (one demo each), from their own stream
    env_kwargs: dict[str, Any] | None = None  # oracle demos: None = [env].kwargs
    oracle: OracleConfig = msgspec.field(default_factory=OracleConfig)
    only_successful: bool = False  # keep demos whose failure mode is success
    # oracle demos: recorded in this many processes at once (0: one per usable core), each a share
    # of the task seeds; the same demos as one process records. For envs whose steps are the cost.
    processes: int = 1
    steps: int = 100  # optimizer steps
    batch_episodes: int = 64  # episodes per optimizer step
    micro_batch_tokens: int | None = None  # None = trainer.micro_batch_tokens
    # None = trainer.precision. "bf16" autocasts SFT's matmuls: about 2x faster on a CPU with
    # AVX-512 BF16, while RL can stay fp32, as the sampler computes; "auto" is bf16 only where the
    # hardware has native bf16 (on an AVX2-only CPU, emulated bf16 is tens of times slower).
    precision: Literal["fp32", "bf16", "auto"] | None = None
    log_every: int = 10
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)  # lr: 1e-3 (load.py)

    def __post_init__(self) -> None:
        _positive(
            "sft",
            num_tasks=self.num_tasks,
            steps=self.steps,
            batch_episodes=self.batch_episodes,
            micro_batch_tokens=self.micro_batch_tokens,
            log_every=self.log_every,
        )
        if self.processes < 0:
            raise ValueError(f"sft.processes must be >= 0 (0: one per usable core), got {self.processes}")
        if self.enabled and self.source == "recording" and not self.recording:
            raise ValueError('sft.recording must name a `toolgym record` file when sft.source = "recording"')


class EvalSection(EvalSchedule, **_STRICT):
    """[eval]: the loop's EvalSchedule (every_steps, 0 = only at start and end; at_start; at_end)
    and what an eval runs."""

    num_tasks: int = 64  # the fixed held-out task seeds [0, num_tasks)
    greedy: bool = True
    samples_per_task: int = 1
    num_examples: int = 2  # transcripts printed per eval
    record: bool = True  # write each eval's trajectories under trajectories/

    def __post_init__(self) -> None:
        # EvalConfig's own checks, each naming its key (EvalConfig reports only its repr)
        if self.every_steps < 0:
            raise ValueError(f"eval.every_steps must be >= 0, got {self.every_steps}")
        if self.num_examples < 0:
            raise ValueError(f"eval.num_examples must be >= 0, got {self.num_examples}")
        _positive("eval", num_tasks=self.num_tasks, samples_per_task=self.samples_per_task)
        if self.num_tasks > EVAL_SEED_COUNT:
            raise ValueError(
                f"eval.num_tasks must be <= {EVAL_SEED_COUNT} (the held-out seeds), got {self.num_tasks}"
            )
        self.to_eval_config()

    def to_eval_config(self) -> EvalConfig:
        return EvalConfig(
            num_tasks=self.num_tasks,
            greedy=self.greedy,
            samples_per_task=self.samples_per_task,
            num_examples=self.num_examples,
        )


class LoggingSection(LoggingConfig, **_STRICT):
    """trainers/metrics_log.py's LoggingConfig."""


class CheckpointSection(CheckpointConfig, **_STRICT):
    """CheckpointConfig, with `directory` a relative folder inside the run directory: a
    checkpoint never lands outside its run. at_end: checkpoint the last step (false: only the
    periodic ones, e.g. a measurement at a size whose optimizer state would fill the disk)."""

    at_end: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        parts = self.directory.replace("\\", "/").split("/")
        if self.directory.startswith(("/", "\\", "~")) or ":" in self.directory or ".." in parts:
            raise ValueError(
                "checkpoint.directory must be a relative folder inside the run directory (not "
                f"absolute, no '..'): got {self.directory!r}"
            )


class ParallelSection(msgspec.Struct, **_STRICT):
    """Processes come from torchrun (`torchrun --nproc_per_node=N -m toolgym.configs.cli train ...`)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = 0  # torch threads per process; 0 = usable cores / processes on this node

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"parallel.threads must be >= 0, got {self.threads}")


class LoopSection(msgspec.Struct, **_STRICT):
    """How rollouts and training take turns (docs/training.md, "Asynchronous RL").

    mode: "sync" (default): roll out a batch, train on it, push the weights, repeat. "async": a
        generator process samples groups continuously into a bounded buffer while the trainer
        trains (trainers/loop/).
    weight_updates: async: how the generator takes new weights. "in_flight" (default): between
        two decode steps, without draining; a running sample goes on with the new weights (over
        the k/v the old ones computed, so its later tokens' logprobs differ from the trainer's
        even at staleness 0) and its tokens record the version that sampled each. "drain": its
        running samples finish on the old weights first (agents/engine/engine.py).
    max_staleness: async: the most policy versions a trained group may lag the trainer (by its
        oldest token); an older group is handled by `over_stale`.
    over_stale: "drop" (not trained on) or "downweight" (its advantages x stale_weight); both
        counted (async/over_stale_dropped, async/over_stale_downweighted).
    buffer_groups: finished groups waiting for the trainer, at most (0: groups_per_batch x
        max_staleness, at least groups_per_batch); generation pauses while it is full.
    generator: async, torch backend: where the engine runs. "auto" (default): "process" on CPU,
        "thread" on CUDA. "process": generator_processes processes beside the trainer's, each an
        engine on the trainer's device and the envs' rollouts (groups over loopback, weights
        through shared memory). "thread": in this process, on the engine's thread, sharing the
        device with the trainer (on CPU it shares the cores too: for tests and small runs).
    generator_processes: "process": how many (0: on CPU one per core, at most 4; on CUDA one).
    generator_threads: "process": the generator processes' torch threads, in all, the trainer
        keeping the rest (0, the default: one each, and the trainer keeps all its threads: the
        two sides share the cores, configs/assembly/placement.py). With generator_ranks: each
        generator rank's (0: as every rank, parallel.threads).
    generator_ranks: async under torchrun: the last this many ranks generate (each an engine in
        its process, its own share of the task stream), the others train with FSDP2; trainer rank
        0 takes their groups and sends them the weights (trainers/loop/generators.py). 0 (default):
        one process only.
    """

    mode: Literal["sync", "async"] = "sync"
    weight_updates: Literal["in_flight", "drain"] = "in_flight"
    max_staleness: int = 1
    over_stale: Literal["drop", "downweight"] = "drop"
    stale_weight: float = 0.5
    buffer_groups: int = 0
    generator: Literal["auto", "process", "thread"] = "auto"
    generator_processes: int = 0
    generator_threads: int = 0
    generator_ranks: int = 0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"loop.max_staleness must be >= 0, got {self.max_staleness}")
        if not 0.0 <= self.stale_weight <= 1.0:
            raise ValueError(f"loop.stale_weight must be in [0, 1], got {self.stale_weight}")
        counts = ("buffer_groups", "generator_processes", "generator_threads", "generator_ranks")
        negative = [name for name in counts if getattr(self, name) < 0]
        if negative:
            raise ValueError(f"loop.{negative[0]} must be >= 0, got {getattr(self, negative[0])}")


class Config(msgspec.Struct, **_STRICT):
    """A whole run's config: one field per TOML section (the module doc)."""

    run: RunSection = msgspec.field(default_factory=RunSection)
    env: EnvSection = msgspec.field(default_factory=EnvSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    tokenizer: TokenizerSection = msgspec.field(default_factory=TokenizerSection)
    policy: PolicySection = msgspec.field(default_factory=PolicySection)
    rollout: RolloutSettings = msgspec.field(default_factory=RolloutSettings)
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    sft: SFTSection = msgspec.field(default_factory=SFTSection)
    eval: EvalSection = msgspec.field(default_factory=EvalSection)
    logging: LoggingSection = msgspec.field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = msgspec.field(default_factory=CheckpointSection)
    parallel: ParallelSection = msgspec.field(default_factory=ParallelSection)
    loop: LoopSection = msgspec.field(default_factory=LoopSection)
    agent_program: AgentProgram = msgspec.field(default_factory=AgentProgram)
    distill: DistillConfig = msgspec.field(default_factory=DistillConfig)
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    selfplay: SelfPlayConfig = msgspec.field(default_factory=SelfPlayConfig)

    @property
    def agent(self) -> PolicySection:
        """Deprecated: the old name of `policy` (kept for one release)."""
        warnings.warn("Config.agent is deprecated: use Config.policy", DeprecationWarning, stacklevel=2)
        return self.policy

    def rollout_config(self, env_kwargs: dict[str, Any] | None = None) -> EnvRolloutConfig:
        """The runner's config: [rollout], with the env from [env] (or `env_kwargs`), the sampling
        from [policy] and the seed from [run]."""
        return EnvRolloutConfig.build(
            self.rollout,
            env_id=self.env.id,
            env_kwargs=self.env.kwargs if env_kwargs is None else env_kwargs,
            sampling=self.policy,
            seed=self.run.seed,
        )
