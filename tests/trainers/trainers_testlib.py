"""Shared helpers for the trainer tests, and a worker they launch under torchrun.

As a script (`python -m torch.distributed.run --nproc_per_node N trainers_testlib.py OUT_DIR
LOSS[,LOSS]`, or plainly with `python trainers_testlib.py OUT_DIR LOSS` for one process) it trains the "test" model
on fixed random Episodes and saves, from rank 0, what the tests compare: the first step's loss
and full gradients, then the parameters and metrics after a few steps. With LOSS "lora" it trains
LoRA adapters over the frozen "test" model instead (`_lora_worker`).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from toolgym.rollouts.types import Episode


def random_episodes(
    n: int, seed: int = 0, vocab: int = 256, min_len: int = 5, max_len: int = 40, shared_prefix: int = 0
) -> list[Episode]:
    """Episodes with a prompt (masked) then a sampled part, a per-episode advantage, and sampler
    logprobs near what a random "test" model gives (about -log(vocab)). `shared_prefix`: every
    prompt starts with the same that many tokens (a system prompt), so micro-batches share them."""
    rng = random.Random(seed)
    common = [rng.randrange(vocab) for _ in range(shared_prefix)]
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        prompt = rng.randint(2, length - 1)
        tokens = common + [rng.randrange(vocab) for _ in range(length)]
        mask = [0] * (shared_prefix + prompt) + [1] * (length - prompt)
        advantage = rng.gauss(0.0, 1.0)
        out.append(
            Episode(
                tokens=tokens,
                loss_mask=mask,
                sampler_logprobs=[(-5.545 + 0.05 * rng.gauss(0, 1)) if m else 0.0 for m in mask],
                advantages=[advantage if m else 0.0 for m in mask],
            )
        )
    return out


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, gathered whole (DTensor shards joined)."""
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if grad is None:
            continue
        out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().cpu().clone()
    return out


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        data = p.data
        out[name] = (data.full_tensor() if hasattr(data, "full_tensor") else data).detach().cpu().clone()
    return out


def worker_config(loss_name: str, activation_checkpointing: bool = False):
    from toolgym.trainers.config import OptimizerConfig, TrainerConfig
    from toolgym.trainers.losses import LossConfig

    return TrainerConfig(
        loss=LossConfig(name=loss_name),
        micro_batch_tokens=200,
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=1, decay="linear", total_steps=6),
        activation_checkpointing=activation_checkpointing,
    )


def _worker(out_dir: str, loss_names: str) -> None:
    from toolgym.agents.model.transformer import build_model
    from toolgym.trainers.checkpoint import CheckpointManager
    from toolgym.trainers.trainer import Trainer

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for run in loss_names.split(","):
        # "loss" trains the "test" model, "loss:model" that named model; its results go to run.pt
        loss_name, _, model_name = run.partition(":")
        # Two ranks recompute dapo's blocks in backward (FSDP2 with activation checkpointing), to
        # be compared with one process that keeps them.
        recompute = world > 1 and loss_name == "dapo"
        config = worker_config(loss_name, activation_checkpointing=recompute)
        trainer = Trainer(build_model(model_name or "test", seed=0), config, device="cpu")
        episodes = random_episodes(13, seed=1)
        first = trainer._forward_backward(episodes, trainer.policy_loss, sharded=False)
        grads = full_grads(trainer.model)
        trainer.optimizer.zero_grad(set_to_none=True)
        # later steps share a system-prompt-like prefix (trainers/shared_prefix.py under FSDP2)
        history = [
            trainer.train_step(random_episodes(13, seed=10 + step, shared_prefix=24)) for step in range(3)
        ]
        params = full_params(trainer.model)
        CheckpointManager(f"{out_dir}/{run}.ckpt").save(trainer, {"next_step": 3})
        if trainer.dist.is_main:
            result = {"first": first, "grads": grads, "history": history, "params": params}
            torch.save(result, f"{out_dir}/{run}.pt")
    torch.distributed.destroy_process_group()


