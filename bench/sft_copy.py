"""Does SFT teach the tiny model to copy the looked-up value? Held-out loss per answer position.

    python bench/sft_copy.py                                   # the CPU demo's SFT settings
    python bench/sft_copy.py --beta2 0.999 --steps 800         # AdamW's default beta2
    python bench/sft_copy.py --lr 3e-3 --seed 1 --threads 1    # another model seed
    python bench/sft_copy.py --device cuda --seed 3            # on a GPU (many seeds side by side)
    python bench/sft_copy.py --preset pycalc_tiny              # another preset's demos

Builds a preset's oracle demonstrations (`--preset`; by default the CPU demo's
`configs/zorplex_tiny.toml`: its SFT data and model),
trains with the project's Trainer (`sft_step`, shared-prefix micro-batches) and every
`--eval-every` steps prints the mean held-out loss (nats per token, 256 demos from another task
stream) of the trained tokens by kind:

    call     the first assistant turn (`LOOKUP[word]<|im_end|>`), but its digits
    callD    the first assistant turn's digits (copied from the question: `PYTHON[print(482 * 917)]`)
    digit1   the answer's first digit (copied from the tool message)
    digitN   its later digits
    after    the token after the last digit (`.` or `<|im_end|>`)
    final    the rest of the answer turn (the tag or "The answer is", whose choice is a coin flip)
    guess    every token of a demo that answers without a call (the oracle's p_skip_lookup)

A copy that has formed shows as digit1 and digitN near 0; uniform guessing is ln 10 = 2.30.
docs/training.md ("What makes the tiny model learn to copy") quotes these runs (bench/RESULTS.md has their output).
"""

from __future__ import annotations

import argparse
import time

import msgspec
import numpy as np
import torch

from toolgym.configs.assembly.demos import demo_episodes, sft_trainer_config
from toolgym.configs.assembly.parts import build_renderer, initial_model
from toolgym.configs.load import load_config
from toolgym.rollouts.types import Episode
from toolgym.trainers.config import OptimizerConfig
from toolgym.trainers.sft import BatchOrder
from toolgym.trainers.trainer import Trainer

KINDS = ("after", "call", "callD", "digit1", "digitN", "final", "guess")


def position_kinds(episode: Episode, digit_ids: set[int]) -> list[str | None]:
    """The kind (module doc) of every token of `episode`; None where it is not trained."""
    kinds: list[str | None] = []
    turn, previous_mask, previous_digit = 0, 0, False
    for token, mask in zip(episode.tokens, episode.loss_mask, strict=True):
        turn += bool(mask and not previous_mask)
        previous_mask = mask
        if not mask:
            kinds.append(None)
            previous_digit = False
            continue
        if turn == 1:
            kind = "callD" if token in digit_ids else "call"
        elif token in digit_ids:
            kind = "digitN" if previous_digit else "digit1"
        else:
            kind = "after" if previous_digit else "final"
        previous_digit = token in digit_ids
        kinds.append(kind)
    if turn == 1:  # answered without a call
        return ["guess" if kind is not None else None for kind in kinds]
    return kinds


def heldout_losses(
    trainer: Trainer, episodes: list[Episode], kinds: list[list[str | None]]
) -> dict[str, float]:
    """Mean held-out loss per kind, from the trainer's own teacher-forced logprobs."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    trainer.model.eval()
    for logprobs, episode_kinds in zip(trainer.compute_logprobs(episodes), kinds, strict=True):
        for logprob, kind in zip(logprobs, episode_kinds, strict=True):
            if kind is not None:
                total[kind] = total.get(kind, 0.0) - logprob
                count[kind] = count.get(kind, 0) + 1
    trainer.model.train()
    return {kind: total[kind] / count[kind] for kind in sorted(total)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset", default="zorplex_tiny", help="the preset whose SFT demos and model to use"
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32, help="episodes per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--beta2", type=float, default=0.95)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor (1.0: constant)")
    parser.add_argument("--demos", type=int, default=8192)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="model init and batch order")
    parser.add_argument(
        "--stop-when-formed",
        action="store_true",
        help="stop at the first eval with every copy loss (callD, digit1, digitN) <= 0.01",
    )
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--set", action="append", default=[], help="a config override, e.g. model.overrides.rope_theta=1e4"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config, _ = load_config(
        args.preset, [f"sft.num_tasks={args.demos}", f"model.init_seed={args.seed}", *args.set]
    )
    renderer, _ = build_renderer(config)
    started = time.perf_counter()
    episodes, _, _ = demo_episodes(config, renderer, 512)
    heldout_config, _ = load_config(args.preset, ["sft.num_tasks=256", "run.seed=7", *args.set])
    heldout, _, _ = demo_episodes(heldout_config, renderer, 512)
    digit_ids = {renderer.tokenizer.token_to_id(str(d)) for d in range(10)}
    kinds = [position_kinds(e, digit_ids) for e in heldout]
    print(f"{len(episodes)} demos, {len(heldout)} held out, built in {time.perf_counter() - started:.1f}s")

    model = initial_model(config)
    optimizer = OptimizerConfig(
        lr=args.lr,
        betas=(0.9, args.beta2),
        warmup_steps=args.warmup,
        decay="cosine" if args.min_lr_ratio < 1 else "constant",
        total_steps=args.steps,
        min_lr_ratio=min(args.min_lr_ratio, 1.0),
        weight_decay=args.weight_decay,
    )
    # The demo's own trainer settings (its micro-batching decides the rounding, and the copy's
    # forming is sensitive to it), with this run's optimizer.
    trainer_config = msgspec.structs.replace(sft_trainer_config(config), optimizer=optimizer)
    trainer = Trainer(model, trainer_config, device=args.device)
    order = BatchOrder(len(episodes), args.batch, seed=args.seed)
    print(
        f"lr {args.lr} beta2 {args.beta2} wd {args.weight_decay} warmup {args.warmup} floor {args.min_lr_ratio} seed {args.seed} "
        f"batch {args.batch} on {args.device} {' '.join(args.set)}"
    )
    print("step  seconds  train loss  " + "  ".join(f"{k:>6}" for k in KINDS))
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = trainer.sft_step([episodes[i] for i in order.next()])["loss"]
        if step % args.eval_every == 0 or step == args.steps:
            losses = heldout_losses(trainer, heldout, kinds)
            cells = "  ".join(f"{losses.get(k, np.nan):6.3f}" for k in KINDS)
            print(f"{step:4d}  {time.perf_counter() - started:7.0f}  {loss:10.3f}  {cells}", flush=True)
            copies = [losses[k] for k in ("callD", "digit1", "digitN") if k in losses]
            if args.stop_when_formed and copies and max(copies) <= 0.01:
                print(f"formed by step {step}")
                break


if __name__ == "__main__":
    main()
