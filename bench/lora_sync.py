"""One weight sync with LoRA (adapters only) against full weights, and the trainer step with each.

    python bench/lora_sync.py [--repeats 3] [--models small-25m qwen2.5-0.5b] [--ranks 8 32]
                              [--steps 3] [--rounds 2] [--parts step sync] [--threads N]

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

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.lora import LoraConfig, apply_lora
from toolgym.agents.model.transformer import build_model
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
    ap.add_argument("--parts", nargs="+", choices=["step", "sync"], default=["step", "sync"])
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


if __name__ == "__main__":
    main()
