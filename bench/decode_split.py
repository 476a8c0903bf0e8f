"""Where a decode step's time goes in the torch engine: forward vs sampling vs host bookkeeping.

    python bench/decode_split.py --device cuda --model qwen2.5-0.5b --batch 256 --dtype bfloat16
    python bench/decode_split.py                        # CPU: bench-3m, batch 64, float32
    python bench/decode_split.py --compile              # the decode forward under torch.compile

Same load as bench/generate.py (random prompts of 128 tokens, 64 new tokens, temperature 1).
After a warm-up call, one call runs with synchronised timers around the decode forward (the
CUDA-graph replay on a GPU) and around its sampling (`DecodeGraphs.sample`, also replayed); the rest of `decode_seconds` is the
engine's host work (copies in and out, per-sample bookkeeping). The timers add a sync per step,
so the total is a little above bench/generate.py's decode time.

`--compile` wraps the engine's decode forward (DecodeGraphs._step: the KV-cache writes, the
attention and every layer) in `torch.compile(dynamic=True)` with inductor's `freezing` on (it then
packs the weights itself, so the engine's own oneDNN packing is off), before the warm-up call
(whose time, compilation included, is printed). This is how the issue's "optional torch.compile
of the decode step" was measured; the engine does not offer it because it lost (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch._inductor.config as inductor_config

import toolgym.agents.engine.engine as engine_module
from toolgym.agents.engine.backend import select_backend
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import build_model
from toolgym.agents.types import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="bench-3m")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode forward")
    args = parser.parse_args()
    config = ModelConfig.named(args.model)
    model = build_model(config, seed=0).to(getattr(torch, args.dtype))
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (args.batch, 128), generator=generator).tolist()
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=0)
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    seconds = {"forward": 0.0, "sampling": 0.0}

    def timed(key, fn):
        def wrapper(*a, **k):
            sync()
            start = time.perf_counter()
            result = fn(*a, **k)
            sync()
            seconds[key] += time.perf_counter() - start
            return result

        return wrapper

    if args.compile:
        inductor_config.freezing = True
    with engine_module.TorchEngine(
        model,
        max_batch_size=args.batch,
        max_seq_len=192,
        device=args.device,
        backend=select_backend(
            config, args.device, model.dtype, pack_weights=False if args.compile else None
        ),
    ) as engine:
        if args.compile:
            engine._decoder._step = torch.compile(engine._decoder._step, dynamic=True)
        start = time.perf_counter()
        engine.generate_sync(prompts, params)  # warm-up (and graph capture or compilation)
        warmup = time.perf_counter() - start
        # A decode step's sampling is the decoder's (replayed from a graph on a GPU); a prefill's
        # first-token sampling goes around it and is not counted.
        engine._decoder.forward = timed("forward", engine._decoder.forward)
        engine._decoder.sample = timed("sampling", engine._decoder.sample)
        before_s, before_steps = engine.stats.decode_seconds, engine.stats.decode_steps
        engine.generate_sync(prompts, params)
        steps = engine.stats.decode_steps - before_steps
        decode = engine.stats.decode_seconds - before_s
        forward, sampling = seconds["forward"], seconds["sampling"]
    print(
        f"{args.model}, batch {args.batch}, {args.dtype} on {args.device}, CUDA graphs {engine.cuda_graphs}, "
        f"torch.compile {args.compile}; warm-up call {warmup:.1f} s"
    )
    graphs = " (graph replay)" if engine.cuda_graphs else ""
    print(f"decode: {steps} steps, {decode / steps * 1e3:.2f} ms/step")
    print(f"  forward{graphs}: {forward / steps * 1e3:.2f} ms/step")
    print(f"  sampling{graphs}: {sampling / steps * 1e3:.2f} ms/step")
    print(f"  rest (host bookkeeping, copies): {(decode - forward - sampling) / steps * 1e3:.2f} ms/step")


if __name__ == "__main__":
    main()
