"""What the torch engine's shared-prefix prefill and kept histories save in the CPU demo's rollouts.

    python bench/prefix_sharing.py --model-dir runs/<a zorplex_tiny run>/sft_model
    python bench/prefix_sharing.py            # the preset's initial random model (mostly 1 turn)

The same rollouts as one RL step of `configs/zorplex_tiny.toml` (32 tasks x G=8 episodes of
Zorplex simple, the preset's rollout limits and temperature, seeded), run through the rollout
runner on three TorchEngines over the same weights: the default (a prefill's common prompt prefix
is computed once and kept for later prefills, and a finished turn's k/v are kept for its
episode's next turn: agents/engine/history.py), `history_capacity=0` (the shared prefix only), and
`share_prefixes=False, history_capacity=0` (every prompt prefilled in full). Reported per engine,
the mean over `--repeats` batches (after a warm-up batch): rollout seconds, the engine's prefill
and decode seconds, the prompt tokens its prefills computed, and how many prefill forwards and
decode steps it ran. All engines sample from the same seeds, so their episodes should match
token for token (rounding can differ in the last bits; the mismatch count is printed).

`--model-dir` takes a model the demo trained (`toolgym train` writes `sft_model/` into its run
directory): its episodes have the demo's shape (a LOOKUP turn, then the answer). Without it the
preset's random initial model mostly ends its episodes after one turn.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, machine_summary

from toolgym.agents.engine.engine import TorchEngine
from toolgym.configs.assembly.parts import build_renderer, initial_model, load_model
from toolgym.configs.load import load_config
from toolgym.rollouts.batches import TaskSeedStream
from toolgym.rollouts.episode.runner import RolloutRunner

ENGINES = {  # row name -> TorchEngine options
    "prefix + history": {},
    "prefix only": {"history_capacity": 0},
    "off": {"share_prefixes": False, "history_capacity": 0},
}


def measure(model, renderer, config, options: dict, batches: list[list[int]]) -> dict:
    engine = TorchEngine(
        model,
        max_batch_size=config.policy.max_batch_size,
        max_seq_len=config.policy.max_seq_len,
        tokenizer=renderer.tokenizer,
        **options,
    )
    with engine:
        runner = RolloutRunner(engine, renderer, config.rollout_config())
        runner.run(batches[0])  # warm-up
        before = msgspec.structs.asdict(engine.stats)
        start = time.perf_counter()
        trajectories = [t for seeds in batches[1:] for t in runner.run(seeds)]
        seconds = time.perf_counter() - start
        after = msgspec.structs.asdict(engine.stats)
    n = len(batches) - 1
    mean = {k: (after[k] - before[k]) / n for k in after}
    return {"rollout_s": seconds / n, **mean, "trajectories": trajectories}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=None, help="a Hugging Face directory (default: random)")
    ap.add_argument("--config", default="zorplex_tiny", help="a preset name or TOML path")
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    config, _ = load_config(args.config)
    renderer, _ = build_renderer(config)
    model = load_model(args.model_dir) if args.model_dir else initial_model(config)
    stream = TaskSeedStream(stream=0)
    # The same task seeds for both engines: each batch is taken once, then replayed.
    batches = [stream.take(args.tasks)[0] for _ in range(args.repeats + 1)]
    results = {name: measure(model, renderer, config, options, batches) for name, options in ENGINES.items()}

    trajectories = results["prefix + history"]["trajectories"]
    episodes = len(trajectories) // args.repeats
    turns = sum(len(t.transitions) for t in trajectories) / max(len(trajectories), 1)
    print(f"{machine_summary()}; {args.config} rollouts, model {args.model_dir or 'random (initial)'}, "
          f"{args.tasks} tasks x G={config.rollout.group_size} = {episodes} episodes, "
          f"{turns:.2f} turns/episode, mean of {args.repeats} batches")  # fmt: skip
    rows = []
    for name, r in results.items():
        computed = r["prompt_tokens"] - r["shared_prefix_tokens"] - r["history_tokens"]
        rows.append([
            name, f"{r['rollout_s']:.2f}", f"{r['prefill_seconds']:.2f}",
            f"{r['decode_seconds']:.2f}", f"{r['prompt_tokens']:,.0f}", f"{computed:,.0f}",
            f"{r['prefill_forwards']:,.0f}", f"{r['decode_steps']:,.0f}",
        ])  # fmt: skip
    print(format_table(
        ["engine", "rollout s", "prefill s", "decode s", "prompt tokens", "computed", "prefills", "decode steps"],
        rows,
    ))  # fmt: skip

    def sampled(t):
        return [transition.action.tokens for transition in t.transitions]

    for name in ("prefix only", "off"):
        differing = sum(
            sampled(a) != sampled(b) for a, b in zip(trajectories, results[name]["trajectories"], strict=True)
        )
        print(f"episodes whose tokens differ from {name!r}: {differing} of {len(trajectories)}")
    full = results["off"]["rollout_s"]
    print(f"rollout speed-up over 'off': prefix only {full / results['prefix only']['rollout_s']:.2f}x, "
          f"prefix + history {full / results['prefix + history']['rollout_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
