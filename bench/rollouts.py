"""Rollout overhead: the runner (envs + asyncio + chat rendering) versus the bare engine doing the
same generation work.

    python bench/rollouts.py [--tasks 16] [--group-size 4] [--stop-rate 0.05] [--repeats 3]

Model: `ModelConfig.named("tiny")` with random weights, on Zorplex compositional, with the
shipped tokenizer. A random model almost never samples `<|im_end|>`, so every turn would be cut
by max_tokens and every episode would end after one turn; `--stop-rate p` plants a stop
probability instead (the lm_head is untied and zeroed, except that `<|im_end|>` gets a logit
that makes it about p likely per token; shapes and per-token cost are the tiny model's), so the
episodes are multi-turn: random text, env error observations, a few turns each. 0 turns it off.

Measured (best of `repeats`, same engine, warm):
1. runner: `RolloutRunner.run_groups` on tasks x group_size episodes: episodes/s and generated
   tokens/s, and the runner's own time (env reset/step + rendering, summed over episodes).
2. engine by turn: the same requests (prompt = the episode's tokens so far, max_tokens = what was
   sampled, the same seed, so the engine samples the same tokens: checked) replayed straight
   into `TorchEngine.generate`, turn 0 of every episode together, then turn 1, ...: the same
   work with zero env/runner cost and lock-step turns.
3. engine all at once: every request at once (ignores that turn k+1 needs turn k's answer): an
   upper bound on the engine's throughput for this work.
overhead = 1 - t(engine by turn) / t(runner): the share of rollout time that is not generation.
granularity = 1 - t(all at once) / t(engine by turn): what waiting at turn boundaries costs the
engine itself (smaller batches, more steps), independent of the runner. Target: overhead <= 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections import defaultdict

import torch

from toolgym.agents.chat import ChatRenderer
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import Transformer
from toolgym.agents.tokenizer import load_tokenizer
from toolgym.agents.types import SamplingParams
from toolgym.configs.cli.main import DEFAULT_TOKENIZER
from toolgym.rollouts.episode.config import EnvRolloutConfig, sampling_seed
from toolgym.rollouts.episode.runner import RolloutRunner

TARGET_OVERHEAD = 0.10


def build_model(vocab: int, stop_id: int, stop_rate: float) -> Transformer:
    torch.manual_seed(0)
    base = ModelConfig.named("tiny")
    if stop_rate <= 0:
        return Transformer(base).eval()
    config = ModelConfig(**{**_fields(base), "tie_word_embeddings": False})
    model = Transformer(config).eval()
    with torch.no_grad():
        # A constant residual direction (dim 0 of every input embedding), read out by the stop row
        # only: the stop logit is about the same at every position, every other logit is ~0.
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight.zero_()
        h0 = math.sqrt(config.hidden_size)  # dim 0 after RMSNorm when it dominates the residual
        model.lm_head.weight[stop_id, 0] = math.log(stop_rate * (vocab - 1) / (1 - stop_rate)) / h0
    return model


def _fields(config: ModelConfig) -> dict:
    return {f: getattr(config, f) for f in config.__struct_fields__}


def requests_of(
    trajectories, config: EnvRolloutConfig, stop_ids
) -> list[list[tuple[list[int], SamplingParams, list[int]]]]:
    """Per turn index: (prompt, params, recorded tokens) of every episode's turn."""
    by_turn: dict[int, list] = defaultdict(list)
    for t in trajectories:
        history: list[int] = []
        episode_seed = sampling_seed(config.seed, t.task_seed, t.sample_index)
        for k, transition in enumerate(t.transitions):
            history = history + transition.observation_tokens
            params = SamplingParams(
                max_tokens=len(transition.action.tokens),
                temperature=config.sampling.temperature,
                stop_token_ids=stop_ids,
                seed=sampling_seed(episode_seed, k),
            )
            by_turn[k].append((history, params, transition.action.tokens))
            history = history + transition.action.tokens
    return [by_turn[k] for k in sorted(by_turn)]


