"""Trainer throughput: tokens/s and model FLOPs utilisation (MFU) against the measured matmul peak.

    python bench/train.py                                  # CPU: bench-3m and small-25m, 1 and 2 procs, fp32 and bf16
    python bench/train.py --sweep                          # CPU: micro-batch token budgets, small-25m fp32 1 proc
    python bench/train.py --heads fused,logits --recompute off,on --compile off,on  # trainer options
    python bench/train.py --device cuda --models qwen2.5-0.5b --precisions bf16 --procs 1 \
        --seq-len 1024 --micro-batch-tokens 16384 --episodes 64      # GPU (target >= 40% of bf16 peak)

Each configuration runs in a fresh process (torchrun for 2 processes; the processes split the
machine's CPU threads). One DAPO train_step on synthetic Episodes of `--seq-len` tokens (a 32-token
masked prompt, the rest sampled) is warmed up, then `--steps` steps are timed; the best step is
reported (a shared machine only adds delay). Weight sync is gathering the full state dict and
loading it into a TorchEngine on the same device. `--heads` compares the fused head (logprobs straight
from the hidden states, `TrainerConfig.fused_head`) with whole logits, `--recompute` activation
checkpointing, `--compile` torch.compile'd decoder blocks (the warm-up step compiles);
`--profile` prints one step's top operators (torch.profiler) per configuration.

FLOPs per trained position: 6 x (matmul parameters: every Linear, lm_head included, the embedding
lookup not) + 6 x layers x heads x head_dim x seq_len (causal attention QK^T and AV, forward and
backward, averaged over positions). MFU = FLOPs / time / the single-process matmul peak of the
same dtype, measured first with bench/_common.matmul_peak_flops.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import format_table, machine_summary, matmul_peak_flops

RESULT = "RESULT "
PROFILE = "PROFILE "


def flops_per_position(config, seq_len: int) -> float:
    matmul_params = config.num_params(include_embedding=False) + config.vocab_size * config.hidden_size
    attention = config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len
    return 6.0 * matmul_params + 6.0 * attention


def worker(args: argparse.Namespace) -> None:
    """One configuration (under torchrun or plain); rank 0 prints a RESULT json line."""
    from toolgym.agents.engine.engine import TorchEngine
    from toolgym.agents.model.config import ModelConfig
    from toolgym.agents.model.transformer import build_model
    from toolgym.rollouts.types import Episode
    from toolgym.trainers.config import OptimizerConfig, TrainerConfig
    from toolgym.trainers.losses import LossConfig
    from toolgym.trainers.trainer import Trainer
    from toolgym.trainers.weight_sync import push_weights

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.device == "cpu":
        torch.set_num_threads(max(1, args.threads // world))
    config = ModelConfig.named(args.model)
    rng = random.Random(0)
    prompt = min(32, args.seq_len // 2)
    episodes = []
    for _ in range(args.episodes):
        tokens = [rng.randrange(config.vocab_size) for _ in range(args.seq_len + 1)]
        mask = [0] * prompt + [1] * (args.seq_len + 1 - prompt)
        logprob = -float(torch.log(torch.tensor(float(config.vocab_size))))
        episodes.append(
            Episode(
                tokens=tokens,
                loss_mask=mask,
                sampler_logprobs=[logprob * m for m in mask],
                advantages=[rng.choice((-1.0, 1.0)) * m for m in mask],
            )
        )
    trainer_config = TrainerConfig(
        loss=LossConfig(name="dapo"),
        optimizer=OptimizerConfig(lr=1e-6),
        micro_batch_tokens=args.micro_batch_tokens,
        precision=args.precision,
        compute_entropy=not args.no_entropy,
        fused_head=args.head == "fused",
        activation_checkpointing=args.recompute == "on",
        compile=args.compile_blocks == "on",
    )
    trainer = Trainer(build_model(config, seed=0), trainer_config, device=args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train_step(episodes)  # warm-up
    best = None
    for _ in range(args.steps):
        metrics = trainer.train_step(episodes)
        if best is None or metrics["step_time_s"] < best["step_time_s"]:
            best = metrics
    peak_gib = _peak_memory_gib(args.device)
    if args.profile and trainer.dist.is_main:
        _print_profile(trainer, episodes, args.device)
    engine = None
    if trainer.dist.is_main:
        dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        engine = TorchEngine(
            build_model(config, seed=1, dtype=dtype, device=trainer.device), max_batch_size=1
        )
    sync = min(push_weights(trainer, engine) for _ in range(3))
    if engine is not None:
        engine.close()
    if trainer.dist.is_main:
        positions = best["num_positions"]
        flops = flops_per_position(config, args.seq_len) * positions
        result = {
            "tokens_per_s": positions / best["step_time_s"],
            "flops_per_s": flops / best["step_time_s"],
            "step_time_s": best["step_time_s"],
            "micro_batches": best["num_micro_batches"],
            "params": config.num_params(),
            "sync_s": sync,
            "peak_gib": peak_gib,
        }
        print(RESULT + json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()


def _peak_memory_gib(device: str) -> float:
    """The training's memory high-water mark: allocated on a GPU, the process's peak RSS on a CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _print_profile(trainer, episodes, device: str) -> None:
    """One more step under torch.profiler: its top operators by own time, as PROFILE lines."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        trainer.train_step(episodes)
        if device == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
    for line in table.splitlines():
        print(PROFILE + line, flush=True)


def run_config(args: argparse.Namespace, **overrides) -> dict | None:
    """Run one configuration in a fresh process (or torchrun group); its RESULT, or None on failure."""
    settings = {**vars(args), **overrides}
    flags = ["--worker"]
    for key in (
        "model",
        "precision",
        "micro_batch_tokens",
        "seq_len",
        "episodes",
        "steps",
        "device",
        "threads",
        "head",
        "recompute",
        "compile_blocks",
    ):
        flags += [f"--{key.replace('_', '-')}", str(settings[key])]
    if settings["no_entropy"]:
        flags.append("--no-entropy")
    if settings["profile"]:
        flags.append("--profile")
    procs = settings["procs_one"]
    script = str(Path(__file__).resolve())
    if procs == 1:
        cmd = [sys.executable, script, *flags]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={procs}",
            script,
            *flags,
        ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if settings["device"] == "cpu":
        env["OMP_NUM_THREADS"] = str(max(1, settings["threads"] // procs))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    profile = [line[len(PROFILE) :] for line in done.stdout.splitlines() if line.startswith(PROFILE)]
    if profile:
        print(f"profile of one step, {overrides}:", *profile, sep="\n", flush=True)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    print(f"configuration {overrides} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}", file=sys.stderr)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="bench-3m,small-25m")
    parser.add_argument("--procs", default="1,2")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--episodes", type=int, default=32, help="episodes per step (all ranks together)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads in all")
    parser.add_argument("--no-entropy", action="store_true", help="skip the entropy metric (a vocab softmax)")
    parser.add_argument("--sweep", action="store_true", help="try micro-batch token budgets (1 proc, fp32)")
    parser.add_argument("--heads", default="fused", help="fused, logits or both (TrainerConfig.fused_head)")
    parser.add_argument(
        "--recompute", default="off", help="off, on or both: activation checkpointing per decoder block"
    )
    parser.add_argument("--profile", action="store_true", help="print one step's top operators per row")
    parser.add_argument("--compile", default="off", help="off, on or both: torch.compile'd decoder blocks")
    parser.add_argument("--head", default="fused", help=argparse.SUPPRESS)
    parser.add_argument("--compile-blocks", default="off", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="bench-3m", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    device = torch.device(args.device)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)  # the peak with the threads the runs share
    peaks = {
        name: matmul_peak_flops(dtype, device)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    print(machine_summary())
    variants = [
        (h, r, c) for h in args.heads.split(",") for r in args.recompute.split(",") for c in args.compile.split(",")
    ]
    if args.sweep:
        grid = [
            (m, 1, "fp32", b, *variant)
            for m in args.models.split(",")
            for b in (1024, 2048, 4096, 8192, 16384)
            for variant in variants
        ]
    else:
        grid = [
            (m, int(p), prec, args.micro_batch_tokens, *variant)
            for m in args.models.split(",")
            for p in args.procs.split(",")
            for prec in args.precisions.split(",")
            for variant in variants
        ]
    results = []
    for model, procs, precision, budget, head, recompute, compiled in grid:
        start = time.perf_counter()
        result = run_config(
            args,
            model=model,
            procs_one=procs,
            precision=precision,
            micro_batch_tokens=budget,
            head=head,
            recompute=recompute,
            compile_blocks=compiled,
        )
        key = (model, procs, precision, budget, head, recompute, compiled)
        results.append((key, result, time.perf_counter() - start))
    # The peak is a property of the machine: on a shared one the best of two measurements (before
    # and after the runs) is the better estimate. The MFU columns use it.
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peaks[name] = max(peaks[name], matmul_peak_flops(dtype, device))
    print(f"matmul peak: fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s")
    rows = []
    for (model, procs, precision, budget, head, recompute, compiled), result, wall in results:
        if result is None:
            failed = ["failed", "", "", "", "", "", f"{wall:.0f}"]
            rows.append([model, "-", procs, precision, budget, head, recompute, compiled, *failed])
            continue
        flops = result["flops_per_s"]
        rows.append(
            [
                model,
                f"{result['params'] / 1e6:.1f}M",
                procs,
                precision,
                budget,
                head,
                recompute,
                compiled,
                f"{result['tokens_per_s']:.0f}",
                f"{flops / 1e9:.1f}",
                f"{100 * flops / peaks['fp32']:.0f}%",
                f"{100 * flops / peaks['bf16']:.0f}%",
                f"{result['sync_s'] * 1e3:.1f}",
                f"{result['peak_gib']:.2f}",
                f"{wall:.0f}",
            ]
        )
    headers = [
        "model",
        "params",
        "procs",
        "precision",
        "mb tokens",
        "head",
        "recompute",
        "compile",
        "tokens/s",
        "GFLOP/s",
        "MFU fp32",
        "MFU bf16",
        "sync ms",
        "peak GiB",
        "wall s",
    ]
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
