"""The CPU demo's SFT step, the trainer as it is against a variant, in one process.

    python bench/sft_step.py [--steps 8] [--repeats 3] [--against fsdp2|logits]

The SFT phase is most of the demo's time (1,500 of these steps). Its batches here are the
demo's: `configs/zorplex_tiny.toml`'s oracle demonstrations (1,024 tasks instead of 8,192, the
same distribution), 32 episodes per step, the preset's SFT optimizer. Two trainers from the same
initial weights take the same batches:
- plain: what `Trainer` does in a world of one in fp32 (`shard_model` returns the model as is);
- fsdp2 (`--against fsdp2`, the default): the same model wrapped by `fsdp_wrap` (what every world
  size used before), which in one process neither shards nor casts but copies every parameter in
  and every gradient out per step;
- logits (`--against logits`): whole logits (`trainer.fused_head = false`) instead of the fused head.
The two alternate, `--steps` steps at a time, `--repeats` times; printed: ms per step (best and
median of the repeats), the ratio, and both trainers' loss on one more batch (they should agree).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, machine_summary

import toolgym.trainers.trainer as trainer_module
from toolgym.configs.assembly.demos import demo_episodes, sft_trainer_config
from toolgym.configs.assembly.parts import build_renderer, initial_model, model_config, policy_max_seq_len
from toolgym.configs.load import load_config
from toolgym.trainers.distributed import fsdp_wrap
from toolgym.trainers.sft import BatchOrder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="steps per timed window")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--against", choices=["fsdp2", "logits"], default="fsdp2")
    args = ap.parse_args()

    config, _ = load_config("zorplex_tiny", ["sft.num_tasks=1024"])
    renderer, _ = build_renderer(config)
    episodes, _, _ = demo_episodes(config, renderer, policy_max_seq_len(config, model_config(config)))
    order = BatchOrder(len(episodes), config.sft.batch_episodes, seed=0)
    batches = [[episodes[i] for i in order.next()] for _ in range(3 + args.steps * args.repeats + 1)]

    trainers = {
        "plain": trainer_module.Trainer(initial_model(config), sft_trainer_config(config), device="cpu")
    }
    other = args.against
    if other == "logits":
        logits_config = msgspec.structs.replace(sft_trainer_config(config), fused_head=False)
        trainers[other] = trainer_module.Trainer(initial_model(config), logits_config, device="cpu")
    else:
        plain_shard = trainer_module.shard_model
        trainer_module.shard_model = fsdp_wrap
        try:
            trainers[other] = trainer_module.Trainer(
                initial_model(config), sft_trainer_config(config), device="cpu"
            )
        finally:
            trainer_module.shard_model = plain_shard

    for trainer in trainers.values():
        for batch in batches[:3]:  # warm-up
            trainer.sft_step(batch)
    ms: dict[str, list[float]] = {name: [] for name in trainers}
    for r in range(args.repeats):
        window = batches[3 + r * args.steps : 3 + (r + 1) * args.steps]
        for name, trainer in trainers.items():
            start = time.perf_counter()
            for batch in window:
                trainer.sft_step(batch)
            ms[name].append((time.perf_counter() - start) / len(window) * 1e3)
    loss = {name: trainer.sft_step(batches[-1])["loss"] for name, trainer in trainers.items()}

    print(f"{machine_summary()}; zorplex_tiny SFT step ({config.sft.batch_episodes} demos), "
          f"{args.repeats} windows of {args.steps} steps")  # fmt: skip
    rows = [[n, f"{min(v):.0f}", f"{statistics.median(v):.0f}", f"{loss[n]:.6f}"] for n, v in ms.items()]
    print(format_table(["trainer", "ms/step (best)", "(median)", "loss after"], rows))
    print(f"{other} / plain: {min(ms[other]) / min(ms['plain']):.2f}x (best), "
          f"{statistics.median(ms[other]) / statistics.median(ms['plain']):.2f}x (median)")  # fmt: skip


if __name__ == "__main__":
    main()