async def replay(engine: TorchEngine, waves) -> tuple[float, int]:
    """Submit each wave's requests concurrently, one wave after another. (seconds, mismatches)"""
    mismatches = 0
    start = time.perf_counter()
    for wave in waves:
        results = await asyncio.gather(*(engine.generate([p], params) for p, params, _ in wave))
        mismatches += sum(r[0].tokens != tokens for r, (_, _, tokens) in zip(results, wave, strict=True))
    return time.perf_counter() - start, mismatches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--stop-rate", type=float, default=0.05)
    ap.add_argument("--max-tokens-per-turn", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    renderer = ChatRenderer(load_tokenizer(DEFAULT_TOKENIZER))
    model = build_model(ModelConfig.named("tiny").vocab_size, renderer.im_end_id, args.stop_rate)
    config = EnvRolloutConfig(
        env_id="toolgym/Zorplex-v0",
        env_kwargs={"tier": "compositional"},
        group_size=args.group_size,
        max_turns=8,
        max_tokens_per_turn=args.max_tokens_per_turn,
        max_tokens_per_episode=1024,
    )
    n_episodes = args.tasks * args.group_size
    seeds = list(range(1000, 1000 + args.tasks))
    with TorchEngine(model, tokenizer=renderer.tokenizer, max_batch_size=max(64, n_episodes)) as engine:
        runner = RolloutRunner(engine, renderer, config)
        runner.run(seeds[:2])  # warm up
        best_runner, trajectories = math.inf, []
        for _ in range(args.repeats):
            start = time.perf_counter()
            trajectories = asyncio.run(runner.run_groups(seeds))
            best_runner = min(best_runner, time.perf_counter() - start)
        runner_own = sum(t.metrics["env_s"] for t in trajectories)
        waves = requests_of(trajectories, config, renderer.stop_token_ids)
        tokens = sum(len(tokens) for wave in waves for _, _, tokens in wave)
        requests = sum(len(w) for w in waves)
        by_turn = min(asyncio.run(replay(engine, waves)) for _ in range(args.repeats))
        flat = [[r for wave in waves for r in wave]]
        all_at_once = min(asyncio.run(replay(engine, flat)) for _ in range(args.repeats))

    turns = [len(t.transitions) for t in trajectories]
    reasons = defaultdict(int)
    for t in trajectories:
        reasons[t.stop_reason.value] += 1
    overhead = 1 - by_turn[0] / best_runner
    granularity = 1 - all_at_once[0] / by_turn[0]
    print(f"tiny random model (stop rate {args.stop_rate}), Zorplex compositional, {n_episodes} episodes "
          f"({args.tasks} tasks x G={args.group_size}), {requests} turns, {tokens} generated tokens, "
          f"turns/episode {sum(turns) / len(turns):.2f} (max {max(turns)}), stop reasons {dict(reasons)}")  # fmt: skip
    print(f"{'':28}{'seconds':>9}{'episodes/s':>12}{'tokens/s':>11}")
    for name, seconds in (
        ("runner", best_runner),
        ("engine by turn", by_turn[0]),
        ("engine all at once", all_at_once[0]),
    ):
        print(f"{name:28}{seconds:9.3f}{n_episodes / seconds:12.1f}{tokens / seconds:11.0f}")
    print(f"replayed tokens differing from the runner's: {by_turn[1]} by turn, {all_at_once[1]} all at once "
          f"(of {requests} requests)")  # fmt: skip
    print(f"runner's own work (env reset/step + rendering, summed over episodes): {runner_own:.3f} s "
          f"= {runner_own / best_runner:.1%} of runner wall time")  # fmt: skip
    print(f"overhead (1 - engine by turn / runner): {overhead:.1%}  (target <= {TARGET_OVERHEAD:.0%}: "
          f"{'met' if overhead <= TARGET_OVERHEAD else 'NOT met'})")  # fmt: skip
    print(
        f"turn-boundary granularity (1 - all at once / by turn): {granularity:.1%}  (engine-side, not runner)"
    )


if __name__ == "__main__":
    main()
