"""Generation throughput: the torch engine vs transformers' `generate` vs vLLM, same checkpoint.

    python bench/generate.py                       # CPU: bench-3m, batch 64, prompt 128, 64 new
    python bench/generate.py --dtypes float32 --backends engine,transformers --repeats 3
    python bench/generate.py --device cuda --model qwen2.5-0.5b --batch 256 --dtypes bfloat16

One random Qwen2-architecture model (`--model`, a ModelConfig name; seed 0) is saved once as a
HF directory; every backend loads that directory in the same dtype. Every request samples at
temperature 1 with no top-k/top-p, and exactly `--new-tokens` tokens (no stop token), from
random prompts of `--prompt-len` tokens, `--batch` at once. The figure is new tokens per second
of one whole batched call (prefill included), best of `--repeats` after a warm-up call. With
`--rounds N` every backend is measured N times in turn (the machine's speed drifts over minutes on
a shared VM) and each one's fastest round counts; the ratios within each round are printed too.

- engine: TorchEngine.generate_sync, one SamplingParams for the batch (seeded), logprobs returned.
  `--replicas N` (CPU): EngineReplicas instead, N engine processes of cores / N threads each,
  the batch dealt evenly between them (each decodes batch / N).
- transformers: model.generate(do_sample=True, top_k=0, min_new_tokens=max_new_tokens).
- vllm: LLM.generate with TokensPrompt, SamplingParams(logprobs=0, ignore_eos=True), in its own
  process per configuration (in-process engine, VLLM_ENABLE_V1_MULTIPROCESSING=0, small
  VLLM_CPU_KVCACHE_SPACE), enforce_eager on and off (off = torch.compile'd); the best is its figure.
  vLLM runs after the in-process backends, so its numbers see the same machine a little later.

`--scenario episodes` instead times a rollout-like load on the engine only: `--batch` episodes run
concurrently (asyncio), each `--turns` turns of one-prompt `generate` calls (own seed; max_tokens
varying 8..`--new-tokens`; the next prompt = the last one + the completion + 16 "observation"
tokens), so requests arrive at different times. Continuous batching (admit between decode
steps) is compared with the same without kept histories (`history_capacity=0`: every turn
prefills its whole conversation) and with static micro-batching (admit only when the running
batch is done). "prompt computed" is the share of prompt tokens the prefills ran.

On CPU every backend runs with the malloc settings the engine makes for its process
(agents/kernels/cpu_allocator.py: freed memory kept for reuse; vLLM's process gets them as environment
variables), so none of them pays page faults for fresh temporaries that the others do not.

Also printed: the matmul peak of this machine per dtype (bench/_common.py) and the share of it
that the engine's decode steps reach (model FLOPs of decode / engine decode time).
Target (issue 6, CPU): engine >= 4x transformers and >= 1.5x vLLM, same dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, machine_summary, matmul_peak_flops, time_repeats

from toolgym.agents.engine.backend import select_backend
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.engine.replicas import EngineReplicas
from toolgym.agents.kernels.cpu_allocator import ENVIRONMENT as ALLOCATOR_ENVIRONMENT
from toolgym.agents.kernels.cpu_allocator import keep_freed_memory
from toolgym.agents.model.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import build_model
from toolgym.agents.types import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decode_flops(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Model FLOPs of the decode steps (tokens 2..new_tokens; the first comes from the prefill)."""
    matmul_params = cfg.num_params(include_embedding=False) + cfg.vocab_size * cfg.hidden_size
    attention_per_position = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    total = 0.0
    for step in range(1, new_tokens):
        context = prompt_len + step + 1
        total += batch * (2 * matmul_params + attention_per_position * context)
    return total


