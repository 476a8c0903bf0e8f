"""Every native model family against transformers, same weights, same run: decode and a train step.

    python bench/families.py                                  # every family, 1 layer, both dtypes
    python bench/families.py --families llama,qwen3 --layers 2 --reps 5
    python bench/families.py --layers 1 --hidden-cap 256 --reps 1   # the smoke size (seconds)

Families: every model_type in agents/model/families (FAMILIES), each measured at the smallest of its published shapes that `ModelConfig.named` knows
(qwen2.5-0.5b, qwen3-0.6b, llama-3.2-1b, mistral-7b-v0.3, smollm3-3b, gemma-3-1b, ...). A family
with no named shape, or whose model_type this transformers does not know, is skipped with a line.

Scaling rule (the full shapes do not fit 2 CPU cores in minutes): keep the published width and
every family feature -- vocabulary, hidden and MLP size, heads, KV heads (so the GQA ratio),
head_dim, RoPE (theta, llama3 scaling), norms, biases, tied embeddings, sliding window -- and cut
depth to `--layers` N (default 1, for the 10-minute budget). Where the published stack mixes layer kinds (SmolLM3's NoPE
layers, Gemma 3's sliding/global layers) the scaled stack keeps the first N-1 layers' kinds and
ends with the rarer kind, so every kind runs (with N = 1: the first layer's kind only). One layer
gives ~0.15B (qwen2.5) to ~0.49B (mistral) parameters, two ~0.17B to ~0.7B; most of it is the
vocabulary (embedding and output layer), which both sides run alike. `--hidden-cap W` also caps hidden and MLP width at W and
4W (heads = W / head_dim, the GQA ratio kept where it divides): only for smoke runs.

(a) decode: toolgym's TorchEngine (agents/engine, `generate_sync`, the API bench/generate.py
times) vs transformers' `generate`, both loading one HF directory written by `save_hf_checkpoint`
(random weights, seed 0) in the same dtype: `--batch` random prompts of `--prompt-len` tokens,
greedy, exactly `--new-tokens` new tokens (bf16: `--bf16-batch` prompts, `--bf16-new-tokens`;
this AVX2 CPU computes bf16 matmuls ~10x slower than fp32) (HF: min_new_tokens; the engine: no stop ids), KV cache
on. Figure: new tokens / s of one whole batched call (prefill included), after a warm-up call.
(bench/generate.py's runners sample at temperature 1 and reload per call, so the runners here are
greedy and keep their model across repetitions; its dtype table is reused.)
Also shown: the share of greedy tokens on which the two agree (fp32 should be ~100%).

(b) train: toolgym's Trainer forward+backward (`Trainer._forward_backward` with its SFT loss, the
part of `sft_step` before clipping and the optimizer; trainers/trainer.py) on `--train-rows`
episodes of `--train-len` tokens (the first quarter prompt, loss on the rest; packed into one
micro-batch) vs transformers' forward+backward of the same model (loaded from the same directory)
on the same rows with `labels` (-100 on the prompt): the same mean cross-entropy over the
completion tokens, printed for both. bf16 = fp32 weights under CPU autocast on both sides.

(c) `--fallback FAMILY`: the native trainer step vs the same Trainer on the transformers-backed
policy (`policy.implementation = "transformers"`: agents/model/hf_fallback.py's
`load_transformers_model`) of the same directory: what the fallback costs a family we implement.
(The fallback samples through vLLM, so its decode has no engine row here.)

Noise: the 2 cores are shared, so native and peer alternate (A B A B ...) `--reps` times and the
figure is the median of the per-pair ratios (load that hits one pair hits both sides of it).
Target (issue: native families): engine decode >= 2x transformers' `generate` per family.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, format_table, machine_summary
from generate import DTYPES

from toolgym.agents.engine.backend import select_backend
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from toolgym.agents.model.config import NAMED_CONFIGS, ModelConfig
from toolgym.agents.model.families import FAMILIES
from toolgym.agents.model.hf_fallback import load_transformers_model
from toolgym.agents.model.transformer import build_model
from toolgym.agents.types import SamplingParams
from toolgym.rollouts.types import Episode
from toolgym.trainers.config import TrainerConfig
from toolgym.trainers.trainer import Trainer

NOT_PUBLISHED = ("test", "tiny", "bench", "small")  # named configs that are not a published shape


def published_shape(model_type: str) -> str | None:
    """The smallest published shape of `model_type` that ModelConfig.named knows, or None."""
    names = [
        name
        for name, fields in NAMED_CONFIGS.items()
        if fields.get("model_type", "qwen2") == model_type and not name.startswith(NOT_PUBLISHED)
    ]
    return min(names, key=lambda n: ModelConfig.named(n).num_params(), default=None)


def scaled(config: ModelConfig, layers: int, hidden_cap: int | None = None) -> ModelConfig:
    """The module doc's rule: `layers` layers, every layer kind kept; width only with hidden_cap."""
    changes: dict[str, object] = {"num_hidden_layers": layers}
    for field in ("no_rope_layers", "layer_types"):
        kinds = getattr(config, field)
        if kinds is None:
            continue
        rarest = min(kinds, key=collections.Counter(kinds).__getitem__)
        changes[field] = (*kinds[: layers - 1], rarest) if layers > 1 else kinds[:1]
    if hidden_cap is not None and config.hidden_size > hidden_cap:
        heads = max(1, hidden_cap // config.head_dim)
        ratio = config.num_attention_heads // config.num_key_value_heads
        kv = heads // ratio if heads % ratio == 0 and heads >= ratio else 1
        changes.update(hidden_size=hidden_cap, intermediate_size=4 * hidden_cap,
                       num_attention_heads=heads, num_key_value_heads=kv)  # fmt: skip
    return msgspec.structs.replace(config, **changes)


# ---- (a) decode ---------------------------------------------------------------------------------


class EngineDecode:
    def __init__(self, directory: Path, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int) -> None:
        model = load_hf_checkpoint(directory, dtype=dtype, device="cpu")
        backend = select_backend(model.config, "cpu", dtype)
        self.engine = TorchEngine(model, max_batch_size=len(prompts), max_seq_len=len(prompts[0]) + new_tokens,
                                  backend=backend)  # fmt: skip
        self.prompts, self.params = prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0)
        self.new_tokens = new_tokens

    def __call__(self) -> list[list[int]]:
        out = [c.tokens for c in self.engine.generate_sync(self.prompts, self.params)]
        assert all(len(t) == self.new_tokens for t in out)
        return out

    def close(self) -> None:
        self.engine.close()


