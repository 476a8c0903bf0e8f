"""The OpenAI-compatible endpoint (rollouts/endpoint/): its overhead against calling the engine
directly on the same requests, and a check that every capture holds the tokens the engine sampled.

Workload: agent programs that each hold a multi-turn conversation through the real `openai`
client (a system prompt, a question, then follow-ups; every turn samples `--max-tokens` tokens of
the `--model` named shape, `tiny` by default, on the torch engine, no stop token, so both paths
sample exactly the same amount). The endpoint's cost is per request, so its share falls as the
model's per-token cost grows: `--model small-25m` measures it at 8x tiny's parameters. The
endpoint run records every (prompt, sampling params) the engine got, per agent; the
direct run replays the same requests with `engine.generate` in the same shape (each agent's turns
in order, the agents concurrent). Same seeds, so the same tokens are sampled. Each run gets a fresh
engine (no k/v kept from the other path). Overhead = (endpoint wall - direct wall) / endpoint
wall, with 8 agent runs one at a time and with 64 at once; target <= 10% of rollout wall time at
64. Each figure is the best of `--repeats` alternating pairs (a loaded machine only adds delay),
the median beside it.

CPU time (the process's, best of the repeats) is printed beside: on a machine shared with other
work, wall time mostly measures the other work, while CPU time still measures this one's.

Capture checker: the endpoint run's captures are recorded (rollouts/recording/format.py) and read back;
for every capture, every turn's tokens and logprobs must equal what the engine returned for that
request, each prompt must be the previous prompt + its sampled tokens + a delta (history reused
verbatim), and the training Episode's loss-masked tokens must be exactly the sampled ones.

    python bench/serve.py [--agents 64] [--solo-agents 8] [--turns 3] [--max-tokens 16] [--repeats 3] [--threads N]
                          [--model tiny] [--stream]

--stream also runs the endpoint's agents with `stream=true` (each reply joined from its deltas) and
prints streamed against non-streamed CPU time per token at both concurrencies; the capture checker
then checks the streamed run's captures.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import openai
import torch
from _common import format_table, machine_summary

ROOT = Path(__file__).resolve().parents[1]

from toolgym.agents.chat import ChatRenderer  # noqa: E402
from toolgym.agents.engine.engine import TorchEngine  # noqa: E402
from toolgym.agents.model.transformer import build_model  # noqa: E402
from toolgym.agents.tokenizer import load_tokenizer, tokenizer_fingerprint  # noqa: E402
from toolgym.rollouts.endpoint import EndpointConfig, PolicyServer  # noqa: E402
from toolgym.rollouts.endpoint.agent_runner import shared_http_client  # noqa: E402
from toolgym.rollouts.endpoint.capture import CaptureInfo  # noqa: E402
from toolgym.rollouts.episodes import trajectory_to_episodes  # noqa: E402
from toolgym.rollouts.recording.format import RecordingHeader, RecordingWriter, read_recording  # noqa: E402


class Recorder:
    """The engine, with every request and its completions kept per conversation (by first token
    of its conversation's key, set by the caller before each call)."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.max_seq_len = engine.max_seq_len
        self.log: list[tuple[list[int], object, list]] = []

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, prompts, params):
        params = msgspec.structs.replace(params, stop_token_ids=())  # always max_tokens: equal work
        out = await self.engine.generate(prompts, params)
        self.log.append((list(prompts[0]), params, [msgspec.structs.replace(c) for c in out]))
        return out

    def load_weights(self, named_tensors, version):
        self.engine.load_weights(named_tensors, version)

    def close(self) -> None:
        pass


def make_engine(model, tokenizer, batch: int) -> TorchEngine:
    """One engine for both paths, keeping no k/v between requests (no history reuse, no shared
    prefixes): neither path finds the other's work cached, and both pay the same prefills."""
    return TorchEngine(
        model,
        tokenizer=tokenizer,
        max_batch_size=batch,
        max_seq_len=1024,
        seed=0,
        history_capacity=0,
        share_prefixes=False,
    )