def bench_engine(directory, prompts, args, dtype) -> dict:
    model = load_hf_checkpoint(directory, dtype=dtype, device=args.device)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=0)
    requests = dict(key_layout=args.key_layout, kernels=args.kernels)
    if args.replicas > 1:  # the prompts are dealt evenly: each replica decodes batch / replicas
        backend = select_backend(model.config, args.device, dtype, **requests)
        engine = EngineReplicas(
            model,
            replicas=args.replicas,
            max_batch_size=-(-len(prompts) // args.replicas),
            max_seq_len=args.prompt_len + args.new_tokens,
            backend=backend,
        )
    else:
        cuda_graphs = {"auto": None, "on": True, "off": False}[args.cuda_graphs]
        backend = select_backend(model.config, args.device, dtype, cuda_graphs=cuda_graphs, **requests)
        engine = TorchEngine(
            model, max_batch_size=len(prompts), max_seq_len=args.prompt_len + args.new_tokens, backend=backend
        )
    with engine:
        run = lambda: engine.generate_sync(prompts, params)  # noqa: E731
        run()  # warm-up
        before = (engine.stats.decode_seconds, engine.stats.prefill_seconds)
        timings = time_repeats(run, args.repeats, warmup=0, device=args.device)
        # Replicas work side by side: their summed seconds / replicas is the wall time.
        decode_s = (engine.stats.decode_seconds - before[0]) / args.repeats / args.replicas
        prefill_s = (engine.stats.prefill_seconds - before[1]) / args.repeats / args.replicas
        outputs = run()
    assert all(len(c.tokens) == args.new_tokens for c in outputs)
    return {
        "best": timings.best, "median": timings.median, "decode_s": decode_s, "prefill_s": prefill_s,
        "kernels": backend.kernels, "decode_kernel": backend.attention,
    }  # fmt: skip


def bench_transformers(directory, prompts, args, dtype) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(args.device).eval()
    input_ids = torch.tensor(prompts, device=args.device)
    kwargs = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens, pad_token_id=0, attention_mask=torch.ones_like(input_ids),
    )  # fmt: skip

    def run():
        with torch.inference_mode():
            out = model.generate(input_ids, **kwargs)
        assert out.shape[1] == args.prompt_len + args.new_tokens

    timings = time_repeats(run, args.repeats, device=args.device)
    return {"best": timings.best, "median": timings.median}


VLLM_CHILD = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def main():
    spec = json.loads(sys.argv[1])
    prompts = json.load(open(spec["prompts"]))
    llm = LLM(spec["dir"], skip_tokenizer_init=True, dtype=spec["dtype"], enforce_eager=spec["eager"], seed=0,
              max_model_len=spec["max_len"], max_num_seqs=len(prompts), max_num_batched_tokens=max(8192, len(prompts) * len(prompts[0])))
    params = SamplingParams(max_tokens=spec["new"], temperature=1.0, top_p=1.0, top_k=0, ignore_eos=True,
                            logprobs=0, detokenize=False, seed=0)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    seconds = []
    for i in range(spec["repeats"] + 2):  # two warm-ups: the first calls compile/capture shapes
        start = time.perf_counter()
        out = llm.generate(inputs, params, use_tqdm=False)
        if i >= 2:
            seconds.append(time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == spec["new"] for o in out)
    print("RESULT " + json.dumps({"seconds": seconds}), flush=True)
if __name__ == "__main__":
    main()
