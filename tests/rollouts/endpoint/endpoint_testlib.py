"""Shared pieces of the endpoint tests: the shipped tokenizer's renderer, a tiny torch engine, and
policies that script or slow down what is sampled (the server and the openai client are real)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import torch

from toolgym.agents.chat import ChatRenderer
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import build_model
from toolgym.agents.tokenizer import load_tokenizer
from toolgym.agents.types import Completion, SamplingParams

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = ROOT / "configs" / "assets" / "tokenizer.json"
PRICE_TOOL = {
    "type": "function",
    "function": {
        "name": "price",
        "description": "The price of a quantity of an item today.",
        "parameters": {
            "type": "object",
            "properties": {"item": {"type": "string"}, "quantity": {"type": "integer"}},
            "required": ["item", "quantity"],
        },
    },
}


# How long a wait for a condition (a process's request arriving, a disconnect noticed) may take
# before the test fails: the tests wait for what they need, and this bound only ends one whose
# condition never comes; two busy cores cannot exhaust it.
PATIENCE_S = 300.0


async def until(condition: Callable[[], object], what: str, process: subprocess.Popen | None = None) -> None:
    """Poll `condition` every 10 ms until it holds; fail (naming `what`) if `process`, which it
    depends on, exits first, or after PATIENCE_S."""
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"waiting for {what}: the process exited first (code {process.returncode})")
        if time.monotonic() > deadline:
            raise AssertionError(f"waiting for {what}: not there after {PATIENCE_S:.0f} s")
        await asyncio.sleep(0.01)


def renderer() -> ChatRenderer:
    return ChatRenderer(load_tokenizer(TOKENIZER))


def tiny_model(seed: int = 0, positions: int = 512):
    """The 'test' shapes with the shipped tokenizer's vocabulary (1000 tokens)."""
    config = msgspec.structs.replace(
        ModelConfig.named("test"), vocab_size=1024, max_position_embeddings=positions
    )
    return build_model(config, seed=seed)


def engine(max_batch_size: int = 64, max_seq_len: int = 512) -> TorchEngine:
    r = renderer()
    model = tiny_model(positions=max(512, max_seq_len))
    return TorchEngine(model, tokenizer=r.tokenizer, max_batch_size=max_batch_size, max_seq_len=max_seq_len)


class ScriptedPolicy:
    """Answers each request with the next scripted reply (its tokens + <|im_end|>), sampler
    logprobs -0.25 per token; records every prompt and params it was given."""

    def __init__(self, chat: ChatRenderer, replies: Iterable[str], max_seq_len: int = 512) -> None:
        self.chat, self.replies = chat, list(replies)
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self.max_seq_len = max_seq_len
        self.policy_version = 0

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.prompts += prompts
        self.params.append(params)
        out = []
        for _ in range(len(prompts) * params.n):
            text = self.replies.pop(0) if self.replies else "done"
            tokens = [*self.chat.encode(text), self.chat.im_end_id][: params.max_tokens]
            out.append(Completion(tokens, [-0.25] * len(tokens), "stop", text, self.policy_version))
        return out

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.policy_version = version

    def close(self) -> None:
        pass


class NoStop:
    """The engine, sampling to max_tokens whatever it samples (no stop tokens): a long generation
    that a client can be killed in the middle of."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.max_seq_len = engine.max_seq_len
        self.started = asyncio.Event()

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.started.set()
        return await self.engine.generate(prompts, msgspec.structs.replace(params, stop_token_ids=()))

    def load_weights(self, named_tensors, version: int) -> None:
        self.engine.load_weights(named_tensors, version)

    def close(self) -> None:
        pass
