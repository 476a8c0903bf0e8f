"""Does a noiseless per-position signal make a Nim policy read the pile? A diagnostic.

    python bench/nim_first_move_pg.py runs/selfplay_demo/mirror_s0/sft_model [--lr 3e-4] [--steps 60]

From an SFT checkpoint of selfplay_tiny, a policy gradient on the first move alone: for every
pile of 1-15 stones (the first seat's opening observation), 8 moves a step are sampled from the
model's distribution over "1" / "2" / "3", each rewarded 1 with the probability that it wins
against the random player when the seat plays on optimally (computed exactly), with the pile's
own mean as the baseline. Every 10 steps it prints P(best move) per pile. A model that reads the
pile moves each pile toward its own best move; one that does not moves every pile alike.
"""

from __future__ import annotations

import argparse
import functools
import random

import torch
from tokenizers import Tokenizer

from toolgym.agents.chat import ChatRenderer
from toolgym.agents.model.checkpoint import load_hf_checkpoint
from toolgym.agents.types import Message
from toolgym.envs.tasks.nim import NimGame

PILES = range(1, 16)


@functools.lru_cache(None)
def win(n: int) -> float:
    """The seat to move at n stones wins (it plays on optimally; the opponent moves at random;
    a take of more than is left takes the rest)."""
    return max(after(n - a) for a in (1, 2, 3)) if n > 0 else 0.0


@functools.lru_cache(None)
def after(m: int) -> float:
    """The seat that just left m stones wins."""
    return 1.0 if m <= 0 else sum(win(m - b) if m - b > 0 else 0.0 for b in (1, 2, 3)) / 3


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    model = load_hf_checkpoint(args.checkpoint).train()
    renderer = ChatRenderer(Tokenizer.from_file(f"{args.checkpoint}/tokenizer.json"))
    moves = torch.tensor([renderer.encode(str(m))[0] for m in (1, 2, 3)])
    game = NimGame()
    prompts = [
        renderer.render_prompt(
            [Message("system", game.system_prompt("first")), Message("user", f"Stones: {n}.")]
        )
        for n in PILES
    ]
    best = [max((1, 2, 3), key=lambda a, n=n: after(n - a)) - 1 for n in PILES]  # ties: the smallest
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    for step in range(args.steps + 1):
        logits = torch.stack([model(torch.tensor([p]))[0, -1] for p in prompts])
        logp = torch.log_softmax(logits, -1)[:, moves]
        if step % 10 == 0:
            p = logp.exp().detach()
            print(
                f"step {step:3d} P(best move) by pile 1-15:",
                " ".join(f"{p[k, best[k]]:.2f}" for k in range(len(best))),
            )
        taken = torch.multinomial(logp.exp().detach(), args.samples, replacement=True)
        reward = torch.tensor(
            [
                [float(random.random() < after(n - a - 1)) for a in row]
                for n, row in zip(PILES, taken.tolist(), strict=True)
            ]
        )
        loss = -((reward - reward.mean(1, keepdim=True)) * logp.gather(1, taken)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
