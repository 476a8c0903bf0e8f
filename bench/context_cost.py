"""What a context rewrite costs the trainer: tokens processed per episode and trainer time per step.

    python bench/context_cost.py                    # 4 tasks x G=4, one timed step per layout
    python bench/context_cost.py --tasks 8 --repeats 3

Episodes: Zorplex recursive chains (`--redirects` SEE links, so 2 x redirects + 2 turns with
notes) played by the oracle through the rollout runner with the shipped tokenizer, under three
context policies (rollouts/context.py): keep everything (one growing sequence), model-written
notes that keep the last note (`notes`, the env's NOTE tool: a new segment after every note),
and a sliding window of two turns (a new segment every turn past the window).

Per policy, tokens processed per episode, three ways:
- `re-encode`: every turn trained as its own sequence (its whole prompt + its action), what a
  trainer that does not keep token-exact segments pays: quadratic in the turns;
- `segments`: the Episodes rollouts/episodes.py builds, each segment encoded in full;
- `shared`: the same Episodes in the trainer's shared-prefix layout (trainers/shared_prefix.py),
  where the system prompt the segments share is computed once per micro-batch.
Then, for the notes episodes, one `Trainer.train_step` (the bench-3m model, fp32, dapo loss) on
the whole batch with `share_prefix` on and off, best of `--repeats`, and the ratio of the two,
measured in the same run on the same Episodes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, machine_summary, time_repeats

from toolgym.agents.chat import ChatRenderer
from toolgym.agents.model.config import NAMED_CONFIGS, ModelConfig
from toolgym.agents.model.transformer import Transformer
from toolgym.agents.tokenizer import load_tokenizer
from toolgym.configs.cli.main import DEFAULT_TOKENIZER
from toolgym.rollouts.context import KeepAll, Notes, SlidingWindow
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.episodes import build_episodes
from toolgym.rollouts.scripted import OraclePolicy
from toolgym.rollouts.types import SEQUENCE_START, Trajectory
from toolgym.trainers.batching import make_micro_batches
from toolgym.trainers.config import TrainerConfig
from toolgym.trainers.trainer import Trainer

POLICIES = {"keep_all": KeepAll(), "notes": Notes(keep_last=1), "window(2)": SlidingWindow(turns=2)}


def re_encoded_tokens(trajectory: Trajectory) -> int:
    """Tokens when every turn is its own sequence: its whole prompt, then its action."""
    total, history = 0, []
    for t in trajectory.transitions:
        history = list(t.observation_tokens) if t.info.get(SEQUENCE_START) else history + t.observation_tokens
        total += len(history) + len(t.action.tokens)
        history += t.action.tokens
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--redirects", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    args = parser.parse_args()
    torch.manual_seed(0)

    renderer = ChatRenderer(load_tokenizer(DEFAULT_TOKENIZER))
    turns = 2 * args.redirects + 2
    env_kwargs = {"tier": "recursive", "redirects": args.redirects, "notes": True, "max_turns": turns,
                  "max_tool_calls": args.redirects + 2}  # fmt: skip
    rows, batches = [], {}
    for name, policy in POLICIES.items():
        config = EnvRolloutConfig(
            env_id="toolgym/Zorplex-v0", env_kwargs=env_kwargs, group_size=args.group_size,
            max_turns=turns, max_tokens_per_episode=4096, context=policy,
        )  # fmt: skip
        trajectories = RolloutRunner(OraclePolicy(renderer), renderer, config).run(list(range(args.tasks)))
        episodes, _ = build_episodes(trajectories, [1.0] * len(trajectories))
        batches[name] = episodes
        n = len(trajectories)
        micro = make_micro_batches(
            episodes, args.micro_batch_tokens, renderer.pad_id, renderer.vocab_size, share_prefix=True
        )
        re_encode = sum(re_encoded_tokens(t) for t in trajectories) / n
        segments = sum(len(e.tokens) - 1 for e in episodes) / n
        shared = sum(mb.num_real_tokens for mb in micro) / n
        longest = max(len(e.tokens) for e in episodes)
        rows.append([name, f"{len(episodes) / n:.1f}", longest, f"{re_encode:.0f}", f"{segments:.0f}",
                     f"{shared:.0f}", f"{segments / shared:.2f}x", f"{re_encode / shared:.2f}x"])  # fmt: skip

    print(f"context_cost: {args.tasks} tasks x G={args.group_size}, Zorplex recursive, {args.redirects} redirects,"
          f" oracle; {machine_summary()}")  # fmt: skip
    print("tokens processed per episode (segments: one training sequence each)")
    headers = ["policy", "segments", "longest", "re-encode", "segments", "shared", "seg/shared", "re-enc/shared"]
    print(format_table(headers, rows))

    episodes = batches["notes"]
    vocab = renderer.vocab_size
    model_config = ModelConfig(**{**NAMED_CONFIGS["bench-3m"], "vocab_size": -(-vocab // 128) * 128})
    times = {}
    for share in (True, False):
        model = Transformer(model_config)
        config = TrainerConfig(micro_batch_tokens=args.micro_batch_tokens, share_prefix=share,
                               pad_token_id=renderer.pad_id, compute_entropy=False)  # fmt: skip
        trainer = Trainer(model, config, device="cpu")
        times[share] = time_repeats(lambda t=trainer: t.train_step(episodes), args.repeats).best
    print(f"\ntrainer time per step on the notes batch ({len(episodes)} segments, bench-3m, fp32):")
    timed = [["shared prefix", f"{times[True]:.3f}"], ["each in full", f"{times[False]:.3f}"]]
    print(format_table(["layout", "seconds"], timed))
    print(f"each in full / shared prefix: {times[False] / times[True]:.2f}x")


if __name__ == "__main__":
    main()
