"""Peak RSS of `toolgym eval` for a short and a long eval with the same policy: the summary is
computed as the episodes stream by (rollouts/evaluation.py), so the peak should not grow with the
number of episodes (target: the long run's peak within 10% of the short one's).

Each size runs `toolgym eval` in its own subprocess (this script with --child), which reports
its own peak resident set size (`ru_maxrss` of RUSAGE_SELF, after the eval). The policy is the
'test' model shape (random weights, written once as a Hugging Face directory with the shipped
tokenizer) served by the torch engine, or `--policy oracle` (the env's scripted oracle, no model).
`--keep` also runs the in-process evaluation that keeps every trajectory (the behaviour before
streaming) for contrast.

    python bench/eval_memory.py                     # 2,000 and 10,000 episodes, the 'test' model
    python bench/eval_memory.py --policy oracle --sizes 2000,10000,50000
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = ["--env", "toolgym/Zorplex-v0", "--env-kwargs", '{"tier": "simple"}']
LIMITS = ["--max-turns", "3", "--max-tokens-per-turn", "8", "--max-tokens-per-episode", "24"]


def write_test_model(directory: Path) -> Path:
    """The 'test' shape (vocab widened to the shipped tokenizer's), random weights, as a HF dir."""
    import msgspec

    from toolgym.agents.model.checkpoint import save_hf_checkpoint
    from toolgym.agents.model.config import ModelConfig
    from toolgym.agents.model.transformer import build_model
    from toolgym.agents.tokenizer import load_tokenizer
    from toolgym.configs.cli.main import DEFAULT_TOKENIZER

    vocab = load_tokenizer(DEFAULT_TOKENIZER).get_vocab_size()
    config = ModelConfig.named("test")
    config = msgspec.structs.replace(config, vocab_size=max(config.vocab_size, vocab))
    model = build_model(config, seed=0)
    save_hf_checkpoint(model, model.config, directory, tokenizer_path=DEFAULT_TOKENIZER)
    return directory


def child(episodes: int, policy: str, keep: bool) -> None:
    """Run one eval in this process; print its peak RSS (KiB) and wall time on the last line."""
    started = time.perf_counter()
    if keep:  # every trajectory kept until the summary: how eval behaved before streaming
        from toolgym.configs.assembly.parts import load_policy, policy_renderer
        from toolgym.configs.cli.main import DEFAULT_TOKENIZER
        from toolgym.rollouts.episode.config import EnvRolloutConfig
        from toolgym.rollouts.evaluation import EvalConfig, evaluate_sync
        from toolgym.rollouts.scripted import OracleConfig

        renderer = policy_renderer(policy, DEFAULT_TOKENIZER)
        engine, _ = load_policy(policy, renderer, OracleConfig())
        rollout = EnvRolloutConfig(
            env_id="toolgym/Zorplex-v0", env_kwargs={"tier": "simple"}, max_turns=3,
            max_tokens_per_turn=8, max_tokens_per_episode=24,
        )  # fmt: skip
        report = evaluate_sync(engine, renderer, rollout, EvalConfig(num_tasks=episodes, num_examples=0))
        assert len(report.trajectories) == episodes
        rc = 0
    else:
        from toolgym.configs.cli.main import main

        rc = main(["eval", *ENV, "--policy", policy, "--tasks", str(episodes), "--examples", "0", *LIMITS])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(f"RESULT rc={rc} peak_kib={peak} wall_s={time.perf_counter() - started:.1f}")


def measure(episodes: int, policy: str, keep: bool = False) -> tuple[int, float]:
    cmd = [sys.executable, __file__, "--child", str(episodes), "--policy", policy] + (
        ["--keep"] if keep else []
    )
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        sys.exit(f"eval of {episodes} episodes failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    fields = dict(kv.split("=") for kv in lines[-1].split()[1:])
    if fields["rc"] != "0":
        sys.exit(f"toolgym eval exited {fields['rc']}:\n{out.stderr[-3000:]}")
    return int(fields["peak_kib"]), float(fields["wall_s"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="2000,10000", help="episode counts, comma-separated")
    parser.add_argument("--policy", default="test", help="'test' (the 'test' model shape) or 'oracle'")
    parser.add_argument(
        "--keep", action="store_true", help="also measure an eval that keeps every trajectory"
    )
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.policy, args.keep)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        policy = str(write_test_model(Path(tmp) / "test_model")) if args.policy == "test" else args.policy
        print(f"toolgym eval on toolgym/Zorplex-v0 (simple), policy {args.policy}, {' '.join(LIMITS)}")
        print(f"{'episodes':>9} {'peak RSS MiB':>13} {'wall s':>8}  mode")
        rows = {}
        for keep in [False, True] if args.keep else [False]:
            for n in sizes:
                peak, wall = measure(n, policy, keep)
                rows[(keep, n)] = peak
                print(
                    f"{n:>9,} {peak / 1024:>13.1f} {wall:>8.1f}  {'keeps every trajectory' if keep else 'toolgym eval'}"
                )
        for keep in [False, True] if args.keep else [False]:
            lo, hi = rows[(keep, sizes[0])], rows[(keep, sizes[-1])]
            label, target = ("kept", "") if keep else ("streamed", " (target <= 1.10x)")
            print(f"{label}: peak at {sizes[-1]:,} / peak at {sizes[0]:,} = {hi / lo:.3f}x{target}")


if __name__ == "__main__":
    main()
