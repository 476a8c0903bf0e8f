"""One weight sync with LoRA (adapters only) against full weights, and the trainer step with each.

    python bench/lora_sync.py [--repeats 3] [--models small-25m qwen2.5-0.5b] [--ranks 8 32]
                              [--steps 3] [--rounds 2] [--parts step sync decode] [--threads N]
                              [--decode-batch 16] [--decode-tokens 64]

Sync: for each model shape (random weights) a trainer and a torch engine built from the same model
(float32, CPU); `push_weights` with full fine-tuning (every tensor, the tied head once) and with
LoRA at each rank over the attention and MLP projections (the adapters alone, plus the
version/checksum check the sync makes). Printed: the bytes sent (float32), the best and median
wall time of `push_weights`, and of writing the same tensors into a shared-memory buffer (what
`SharedWeights` does for generator processes).

Step: `Trainer.train_step` on small-25m, full against LoRA rank 8, each in a process of its own
(so the peak RSS is that configuration's), alternating, `--rounds` times: 8 episodes of 128
tokens, GRPO, fp32. Printed: best and median step time over every round's `--steps` steps (each
round after one warm-up step), and the largest peak RSS of its processes.

Decode (`--parts decode`): the torch engine's decode throughput on `--decode-model` (small-25m) with LoRA at the
first `--ranks` (B drawn non-zero, as after training) served unmerged (`policy.lora.serving =
"unmerged"`: each adapted linear computes x W^T + s (x A^T) B^T on the fly, on plain layers)
against served merged (the default: W0 + s B A refolded into the weights on each sync, on the
machine's default layers: oneDNN packing, vLLM's kernels where present), and each one's
adapter-only sync (`load_weights` of the adapters: a copy, or a copy, the refold and the repack).
Each call decodes `--decode-tokens` tokens for `--decode-batch` prompts of 32 tokens; decode
tokens/s = batch * (tokens - 1) / (time of that call - time of a 1-token call), best of
`--repeats`, the engines measured in turn `--rounds` times (best round counts). Printed: the
throughputs, the unmerged / merged ratio from the same run, and after how many decoded tokens a
step the merged engine's costlier sync is paid back.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _common import format_table, machine_summary, time_repeats

from toolgym.agents.engine.backend import select_backend
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.lora import LoraConfig, adapter_tensors, apply_lora
from toolgym.agents.model.transformer import build_model
from toolgym.agents.types import SamplingParams
from toolgym.rollouts.types import Episode
from toolgym.trainers.config import TrainerConfig
from toolgym.trainers.losses import LossConfig
from toolgym.trainers.trainer import Trainer
from toolgym.trainers.weight_sync import SharedWeights, flat_weights, gather_weights, push_weights

MIB = 2**20


def episodes(vocab: int, count: int = 8, length: int = 128, seed: int = 0) -> list[Episode]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = length // 4
        tokens = [rng.randrange(vocab) for _ in range(length)]
        out.append(
            Episode(
                tokens=tokens,
                loss_mask=[0] * prompt + [1] * (length - prompt),
                sampler_logprobs=[0.0] * prompt + [-rng.random() * 5 for _ in range(length - prompt)],
                advantages=[0.0] * prompt + [1.0 if i % 2 else -1.0] * (length - prompt),
            )
        )
    return out


def sync_row(base: torch.nn.Module, name: str, rank: int, repeats: int) -> list[object]:
    model = copy.deepcopy(base)
    if rank:
        apply_lora(model, LoraConfig(rank=rank))
    trainer = Trainer(model, TrainerConfig(loss=LossConfig(name="grpo")), device="cpu")
    engine = TorchEngine(model, max_batch_size=1, max_seq_len=64, history_capacity=0)
    try:
        weights = gather_weights(trainer)
        nbytes = sum(t.numel() * 4 for t in weights.values())
        push = time_repeats(lambda: push_weights(trainer, engine), repeats)
        _, _, parts = flat_weights(weights)
        shared = SharedWeights(sum(p.numel() for p in parts))
        try:

            def write_shared() -> None:
                _, _, parts = flat_weights(gather_weights(trainer))
                torch.cat(parts, out=shared.buffer)

            shm = time_repeats(write_shared, repeats)
        finally:
            shared.unlink()
    finally:
        engine.close()
    return [
        name,
        f"LoRA r{rank}" if rank else "full",
        len(weights),
        f"{nbytes / MIB:,.2f}",
        f"{push.best * 1e3:,.1f} / {push.median * 1e3:,.1f}",
        f"{shm.best * 1e3:,.1f} / {shm.median * 1e3:,.1f}",
    ]


def step_worker(rank: int, steps: int) -> None:
    """Run in a process of its own: print one JSON line with the step times and the peak RSS."""
    model = build_model("small-25m", seed=0)
    if rank:
        apply_lora(model, LoraConfig(rank=rank))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainer = Trainer(
        model, TrainerConfig(loss=LossConfig(name="grpo"), micro_batch_tokens=4096), device="cpu"
    )
    batch = episodes(model.config.vocab_size)
    trainer.train_step(batch)  # warm-up (allocator, optimizer state)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step(batch)
        seconds.append(time.perf_counter() - start)
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child would report the parent's.
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    print(json.dumps({"seconds": seconds, "peak_rss": peak, "trainable": trainable}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=["small-25m", "qwen2.5-0.5b"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--steps", type=int, default=3, help="timed trainer steps per process")
    ap.add_argument("--rounds", type=int, default=2, help="processes per configuration, alternating")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--parts", nargs="+", choices=["step", "sync", "decode"], default=["step", "sync"])
    ap.add_argument("--decode-batch", type=int, default=16, help="decode: prompts decoded together")
    ap.add_argument("--decode-tokens", type=int, default=64, help="decode: new tokens per prompt")
    ap.add_argument("--decode-model", default="small-25m", help="decode: the model's shape")
    ap.add_argument("--step-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.step_worker is not None:
        step_worker(args.step_worker, args.steps)
        return
    print(machine_summary())

    if "step" in args.parts:
        step_table(args)
    if "sync" in args.parts:
        sync_table(args)
    if "decode" in args.parts:
        decode_table(args)


def step_table(args: argparse.Namespace) -> None:
    results: dict[int, list[dict]] = {0: [], args.ranks[0]: []}
    for _ in range(args.rounds):
        for rank in results:
            out = subprocess.run(
                [sys.executable, __file__, "--step-worker", str(rank), "--steps", str(args.steps)]
                + (["--threads", str(args.threads)] if args.threads else []),
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results[rank].append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    for rank, runs in results.items():
        seconds = sorted(s for run in runs for s in run["seconds"])
        rows.append(
            [
                f"LoRA r{rank}" if rank else "full",
                f"{runs[0]['trainable'] / 1e6:,.2f}M",
                f"{seconds[0] * 1e3:,.0f} / {seconds[len(seconds) // 2] * 1e3:,.0f}",
                f"{max(run['peak_rss'] for run in runs) / MIB:,.0f}",
            ]
        )
    print("\nTrainer step, small-25m, 8 x 128 tokens, GRPO, fp32 (ms best / median; own process each)")
    print(format_table(["weights", "trainable", "step", "peak RSS MiB"], rows))


def sync_table(args: argparse.Namespace) -> None:
    rows = []
    for name in args.models:
        base = build_model(name, seed=0)
        rows += [sync_row(base, name, rank, args.repeats) for rank in (0, *args.ranks)]
        del base
    print("\nOne weight sync (float32, CPU; ms best / median)")
    print(format_table(["model", "weights", "tensors", "MiB sent", "push_weights", "shared memory"], rows))


def decode_engines(
    model: str, rank: int, batch: int
) -> tuple[dict[str, TorchEngine], dict[str, torch.Tensor]]:
    """`model` with LoRA at `rank` (B non-zero), served unmerged (plain layers) and merged (the
    engine's default: its default layers); and the adapters, for timing a sync."""
    lora = apply_lora(build_model(model, seed=0), LoraConfig(rank=rank), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in adapter_tensors(lora):
            if ".lora_B." in name:
                tensor.copy_(0.01 * torch.randn(tensor.shape, generator=g))
    adapters = {name: tensor.clone() for name, tensor in adapter_tensors(lora)}
    unmerged = select_backend(lora.config, "cpu", torch.float32, lora="unmerged")
    kwargs = dict(max_batch_size=batch, max_seq_len=256, history_capacity=0)
    return {
        f"LoRA r{rank} unmerged": TorchEngine(copy.deepcopy(lora), backend=unmerged, **kwargs),
        f"LoRA r{rank} merged (default)": TorchEngine(lora, **kwargs),
    }, adapters


def decode_table(args: argparse.Namespace) -> None:
    rank, batch, tokens = args.ranks[0], args.decode_batch, args.decode_tokens
    engines, adapters = decode_engines(args.decode_model, rank, batch)
    rng = random.Random(0)
    vocab = next(iter(engines.values())).model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(32)] for _ in range(batch)]

    def call(engine: TorchEngine, n: int) -> None:
        engine.generate_sync(prompts, SamplingParams(max_tokens=n, temperature=1.0, seed=0))

    def sync(engine: TorchEngine) -> None:  # an adapter-only sync, as after each RL step
        engine.load_weights(adapters.items(), engine.policy_version + 1)

    best: dict[str, float] = {}
    load: dict[str, float] = {}
    rounds: list[dict[str, float]] = []
    try:
        for _ in range(args.rounds):
            this = {}
            for name, engine in engines.items():
                prefill = time_repeats(lambda e=engine: call(e, 1), args.repeats).best
                full = time_repeats(lambda e=engine: call(e, tokens), args.repeats).best
                this[name] = batch * (tokens - 1) / (full - prefill)
                best[name] = max(best.get(name, 0.0), this[name])
                took = time_repeats(lambda e=engine: sync(e), args.repeats).best
                load[name] = min(load.get(name, took), took)
            rounds.append(this)
        lines = [engine.backend.describe() for engine in engines.values()]
    finally:
        for engine in engines.values():
            engine.close()
    unmerged = f"LoRA r{rank} unmerged"
    rows = [
        [name, f"{value:,.0f}", f"{best[unmerged] / value:.2f}", f"{1e3 * load[name]:.1f}"]
        for name, value in best.items()
    ]
    print(
        f"\nTorch engine decode, {args.decode_model}, LoRA r{rank}, float32, batch {batch}, {tokens} new tokens "
        f"(tokens/s, best of {args.rounds} rounds x {args.repeats}; threads {torch.get_num_threads()})"
    )
    print(format_table(["weights", "decode tok/s", "unmerged / this", "adapter sync ms"], rows))
    merged = next(name for name in best if name != unmerged)
    saved = 1 / best[unmerged] - 1 / best[merged]  # seconds per decoded token
    extra = load[merged] - load[unmerged]
    if saved > 0:
        print(f"merged pays back its sync after {max(extra, 0.0) / saved:,.0f} decoded tokens a step")
    for name, line in zip(best, lines, strict=True):
        print(f"{name}: {line}")
    for i, this in enumerate(rounds):
        print(f"round {i + 1}: unmerged / merged = {this[unmerged] / this[merged]:.2f}")


if __name__ == "__main__":
    main()