async def agent(client: openai.AsyncOpenAI, turns: int, max_tokens: int, index: int, stream: bool) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": f"Question {index}: what do {index % 9 + 1} kites cost?"},
    ]
    for turn in range(turns):
        if stream:  # the reply joined from its deltas, as a streaming agent framework does
            chunks = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=max_tokens, stream=True
            )
            content = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            messages.append({"role": "assistant", "content": content})
        else:
            reply = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=max_tokens
            )
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"And then? ({turn})"})


async def endpoint_run(
    policy, renderer, agents: int, concurrent: int, turns: int, max_tokens: int, writer=None, stream=False
):
    config = EndpointConfig(max_tokens_per_turn=max_tokens, max_n=1)
    async with PolicyServer(policy, renderer, config, writer) as server:
        http = shared_http_client()  # as the agent runner does: one pool for the batch's clients
        clients = [
            openai.AsyncOpenAI(
                base_url=server.base_url, api_key=f"agent-{i}", max_retries=0, http_client=http
            )
            for i in range(agents)
        ]
        for i in range(agents):
            server.captures.register(f"agent-{i}", CaptureInfo(task_seed=i, group_id=i, sampling_seed=i))
        semaphore = asyncio.Semaphore(concurrent)

        async def one(i: int) -> None:
            async with semaphore:
                await agent(clients[i], turns, max_tokens, i, stream)
                server.captures.finish(f"agent-{i}", 0.0)

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(i) for i in range(agents)))
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        await http.aclose()
    return wall, cpu


async def direct_run(
    engine: TorchEngine, requests: list[list[tuple[list[int], object]]], concurrent: int
) -> float:
    semaphore = asyncio.Semaphore(concurrent)

    async def one(conversation) -> None:
        async with semaphore:
            for prompt, params in conversation:
                await engine.generate([prompt], params)

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(c) for c in requests))
    return time.perf_counter() - started, time.process_time() - cpu


def per_conversation(log, agents: int, turns: int) -> list[list[tuple[list[int], object]]]:
    """The recorded requests grouped by conversation: a turn's prompt extends its previous one."""
    conversations: list[list[tuple[list[int], object, list]]] = []
    for prompt, params, out in log:
        for conv in conversations:
            last_prompt, _, last_out = conv[-1]
            done = last_prompt + last_out[0].tokens
            if len(conv) < turns and prompt[: len(done)] == done:
                conv.append((prompt, params, out))
                break
        else:
            conversations.append([(prompt, params, out)])
    assert len(conversations) == agents, f"grouped {len(conversations)} conversations, expected {agents}"
    return [[(p, q) for p, q, _ in c] for c in conversations]