class TransformersDecode:
    def __init__(self, directory: Path, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
        self.input_ids = torch.tensor(prompts)
        self.kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=True,
                           pad_token_id=0, attention_mask=torch.ones_like(self.input_ids))  # fmt: skip

    def __call__(self) -> list[list[int]]:
        with torch.inference_mode():
            out = self.model.generate(self.input_ids, **self.kwargs)  # pyright: ignore[reportAttributeAccessIssue]
        return out[:, self.input_ids.shape[1] :].tolist()

    def close(self) -> None:
        del self.model


# ---- (b) train step -----------------------------------------------------------------------------


def train_episodes(vocab: int, rows: int, length: int) -> list[Episode]:
    generator = torch.Generator().manual_seed(2)
    prompt = length // 4
    mask, zeros = [0] * prompt + [1] * (length - prompt), [0.0] * length
    return [
        Episode(tokens=torch.randint(0, vocab, (length,), generator=generator).tolist(), loss_mask=mask,
                sampler_logprobs=zeros, advantages=zeros)
        for _ in range(rows)
    ]


class NativeTrain:
    def __init__(self, model: torch.nn.Module, precision: str, episodes: list[Episode]) -> None:
        config = TrainerConfig(precision=precision, compute_entropy=False)  # pyright: ignore[reportArgumentType]
        self.trainer, self.episodes = Trainer(model, config, device="cpu"), episodes

    def __call__(self) -> float:
        metrics = self.trainer._forward_backward(self.episodes, self.trainer.sft_loss, sharded=False)
        self.trainer.optimizer.zero_grad(set_to_none=True)
        return metrics["loss"]