"""


def bench_vllm(directory, prompts_file, args, dtype_name: str, eager: bool) -> dict:
    spec = dict(dir=str(directory), prompts=str(prompts_file), dtype=dtype_name, eager=eager, repeats=args.repeats,
                new=args.new_tokens, max_len=args.prompt_len + args.new_tokens)  # fmt: skip
    # The malloc settings the engine and transformers run with here (agents/kernels/cpu_allocator.py).
    tuned = args.device == "cpu" and keep_freed_memory()
    env = {**os.environ, **(ALLOCATOR_ENVIRONMENT if tuned else {})}
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            seconds = json.loads(line[len("RESULT ") :])["seconds"]
            return {"best": min(seconds), "median": sorted(seconds)[len(seconds) // 2]}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError("vLLM run failed: " + " | ".join(tail))


def bench_episodes(directory, args, dtype) -> None:
    """Rollout-like arrivals: continuous batching vs static micro-batching, same requests."""
    import asyncio
    import random
    import time

    config = ModelConfig.named(args.model)
    rng = random.Random(0)
    starts = [
        [rng.randrange(config.vocab_size) for _ in range(rng.randint(32, args.prompt_len))]
        for _ in range(args.batch)
    ]
    plans = [[(rng.randint(8, args.new_tokens), [rng.randrange(config.vocab_size) for _ in range(16)])
              for _ in range(args.turns)] for _ in range(args.batch)]  # fmt: skip
    max_len = args.prompt_len + args.turns * (args.new_tokens + 16) + 1

    async def episode(engine, index):
        prompt, tokens = list(starts[index]), 0
        for turn, (max_tokens, observation) in enumerate(plans[index]):
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=index * 1000 + turn)
            (completion,) = await engine.generate([prompt], params)
            tokens += len(completion.tokens)
            prompt = prompt + completion.tokens + observation
        return tokens

    rows = []
    engines = {  # row name -> TorchEngine options
        "continuous batching": {},
        "continuous, no kept histories": {"history_capacity": 0},
        "static batching": {"continuous_batching": False},
    }
    for name, options in engines.items():
        model = load_hf_checkpoint(directory, dtype=dtype, device=args.device)
        backend = select_backend(
            model.config, args.device, dtype, key_layout=args.key_layout, kernels=args.kernels
        )
        with TorchEngine(
            model, max_batch_size=args.batch, max_seq_len=max_len, backend=backend, **options
        ) as engine:
            asyncio.run(episode(engine, 0))  # warm-up
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                total = sum(asyncio.run(_gather(engine, episode, args.batch)))
                best = min(best, time.perf_counter() - start)
            stats = engine.stats
            computed = (
                stats.prompt_tokens - stats.shared_prefix_tokens - stats.history_tokens
            ) / stats.prompt_tokens
            rows.append([name, f"{total / best:,.0f}", f"{best:.2f}", f"{stats.prefill_seconds / (args.repeats + 1):.2f}",
                         f"{computed:.0%}", stats.prefill_forwards, stats.decode_steps])  # fmt: skip
    print(f"episodes: {args.batch} concurrent x {args.turns} turns, {str(dtype).removeprefix('torch.')}")
    print(format_table(
        ["engine", "new tok/s", "best s", "prefill s/run", "prompt computed", "prefills", "decode steps"], rows
    ))  # fmt: skip


async def _gather(engine, episode, n):
    import asyncio

    return await asyncio.gather(*(episode(engine, i) for i in range(n)))


def run_round(directory, prompts, prompts_file, args, dtypes, backends) -> dict[tuple[str, str], dict]:
    """One measurement of every backend and dtype: {(backend, dtype): timings}."""
    results = {}
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        if "engine" in backends:
            results[("engine", dtype_name)] = bench_engine(directory, prompts, args, dtype)
        if "transformers" in backends:
            results[("transformers", dtype_name)] = bench_transformers(directory, prompts, args, dtype)
    if "vllm" in backends:
        for dtype_name in dtypes:
            for mode in args.vllm_modes.split(","):
                try:
                    results[(f"vllm {mode}", dtype_name)] = bench_vllm(
                        directory, prompts_file, args, dtype_name, mode == "eager"
                    )
                except Exception as error:  # vLLM missing or failing: say so, keep the rest
                    print(f"vllm {mode} {dtype_name}: {error}")
    return results


def round_ratios(results: dict, dtype_name: str) -> str:
    """'a.aax / b.bbx': one round's engine / fastest vLLM and engine / transformers ('-' if absent)."""
    engine = results[("engine", dtype_name)]["tok_s"]
    vllm = max(
        (r["tok_s"] for (b, d), r in results.items() if b.startswith("vllm") and d == dtype_name), default=0
    )
    hf = results.get(("transformers", dtype_name), {}).get("tok_s")
    versus_vllm = f"{engine / vllm:.2f}x" if vllm else "-"
    return f"{versus_vllm} / " + (f"{engine / hf:.2f}x" if hf else "-")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="bench-3m", help="a ModelConfig name (random weights, seed 0)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--backends", default="engine,transformers,vllm")
    parser.add_argument("--vllm-modes", default="eager,compiled", help="vLLM enforce_eager on/off")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every backend this many times in turn; each one's best counts",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--scenario", choices=["batch", "episodes"], default="batch")
    parser.add_argument("--turns", type=int, default=4, help="turns per episode (--scenario episodes)")
    parser.add_argument(
        "--key-layout", choices=["sd", "ds"], default=None, help="engine KV layout (default: its own)"
    )
    parser.add_argument(
        "--kernels", choices=["torch", "vllm"], default=None,
        help="engine's compiled CPU kernels (agents/engine/backend.py; default: its own)",
    )  # fmt: skip
    parser.add_argument(
        "--cuda-graphs", choices=["auto", "on", "off"], default="auto", help="engine decode graphs"
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="the engine as N processes (agents/engine/replicas.py; CPU)"
    )
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    backends = args.backends.split(",")

    # Every backend runs with the malloc settings the CPU engine makes (vLLM's process too).
    allocator = (
        "malloc keeps freed memory" if args.device == "cpu" and keep_freed_memory() else "malloc as is"
    )
    config = ModelConfig.named(args.model)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len), generator=generator).tolist()
    print(f"{machine_summary()}; model {args.model} ({config.num_params() / 1e6:.1f}M params), batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, temperature 1, best of {args.repeats}"
          + (f" x {args.rounds} rounds" if args.scenario == "batch" else "")
          + (f"; engine: {args.replicas} replica processes" if args.replicas > 1 else "") + f"; {allocator}")  # fmt: skip
    if args.scenario == "episodes":
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_checkpoint(build_model(config, seed=0), config, Path(tmp))
            for dtype_name in dtypes:
                bench_episodes(Path(tmp), args, DTYPES[dtype_name])
        return
    peaks = {d: matmul_peak_flops(DTYPES[d], args.device) for d in dtypes}
    print("matmul peak: " + ", ".join(f"{d} {p / 1e9:.0f} GFLOP/s" for d, p in peaks.items()))

    new_tokens = args.batch * args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "model"
        save_hf_checkpoint(build_model(config, seed=0), config, directory)
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        rounds = [
            run_round(directory, prompts, prompts_file, args, dtypes, backends) for _ in range(args.rounds)
        ]
    # Each backend's fastest round (the machine's speed drifts between rounds; each gets its turns).
    results = {key: min((r[key] for r in rounds if key in r), key=lambda r: r["best"]) for key in rounds[0]}
    for r in [r for one in rounds for r in one.values()]:
        r["tok_s"] = new_tokens / r["best"]

    rows = []
    flops = decode_flops(config, args.batch, args.prompt_len, args.new_tokens)
    for (backend, dtype_name), r in results.items():
        extra = ""
        if backend == "engine":
            r["decode_share_of_peak"] = flops / r["decode_s"] / peaks[dtype_name]
            extra = (
                f"prefill {r['prefill_s'] * 1e3:.0f} ms, decode {r['decode_s'] * 1e3:.0f} ms "
                f"({r['decode_share_of_peak']:.0%} of peak; {r['kernels']} kernels, {r['decode_kernel']} attention)"
            )
        rows.append([backend, dtype_name, f"{r['tok_s']:,.0f}", f"{new_tokens / r['median']:,.0f}", extra])
    print(format_table(["backend", "dtype", "new tok/s (best)", "(median)", "engine split"], rows))
    for dtype_name in dtypes:
        engine = results.get(("engine", dtype_name))
        if engine is None:
            continue
        for (backend, d), r in results.items():
            if d == dtype_name and backend != "engine":
                print(f"{dtype_name}: engine / {backend} = {engine['tok_s'] / r['tok_s']:.2f}x")
    vllm_best = {
        d: max(
            (r["tok_s"] for (b, dd), r in results.items() if b.startswith("vllm") and dd == d), default=None
        )
        for d in dtypes
    }
    for d, best in vllm_best.items():
        if best and ("engine", d) in results:
            print(
                f"{d}: engine / vLLM (fastest mode) = {results[('engine', d)]['tok_s'] / best:.2f}x  (target >= 1.5x)"
            )
        if ("transformers", d) in results and ("engine", d) in results:
            print(
                f"{d}: engine / transformers = {results[('engine', d)]['tok_s'] / results[('transformers', d)]['tok_s']:.2f}x  (target >= 4x)"
            )
        if len(rounds) > 1 and ("engine", d) in results:
            print(f"{d}: within each round, engine / vLLM (fastest mode), engine / transformers: " + ", ".join(
                f"{round_ratios(one, d)}" for one in rounds
            ))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({f"{b} {d}": r for (b, d), r in results.items()}, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
