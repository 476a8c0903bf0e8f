"""One GRPO step, toolgym vs TRL's `GRPOTrainer`, on CPU: same model, prompts, group and lengths.

    /work/venv-bench/bin/python bench/vs_trl.py                  # 4 prompts x 8, 64 new tokens
    python bench/vs_trl.py --prompts 8 --completion-len 128 --steps 5 --rounds 2 --threads 2

Needs the `bench` extra (trl, datasets, transformers) in the running interpreter's environment.

What both sides get:
- One random Qwen2 model (`--model`, a ModelConfig name, seed 0), saved once as a Hugging Face
  directory by `save_hf_checkpoint` and loaded by both in float32 (see `--precision` below).
- The same prompts: Zorplex-v0 tasks (system prompt + question, ChatML with the generation
  prompt), rendered to ids by toolgym's ChatRenderer and given to TRL as the decoded text; TRL's
  tokenizer is the same `configs/assets/tokenizer.json` (PreTrainedTokenizerFast) and the TRL
  worker checks that it encodes every prompt to exactly the same ids.
- `--prompts` prompts per step (the next ones of the same sequence each step, on both sides), group size
  `--group` (8), exactly `--completion-len` sampled tokens per completion (toolgym: no stop ids;
  TRL: min_new_tokens = max_completion_length, so EOS cannot end a completion early; both checked),
  temperature 1, no top-k/top-p.
- The same trivial reward on the completion's token ids (share of even ids), group-normalised
  advantages, the GRPO loss (PPO clip 0.2 both ways, per-sequence token mean, no KL, one update per
  batch), AdamW with the same lr, no weight decay, grad-norm clip 1.0, constant schedule, all in
  one forward/backward (TRL: per_device_train_batch_size = prompts x group; toolgym: one micro-batch).
- The same number of torch threads (`--threads`).

Same math, different work: toolgym's trainer computes the prompt prefix that all rows of the
batch share (the system prompt) once per step instead of once per row (`TrainerConfig.share_prefix`,
trainers/shared_prefix.py; the same loss and gradients, tested); TRL runs every full row.

TRL settings that differ from its defaults, for fairness: gradient checkpointing off (TRL turns it
on by default; toolgym does not recompute), loss_type "grpo" (TRL's default is "dapo"; with
fixed-length completions the two are the same numbers), constant lr; bf16 follows `--precision`.

`--precision` (both sides alike): fp32 (the default) loads, samples and trains in float32.
bf16 keeps float32 master weights on both sides and computes in bf16: toolgym's engine samples
from a bf16 copy and its trainer computes in bf16 (`TrainerConfig.precision="bf16"`: autocast
in this one process); TRL gets `bf16=True` (its accelerate autocast covers generation and training).
Worth timing on CPUs with fast bf16 matmuls (AVX-512 BF16 / AMX); elsewhere bf16 is slower.

`--replicas N` (default 1): toolgym samples with N engine processes of threads/N threads each
(agents/engine/replicas.py, `policy.replicas` in a config); its weight sync then goes to all of them.
TRL generates with its training model in its own process and has no such setting.

"One GRPO step" = generation + reward + advantages + forward/backward + optimizer step, plus the
in-process weight sync into the policy for toolgym (TRL generates with the training model
itself, so it has nothing to sync). Each system runs in its own subprocess (so neither's imports,
thread pools or process group touch the other), `--warmup` steps untimed then `--steps` timed;
the figure is the median step. TRL's step is the wall time between consecutive `on_step_end`
callbacks (everything its loop does per step); its rollout share is the time inside
`_generate_and_score_completions` (generation, decoding, reward, advantages), and train is the
rest. With `--rounds N` the two systems alternate N times and all timed steps are pooled.
Also shown: the process CPU time per step (all threads, and toolgym's engine replica processes
with --replicas; less sensitive than wall time to other
work on a shared machine, though not immune to it).

Target (issue 5): toolgym >= 3x faster than TRL per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "configs" / "assets" / "tokenizer.json"
RESULT = "RESULT "


def even_token_share(completion_ids: list[int]) -> float:
    """The trivial reward both systems use: the share of even token ids in the completion."""
    return sum(1 for t in completion_ids if t % 2 == 0) / max(len(completion_ids), 1)


# ---- setup (parent process) ---------------------------------------------------------------------


def make_prompts(count: int) -> tuple[list[list[int]], list[str]]:
    """`count` Zorplex prompts (seeds 0..count-1) as toolgym token ids and as text for TRL."""
    import gymnasium

    import toolgym.envs  # noqa: F401  (registers toolgym/*)
    from toolgym.agents.chat import ChatRenderer
    from toolgym.agents.tokenizer import load_tokenizer
    from toolgym.agents.types import Message

    tokenizer = load_tokenizer(TOKENIZER)
    renderer = ChatRenderer(tokenizer)
    env = gymnasium.make("toolgym/Zorplex-v0")
    ids, texts = [], []
    for seed in range(count):
        question, info = env.reset(seed=seed)
        prompt = renderer.render_prompt([Message("system", info["system_prompt"]), Message("user", question)])
        ids.append(prompt)
        texts.append(tokenizer.decode(prompt, skip_special_tokens=False))
    env.close()
    return ids, texts


def save_model(name: str, directory: Path) -> int:
    from toolgym.agents.model.checkpoint import save_hf_checkpoint
    from toolgym.agents.model.transformer import build_model

    model = build_model(name, seed=0)
    save_hf_checkpoint(model, model.config, directory, tokenizer_path=TOKENIZER)
    return model.config.num_params()


def spawn_worker(
    script: str, system: str, args: argparse.Namespace, workdir: Path, flags: Sequence[str], **env: str
) -> dict:
    """Run `script --worker SYSTEM` in a fresh process (OMP_NUM_THREADS = --threads) with `flags`
    of `args` passed on; returns its last RESULT line. Shared by bench/vs_trl_multiturn.py."""
    command = [sys.executable, script, "--worker", system, "--workdir", str(workdir)]
    for flag in flags:
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    environ = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false", **env)
    proc = subprocess.run(command, capture_output=True, text=True, env=environ, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{system} worker failed (exit {proc.returncode})")
    return json.loads(lines[-1][len(RESULT) :])


def run_rounds(rounds: int, run: Callable[[str], dict], show_cpu: bool = False) -> dict[str, list[dict]]:
    """Each system's worker `rounds` times, alternating which goes first; prints each run's timed
    steps. Shared by bench/vs_trl_multiturn.py."""
    runs: dict[str, list[dict]] = {"toolgym": [], "trl": []}
    for round_index in range(rounds):
        order = ("toolgym", "trl") if round_index % 2 == 0 else ("trl", "toolgym")
        for system in order:
            started = time.perf_counter()
            result = run(system)
            runs[system].append(result)
            times = ", ".join(f"{s['step']:.2f}" for s in result["steps"])
            cpus = ", cpu " + ", ".join(f"{s['cpu']:.2f}" for s in result["steps"]) + " s" if show_cpu else ""
            print(
                f"  round {round_index + 1} {result['system']}: timed steps {times} s{cpus} "
                f"({result['threads']} threads; process {time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    return runs


def require_trl(script: str) -> None:
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit(
            f"{script} needs TRL: install the bench extra in its own venv (see bench/vs_trl.py)"
        ) from None


def run_worker(system: str, args: argparse.Namespace, workdir: Path) -> dict:
    flags = ("prompts", "group", "completion_len", "steps", "warmup", "threads", "lr", "precision", "replicas")  # fmt: skip
    return spawn_worker(__file__, system, args, workdir, flags)


# ---- workers (one subprocess per system) --------------------------------------------------------


def load_workload(workdir: Path) -> tuple[list[list[int]], list[str]]:
    data = json.loads((workdir / "prompts.json").read_text())
    return data["ids"], data["texts"]


def cpu_seconds(engine) -> float:
    """CPU time of this process and of the engine's replica processes (EngineReplicas), if any."""
    total = time.process_time()
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in getattr(engine, "pids", ()):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return total


