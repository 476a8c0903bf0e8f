"""Decode cost per token against context length: Qwen3.5's hybrid (three Gated DeltaNet layers in
four) against Qwen3 (full attention in every layer) at the same shape, in the torch engine.

    python bench/hybrid_decode.py                    # contexts 1k, 4k, 16k; 4 sequences; fp32
    python bench/hybrid_decode.py --contexts 256 1024 --new-tokens 16    # a smoke run

Per model and context length C: `--batch` prompts of C random tokens are prefilled (not timed),
then `--new-tokens` greedy tokens are decoded; the figure is the mean seconds per decode step (one
token for every sequence). A Gated DeltaNet layer reads a state of fixed size whatever the
context; a full-attention layer reads every earlier position's k/v, so its step grows with C. A
third arm has linear layers only (the hybrid's shape, every layer linear): its step is the linear
layers' cost alone. The
shapes: tiny's width (256, 4 layers, 8 heads of 32, 4 KV heads) with a vocabulary of 1,024, the
hybrid with linear layers of 4 key heads serving 8 value heads of 32 (`tiny-qwen3.5`'s, in
Qwen3.5's pattern: three linear layers, then one full-attention layer).
"""

from __future__ import annotations

import argparse

import torch
from _common import commit, format_table, machine_summary

from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import build_model
from toolgym.agents.types import SamplingParams

# (arm, named shape, its layer types): Qwen3.5's pattern, every layer linear, every layer full.
ARMS = (
    ("hybrid", "tiny-qwen3.5", ("linear_attention",) * 3 + ("full_attention",)),
    ("linear only", "tiny-qwen3.5", ("linear_attention",) * 4),
    ("dense", "tiny", None),
)


def shape(name: str, layer_types: tuple[str, ...] | None, context: int) -> ModelConfig:
    """The named shape with `layer_types` (None: its own), its positions enough for `context`
    (RoPE tables only: no weight depends on it)."""
    import msgspec

    base = ModelConfig.named(name)
    changes: dict = {"max_position_embeddings": max(base.max_position_embeddings, context)}
    if layer_types is not None:
        changes["layer_types"] = layer_types
    return msgspec.structs.replace(base, **changes)


def step_seconds(config: ModelConfig, context: int, batch: int, new_tokens: int, dtype: torch.dtype) -> float:
    """Mean seconds per decode step after prefilling `batch` prompts of `context` tokens."""
    model = build_model(config, seed=0)
    engine = TorchEngine(
        model, max_batch_size=batch, max_seq_len=context + new_tokens + 1, dtype=dtype, history_capacity=0
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (context,), generator=g).tolist() for _ in range(batch)]
    # Every step decodes every sequence: no stop token, all the same length.
    params = SamplingParams(max_tokens=new_tokens, temperature=0)
    engine.generate_sync(prompts, SamplingParams(max_tokens=2, temperature=0))  # warm-up
    seconds, steps = engine.stats.decode_seconds, engine.stats.decode_steps
    engine.generate_sync(prompts, params)
    return (engine.stats.decode_seconds - seconds) / (engine.stats.decode_steps - steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(
        f"{machine_summary()}; commit {commit()}; batch {args.batch}, {args.new_tokens} tokens, {args.dtype}"
    )
    rows, first = [], {}
    for context in args.contexts:
        cells = [context]
        for arm, name, layer_types in ARMS:
            config = shape(name, layer_types, context + args.new_tokens + 1)
            seconds = step_seconds(config, context, args.batch, args.new_tokens, dtype)
            first.setdefault(arm, seconds)
            cells += [f"{seconds * 1e3:.2f}", f"{seconds / first[arm]:.2f}x"]
            print(f"{arm} at {context}: {seconds * 1e3:.2f} ms a step", flush=True)
        rows.append(cells)
    headers = ["context"] + [f"{arm} {what}" for arm, _, _ in ARMS for what in ("ms/step", "vs first")]
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