def lora_test_model(seed: int = 0, moe: bool = False):
    """The "test" model with rank-4 LoRA adapters (alpha 8) on every projection; `moe`: the
    "test-qwen3-moe" model with them on q_proj and every expert."""
    from toolgym.agents.model.lora import LoraConfig, apply_lora
    from toolgym.agents.model.transformer import build_model

    if moe:
        config = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "experts"])
        return apply_lora(build_model("test-qwen3-moe", seed=seed), config, seed=seed)
    return apply_lora(build_model("test", seed=seed), LoraConfig(rank=4, alpha=8), seed=seed)


def _lora_worker(out_dir: str, moe: bool = False) -> None:
    """LoRA under FSDP2 (world size > 1) or plainly: the first step's gradients, the base before
    and after three steps, the adapters, and what a sync from rank 0 into a TorchEngine (with the
    same base) reports applying; saved from rank 0 as `lora.pt`, a checkpoint as `lora.ckpt`."""
    from toolgym.agents.engine.engine import TorchEngine
    from toolgym.agents.model.lora import adapter_checksum
    from toolgym.trainers.checkpoint import CheckpointManager
    from toolgym.trainers.trainer import Trainer
    from toolgym.trainers.weight_sync import gather_weights, push_weights

    torch.set_num_threads(1)
    trainer = Trainer(lora_test_model(seed=0, moe=moe), worker_config("grpo"), device="cpu")
    before = full_params(trainer.model)
    first = trainer._forward_backward(random_episodes(13, seed=1), trainer.policy_loss, sharded=False)
    grads = full_grads(trainer.model)
    trainer.optimizer.zero_grad(set_to_none=True)
    history = [trainer.train_step(random_episodes(13, seed=10 + step)) for step in range(3)]
    after = full_params(trainer.model)
    engine = (
        TorchEngine(lora_test_model(seed=0, moe=moe), max_batch_size=2, max_seq_len=32)
        if trainer.dist.is_main
        else None
    )
    sync_error = ""
    try:
        push_weights(trainer, engine)  # collective; checks version and checksum on rank 0
    except Exception as exc:  # reported to the test, which names it
        sync_error = f"{type(exc).__name__}: {exc}"
    sent = gather_weights(trainer)  # collective
    CheckpointManager(f"{out_dir}/lora.ckpt").save(trainer, {"next_step": 3})
    if engine is not None:
        applied = engine.applied_adapter()
        engine_adapters = engine.adapter_tensors()
        result = {
            "first": first,
            "grads": grads,
            "history": history,
            "before": before,
            "after": after,
            "sent": {n: t.detach().cpu().clone() for n, t in sent.items()},
            "sync_error": sync_error,
            "applied": None if applied is None else (applied.version, applied.checksum),
            "engine_checksum": adapter_checksum(engine_adapters),
            "world_size": trainer.dist.world_size,
        }
        torch.save(result, f"{out_dir}/lora.pt")
        engine.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[2] in ("lora", "lora-moe"):
        _lora_worker(sys.argv[1], moe=sys.argv[2] == "lora-moe")
    else:
        _worker(sys.argv[1], sys.argv[2])


def sample_and_score(trainer, engine, prompt: list[int], max_tokens: int = 12, seed: int = 1):
    """One completion of `prompt` sampled by `engine` (temperature 1, `seed`), and the largest
    |trainer logprob - sampler logprob| over its tokens: (completion, gap)."""
    import asyncio

    from toolgym.agents.types import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
    (completion,) = asyncio.run(engine.generate([prompt], params))
    tokens = prompt + completion.tokens
    episode = Episode(
        tokens=tokens,
        loss_mask=[0] * len(prompt) + [1] * len(completion.tokens),
        sampler_logprobs=[0.0] * len(prompt) + list(completion.logprobs),
        advantages=[0.0] * len(tokens),
    )
    (row,) = trainer.compute_logprobs([episode])
    gap = max(abs(a - b) for a, b in zip(row[len(prompt) :], completion.logprobs, strict=True))
    return completion, gap


WORKER = Path(__file__)  # this file, run as the worker script


def run_worker(cmd: list[str], tmp: Path) -> None:
    """Run `cmd` (the worker under python or torchrun) in `tmp`, one thread per process, without
    any torchrun variables of the caller's; fails the test with the output's tail on an error."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(WORKER.parent))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