def toolgym_worker(args: argparse.Namespace, workdir: Path) -> dict:
    import torch

    from toolgym.agents.engine.engine import TorchEngine
    from toolgym.agents.engine.replicas import EngineReplicas
    from toolgym.agents.model.checkpoint import load_hf_checkpoint
    from toolgym.agents.types import SamplingParams
    from toolgym.rollouts.scoring.advantages import AdvantageConfig, AdvantageEstimator, batch_advantages
    from toolgym.rollouts.types import Episode
    from toolgym.trainers.config import OptimizerConfig, TrainerConfig
    from toolgym.trainers.losses import LossConfig
    from toolgym.trainers.trainer import Trainer
    from toolgym.trainers.weight_sync import push_weights

    torch.set_num_threads(args.threads)
    prompt_ids, _ = load_workload(workdir)
    p, g, length = args.prompts, args.group, args.completion_len
    model = load_hf_checkpoint(workdir / "model", dtype=torch.float32)
    longest = max(len(ids) for ids in prompt_ids) + length
    bf16 = args.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else None
    if args.replicas > 1:  # one engine process per share of the cores (agents/engine/replicas.py)
        rows = -(-p // args.replicas) * g  # a replica gets whole prompts
        engine = EngineReplicas(
            model, replicas=args.replicas, max_batch_size=rows, max_seq_len=longest, dtype=dtype
        )
    else:
        engine = TorchEngine(model, max_batch_size=p * g, max_seq_len=longest, seed=0, dtype=dtype)
    trainer = Trainer(
        model,
        TrainerConfig(
            precision=args.precision,
            loss=LossConfig(name="grpo"),
            optimizer=OptimizerConfig(lr=args.lr, max_grad_norm=1.0),
            micro_batch_tokens=p * g * longest,  # the whole batch in one forward/backward, like TRL
        ),
        device="cpu",
    )
    params = SamplingParams(max_tokens=length, temperature=1.0, n=g, stop_token_ids=())
    advantage_config = AdvantageConfig(estimator=AdvantageEstimator.GRPO, eps=1e-6)  # GRPO, as TRL's
    steps = []
    for step in range(args.warmup + args.steps):
        prompts = prompt_ids[step * p : (step + 1) * p]
        start, cpu_start = time.perf_counter(), cpu_seconds(engine)
        completions = engine.generate_sync(prompts, params)
        rewards = [even_token_share(c.tokens) for c in completions]
        group_ids = [i // g for i in range(len(completions))]
        advantages = batch_advantages(rewards, group_ids, advantage_config)
        episodes = []
        for i, (c, a) in enumerate(zip(completions, advantages, strict=True)):
            prompt = prompts[i // g]
            episodes.append(
                Episode(
                    tokens=prompt + c.tokens,
                    loss_mask=[0] * len(prompt) + [1] * len(c.tokens),
                    sampler_logprobs=[0.0] * len(prompt) + c.logprobs,
                    advantages=[0.0] * len(prompt) + [a] * len(c.tokens),
                    policy_version=c.policy_version,
                    group_id=i // g,
                    reward=rewards[i],
                )
            )
        rollout_done = time.perf_counter()
        metrics = trainer.train_step(episodes)
        train_done = time.perf_counter()
        push_weights(trainer, engine)
        end, cpu_end = time.perf_counter(), cpu_seconds(engine)
        lengths = {len(c.tokens) for c in completions}
        if lengths != {length} or len(completions) != p * g:
            raise RuntimeError(f"expected {p * g} completions of {length} tokens, got lengths {lengths}")
        if metrics["skipped"]:
            raise RuntimeError("the toolgym update was skipped (non-finite loss or grad norm)")
        steps.append(
            dict(
                step=end - start,
                rollout=rollout_done - start,
                train=train_done - rollout_done,
                sync=end - train_done,
                cpu=cpu_end - cpu_start,
                tokens=sum(len(e.tokens) for e in episodes),
            )
        )
    engine.close()
    torch.distributed.destroy_process_group()
    return dict(system="toolgym", threads=torch.get_num_threads(), steps=steps[args.warmup :])


def trl_worker(args: argparse.Namespace, workdir: Path) -> dict:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    prompt_ids, texts = load_workload(workdir)
    p, g, length = args.prompts, args.group, args.completion_len
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    encoded = tokenizer(text=texts)["input_ids"]
    mismatched = [i for i, (a, b) in enumerate(zip(encoded, prompt_ids, strict=True)) if a != b]
    if mismatched:
        raise RuntimeError(f"TRL's tokenizer encodes prompts {mismatched[:5]} differently from toolgym's")
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32)
    total_steps = args.warmup + args.steps
    config = trl.GRPOConfig(
        output_dir=str(workdir / "trl"),
        use_cpu=True,
        bf16=args.precision == "bf16",
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=p * g,
        gradient_accumulation_steps=1,
        num_generations=g,
        max_completion_length=length,
        generation_kwargs={"min_new_tokens": length},
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        loss_type="grpo",
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        max_steps=total_steps,
        shuffle_dataset=False,
        seed=0,
        report_to="none",
        logging_steps=10**9,
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )
    rollout_seconds: list[float] = []
    step_ends: list[tuple[float, float]] = []  # (wall, process CPU) at each step's end
    lengths: set[int] = set()
    seen_prompts: list[list[str]] = []  # per step, the prompt of every completion in order

    def reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
        lengths.update(len(ids) for ids in completion_ids)
        seen_prompts.append(list(prompts))
        return [even_token_share(ids) for ids in completion_ids]

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            rollout_seconds.append(time.perf_counter() - start)
            return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not step_ends:  # the first step has no previous end
                step_ends.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append((time.perf_counter(), time.process_time()))

    dataset = datasets.Dataset.from_dict({"prompt": texts[: total_steps * p]})
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.train()
    if lengths != {length}:
        raise RuntimeError(f"TRL completions were not all {length} tokens long: lengths {sorted(lengths)}")
    expected = [[t for t in texts[i * p : (i + 1) * p] for _ in range(g)] for i in range(total_steps)]
    if seen_prompts != expected:
        raise RuntimeError("TRL's steps did not see the same prompts (each G times in a row) as toolgym's")
    if len(rollout_seconds) != total_steps or len(step_ends) != total_steps + 1:
        raise RuntimeError(f"TRL ran {len(rollout_seconds)} rollouts, {len(step_ends) - 1} steps")
    steps = []
    for i in range(args.warmup, total_steps):
        step = step_ends[i + 1][0] - step_ends[i][0]
        cpu = step_ends[i + 1][1] - step_ends[i][1]
        step_tokens = sum(len(ids) for ids in prompt_ids[i * p : (i + 1) * p]) * g + p * g * length
        steps.append(
            dict(
                step=step,
                rollout=rollout_seconds[i],
                train=step - rollout_seconds[i],
                cpu=cpu,
                tokens=step_tokens,
            )
        )
    return dict(
        system=f"TRL {trl.__version__}",
        threads=torch.get_num_threads(),
        steps=steps,
        versions=dict(trl=trl.__version__, transformers=transformers.__version__, torch=torch.__version__),
    )


# ---- report -------------------------------------------------------------------------------------


def summarise(results: list[dict]) -> dict:
    steps = [s for r in results for s in r["steps"]]

    def median(key: str) -> float | None:
        values = [s[key] for s in steps if key in s]
        return statistics.median(values) if values else None

    return dict(
        system=results[0]["system"],
        step=median("step"),
        rollout=median("rollout"),
        train=median("train"),
        sync=median("sync"),
        cpu=median("cpu"),
        tokens=median("tokens"),
        spread=(min(s["step"] for s in steps), max(s["step"] for s in steps)),
        count=len(steps),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-3m", help="ModelConfig name of the random Qwen2 model")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--completion-len", type=int, default=64, help="sampled tokens per completion")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (>= 1)")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the two systems this many times")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--precision", choices=("fp32", "bf16"), default="fp32",
        help="bf16: toolgym samples in bf16 and trains with bf16 compute (fp32 master weights); TRL bf16=True",
    )  # fmt: skip
    parser.add_argument(
        "--replicas", type=int, default=1,
        help="toolgym samples with this many engine processes of threads/replicas threads each (agents/engine/replicas.py)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the raw per-step timings here")
    parser.add_argument("--worker", choices=("toolgym", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1 or args.group < 2 or args.prompts < 1:
        parser.error("--warmup, --steps, --rounds, --prompts must be >= 1 and --group >= 2")

    if args.worker:
        worker = toolgym_worker if args.worker == "toolgym" else trl_worker
        print(RESULT + json.dumps(worker(args, args.workdir)), flush=True)
        return

    require_trl("bench/vs_trl.py")
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        workdir = Path(tmp)
        params = save_model(args.model, workdir / "model")
        ids, texts = make_prompts((args.warmup + args.steps) * args.prompts)
        (workdir / "prompts.json").write_text(json.dumps({"ids": ids, "texts": texts}))
        print(
            f"model {args.model} ({params / 1e6:.1f}M params, {args.precision}), {args.prompts} prompts x G={args.group}, "
            f"{args.completion_len} new tokens, prompts {min(map(len, ids))}-{max(map(len, ids))} tokens, "
            f"{args.threads} threads, {args.warmup} warm-up + {args.steps} timed steps x {args.rounds} round(s)",
            flush=True,
        )
        runs = run_rounds(args.rounds, lambda system: run_worker(system, args, workdir))

    ours, theirs = summarise(runs["toolgym"]), summarise(runs["trl"])
    versions = runs["trl"][0]["versions"]
    print(f"\ntorch {versions['torch']}, transformers {versions['transformers']}, TRL {versions['trl']}")
    print(format_table(ours, theirs, args))
    ratio = theirs["step"] / ours["step"]
    cpu_ratio = theirs["cpu"] / ours["cpu"]
    print(
        f"\ntoolgym is {ratio:.2f}x faster than TRL per GRPO step (target >= 3x); "
        f"{cpu_ratio:.2f}x less process CPU time per step"
    )
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))


def format_table(ours: dict, theirs: dict, args: argparse.Namespace) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import format_table as table

    sampled = args.prompts * args.group * args.completion_len
    rows = []
    for s in (ours, theirs):
        rows.append(
            [
                s["system"],
                f"{s['step']:.3f}",
                f"{s['spread'][0]:.2f}-{s['spread'][1]:.2f}",
                f"{s['rollout']:.3f}",
                f"{s['train']:.3f}",
                "-" if s["sync"] is None else f"{s['sync']:.4f}",
                f"{sampled} / {int(s['tokens'])}",
                f"{sampled / s['rollout']:.0f}",
                f"{s['cpu']:.2f}",
                f"{theirs['step'] / s['step']:.2f}x",
            ]
        )
    headers = [
        "system",
        "step s (median)",
        "min-max",
        "rollout s",
        "train s",
        "sync s",
        "tokens/step (sampled / total)",
        "gen tok/s",
        "cpu s",
        "speed vs TRL",
    ]
    return table(headers, rows)


if __name__ == "__main__":
    main()