class TransformersTrain:
    def __init__(self, directory: Path, precision: str, episodes: list[Episode]) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).train()
        self.input_ids = torch.tensor([e.tokens for e in episodes])
        self.labels = torch.where(torch.tensor([e.loss_mask for e in episodes]).bool(), self.input_ids, -100)
        self.autocast = precision == "bf16"

    def __call__(self) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.model(input_ids=self.input_ids, labels=self.labels).loss
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        return float(loss)


# ---- alternation --------------------------------------------------------------------------------


def alternate(native: Callable[[], object], peer: Callable[[], object], reps: int, units: float) -> dict:
    """Warm both, then `reps` pairs A B (B A on odd pairs); each side's best and median units/s
    and the median per-pair ratio native / peer (in units/s)."""
    outputs = {"native": native(), "peer": peer()}  # warm-up (and the outputs compared)
    seconds: dict[str, list[float]] = {"native": [], "peer": []}
    for rep in range(reps):
        order = [("native", native), ("peer", peer)]
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    ratios = [p / n for n, p in zip(seconds["native"], seconds["peer"], strict=True)]
    return {
        "native": units / statistics.median(seconds["native"]),
        "peer": units / statistics.median(seconds["peer"]),
        "native_s": statistics.median(seconds["native"]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "outputs": outputs,
    }


def transformers_knows(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--layers", type=int, default=1, help="layers of each scaled shape (the width is kept)")
    ap.add_argument("--hidden-cap", type=int, default=None, help="also cap the width (smoke runs only)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="decode dtypes")
    ap.add_argument("--train-precisions", default="fp32", help="train step: fp32 and/or bf16 (autocast)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--bf16-batch", type=int, default=2, help="decode batch in bf16")
    ap.add_argument("--bf16-new-tokens", type=int, default=4,
                    help="new tokens in bf16 (this AVX2 CPU's bf16 matmuls are ~10x slower)")  # fmt: skip
    ap.add_argument("--train-rows", type=int, default=2)
    ap.add_argument("--train-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="A/B pairs per measurement")
    ap.add_argument("--skip", default="", help="parts to leave out: decode,train")
    ap.add_argument("--fallback", default="qwen2", help="(c): family for native vs transformers fallback ('' = off)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    started = time.perf_counter()
    print(f"{machine_summary()}; transformers {transformers.__version__}; commit {commit()}")
    print(f"scaling: published width and features, {args.layers} layers"
          + (f", width capped at {args.hidden_cap}" if args.hidden_cap else "")
          + f"; decode batch {args.batch}, prompt {args.prompt_len}, greedy, {args.new_tokens} new tokens "
          f"(bf16: batch {args.bf16_batch}, {args.bf16_new_tokens} new); train {args.train_rows} x {args.train_len} tokens; "
          f"{args.reps} A/B pairs, median ratio", flush=True)  # fmt: skip

    decode_rows, train_rows, verdicts = [], [], []
    for model_type in args.families.split(","):
        name = published_shape(model_type)
        if model_type not in FAMILIES or name is None:
            print(f"{model_type}: skipped (no native family or no named shape in ModelConfig.named yet)")
            continue
        if not transformers_knows(model_type):
            print(f"{model_type}: skipped (transformers {transformers.__version__} has no {model_type})")
            continue
        config = scaled(ModelConfig.named(name), args.layers, args.hidden_cap)
        label = f"{model_type} ({name}, {config.num_hidden_layers}L, {config.num_params() / 1e6:.0f}M)"
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            save_hf_checkpoint(build_model(config, seed=0), config, directory)
            prompts = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len),
                                    generator=torch.Generator().manual_seed(1)).tolist()  # fmt: skip
            for dtype_name in [] if "decode" in skip else args.dtypes.split(","):
                fp32 = dtype_name == "float32"
                new, batch = (args.new_tokens, args.batch) if fp32 else (args.bf16_new_tokens, args.bf16_batch)
                print(f"[{time.perf_counter() - started:4.0f}s] {label}: decode {dtype_name}", flush=True)
                engine = EngineDecode(directory, DTYPES[dtype_name], prompts[:batch], new)
                peer = TransformersDecode(directory, DTYPES[dtype_name], prompts[:batch], new)
                try:
                    r = alternate(engine, peer, args.reps, batch * new)
                finally:
                    engine.close()
                    peer.close()
                a, b = r["outputs"]["native"], r["outputs"]["peer"]
                agree = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
                decode_rows.append([label, dtype_name, f"{r['native']:,.1f}", f"{r['peer']:,.1f}",
                                    f"{r['ratio']:.2f}x", " ".join(f"{x:.2f}" for x in r["ratios"]),
                                    f"{agree / (batch * new):.0%}"])  # fmt: skip
                verdicts.append((model_type, dtype_name, r["ratio"]))
            for precision in [] if "train" in skip else args.train_precisions.split(","):
                print(f"[{time.perf_counter() - started:4.0f}s] {label}: train {precision}", flush=True)
                episodes = train_episodes(config.vocab_size, args.train_rows, args.train_len)
                native = NativeTrain(load_hf_checkpoint(directory, dtype=torch.float32), precision, episodes)
                peer = TransformersTrain(directory, precision, episodes)
                r = alternate(native, peer, args.reps, args.train_rows * args.train_len)
                del native, peer
                train_rows.append([label, precision, f"{r['native']:,.0f}", f"{r['peer']:,.0f}", f"{r['ratio']:.2f}x",
                                   " ".join(f"{x:.2f}" for x in r["ratios"]),
                                   f"{r['outputs']['native']:.5f} / {r['outputs']['peer']:.5f}"])  # fmt: skip
            if args.fallback == model_type:
                fallback_step(directory, config, args, label, train_rows, started)

    if decode_rows:
        print("\n(a) decode: new tokens/s, medians of the A/B pairs; ratio = median of per-pair engine/transformers")
        print(format_table(["family (shape, layers, params)", "dtype", "engine tok/s", "transformers tok/s",
                            "ratio", "per pair", "greedy agree"], decode_rows))  # fmt: skip
    if train_rows:
        print("\n(b) train forward+backward: tokens/s; ratio = median of per-pair native/peer")
        print(format_table(["family (shape, layers, params)", "precision", "native tok/s", "peer tok/s", "ratio",
                            "per pair", "loss native / peer"], train_rows))  # fmt: skip
    for model_type, dtype_name, ratio in verdicts:
        if ratio < 2.0:
            print(f"below target: {model_type} {dtype_name} decode {ratio:.2f}x transformers (target >= 2x)")
    if verdicts and all(r >= 2.0 for _, _, r in verdicts):
        print("target met: every family's engine decode >= 2x transformers' generate")
    print(f"total {time.perf_counter() - started:.0f}s")


def fallback_step(directory: Path, config: ModelConfig, args, label: str, rows: list, started: float) -> None:
    """(c): native Trainer step vs the same Trainer on the transformers fallback's model."""
    print(f"[{time.perf_counter() - started:4.0f}s] {label}: train fp32, native vs fallback", flush=True)
    episodes = train_episodes(config.vocab_size, args.train_rows, args.train_len)
    native = NativeTrain(load_hf_checkpoint(directory, dtype=torch.float32), "fp32", episodes)
    fallback = NativeTrain(load_transformers_model(directory, torch.float32), "fp32", episodes)
    r = alternate(native, fallback, args.reps, args.train_rows * args.train_len)
    rows.append([label + " vs fallback", "fp32", f"{r['native']:,.0f}", f"{r['peer']:,.0f}", f"{r['ratio']:.2f}x",
                 " ".join(f"{x:.2f}" for x in r["ratios"]),
                 f"{r['outputs']['native']:.5f} / {r['outputs']['peer']:.5f}"])  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