def check_captures(path: Path, log) -> tuple[int, int, int]:
    """(captures, token-exact captures, turns checked) of a recorded run against the engine's log."""
    by_prompt = {tuple(prompt): out[0] for prompt, _, out in log}
    _, trajectories = read_recording(path)
    exact = turns = 0
    for t in trajectories:
        ok = True
        prompt: list[int] = []
        for i, tr in enumerate(t.transitions):
            prompt = (
                list(tr.observation_tokens)
                if i == 0
                else prompt + t.transitions[i - 1].action.tokens + tr.observation_tokens
            )
            sampled = by_prompt.get(tuple(prompt))
            turns += 1
            ok = (
                ok
                and sampled is not None
                and sampled.tokens == tr.action.tokens
                and sampled.logprobs == tr.action.logprobs
            )
        (episode,) = trajectory_to_episodes(t, 1.0)
        masked = [tok for tok, m in zip(episode.tokens, episode.loss_mask, strict=True) if m]
        ok = ok and masked == [tok for tr in t.transitions for tok in tr.action.tokens]
        exact += ok
    return len(trajectories), exact, turns


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=64, help="agent runs at once (and in all): row 2")
    parser.add_argument("--solo-agents", type=int, default=8, help="agent runs one at a time: row 1")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="tiny", help="a named model shape (agents/model/config.py)")
    parser.add_argument(
        "--stream",
        action="store_true",
        help="also run the endpoint with stream=true and print its CPU time per token against non-streamed calls",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); 1 on a machine shared with other work",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = load_tokenizer(ROOT / "configs" / "assets" / "tokenizer.json")
    renderer = ChatRenderer(tokenizer)
    model = build_model(args.model, seed=0)
    print(machine_summary())
    print(
        f"workload: {args.agents} agents x {args.turns} turns x {args.max_tokens} tokens, `{args.model}` on the torch engine"
    )

    engine = make_engine(model, tokenizer, args.agents)
    rows = []
    for concurrent, agents in ((1, args.solo_agents), (args.agents, args.agents)):
        endpoint_s, direct_s, endpoint_cpu, direct_cpu, stream_cpu = [], [], [], [], []
        for repeat in range(args.repeats + 1):  # the first pair warms up; then they alternate
            recorder = Recorder(engine)
            run = endpoint_run(recorder, renderer, agents, concurrent, args.turns, args.max_tokens)
            wall, cpu = asyncio.run(run)
            requests = per_conversation(recorder.log, agents, args.turns)
            direct, direct_c = asyncio.run(direct_run(engine, requests, concurrent))
            if args.stream:  # the same requests streamed (same seeds: the same tokens sampled)
                streamed = endpoint_run(
                    Recorder(engine), renderer, agents, concurrent, args.turns, args.max_tokens, stream=True
                )
                if repeat:
                    stream_cpu.append(asyncio.run(streamed)[1])
                else:
                    asyncio.run(streamed)
            if repeat:
                endpoint_s.append(wall)
                direct_s.append(direct)
                endpoint_cpu.append(cpu)
                direct_cpu.append(direct_c)
        # Best of the repeats is the headline (a loaded machine only adds delay); medians beside.
        e, d = min(endpoint_s), min(direct_s)
        em, dm = statistics.median(endpoint_s), statistics.median(direct_s)
        ec, dc = min(endpoint_cpu), min(direct_cpu)
        overhead = f"{100 * (e - d) / e:.1f}% ({100 * (em - dm) / em:.1f}%)"
        rows.append(
            [
                f"{concurrent} ({agents} runs)",
                f"{d:.2f} ({dm:.2f})",
                f"{e:.2f} ({em:.2f})",
                overhead,
                f"{dc:.2f} / {ec:.2f}: {100 * (ec - dc) / ec:.1f}%",
            ]
        )
        print(f"  {concurrent} at once: endpoint {[round(x, 2) for x in endpoint_s]} s")
        print(f"  {concurrent} at once: direct   {[round(x, 2) for x in direct_s]} s")
        print(f"  {concurrent} at once: endpoint CPU {[round(x, 2) for x in endpoint_cpu]} s")
        print(f"  {concurrent} at once: direct CPU   {[round(x, 2) for x in direct_cpu]} s")
        if args.stream:
            tokens = agents * args.turns * args.max_tokens  # no stop token: every turn samples max_tokens
            sc = min(stream_cpu)
            print(f"  {concurrent} at once: streamed CPU {[round(x, 2) for x in stream_cpu]} s")
            print(
                f"  {concurrent} at once: CPU per token, best: non-streamed {1000 * ec / tokens:.3f} ms, "
                f"streamed {1000 * sc / tokens:.3f} ms, ratio streamed/non-streamed {sc / ec:.3f}"
            )
    headers = [
        "agents at once",
        "direct engine: best (median) s",
        "endpoint: best (median) s",
        "overhead",
        "CPU s direct / endpoint: overhead",
    ]
    print(format_table(headers, rows))

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "captures.jsonl"
        header = RecordingHeader(
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), env_id="toolgym/endpoint"
        )
        recorder = Recorder(engine)
        with RecordingWriter(path, header) as writer:
            asyncio.run(
                endpoint_run(
                    recorder,
                    renderer,
                    args.agents,
                    args.agents,
                    args.turns,
                    args.max_tokens,
                    writer,
                    args.stream,
                )
            )
        engine.close()
        captures, exact, turns = check_captures(path, recorder.log)
    print(
        f"capture checker: {exact}/{captures} captures token-exact ({100 * exact / max(captures, 1):.1f}%), {turns} turns"
    )
    return 0 if exact == captures else 1


if __name__ == "__main__":
    sys.exit(main())
