"""`stream=true` on /v1/chat/completions with the real `openai` client on 127.0.0.1: the streamed
reply is the non-streamed one (content, tool calls, logprobs, usage) and is captured the same,
64 concurrent streams all finish and are all captured, and a client gone mid-stream or
mid-generation leaves the server with nothing stuck."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import openai
import pytest
from endpoint_testlib import PRICE_TOOL, NoStop, ScriptedPolicy, engine, renderer, until

from toolgym.agents.chat import ChatRenderer
from toolgym.rollouts.endpoint import EndpointConfig, PolicyServer
from toolgym.rollouts.episodes import build_episodes, trajectory_to_episodes
from toolgym.rollouts.types import StopReason

CALL = '<tool_call>\n{"name": "price", "arguments": {"item": "kite", "quantity": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def chat() -> ChatRenderer:
    return renderer()


@pytest.fixture(scope="module")
def torch_engine():
    with engine(max_batch_size=64, max_seq_len=512) as e:
        yield e


def client(server: PolicyServer, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=None)


def same_capture(a, b) -> None:
    """Two trajectories hold the same tokens, logprobs and training Episodes."""
    assert len(a.transitions) == len(b.transitions) > 0
    for x, y in zip(a.transitions, b.transitions, strict=True):
        assert x.observation_tokens == y.observation_tokens
        assert x.action.tokens == y.action.tokens and x.action.logprobs == y.action.logprobs
    for x, y in zip(trajectory_to_episodes(a, 1.0), trajectory_to_episodes(b, 1.0), strict=True):
        assert (
            x.tokens == y.tokens and x.loss_mask == y.loss_mask and x.sampler_logprobs == y.sampler_logprobs
        )


def test_a_streamed_reply_is_the_non_streamed_one_and_is_captured_the_same(chat, torch_engine):
    request = {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        "max_tokens": 12,
        "logprobs": True,
        "temperature": 1.0,
        "seed": 3,
    }

    async def main():
        async with PolicyServer(torch_engine, chat) as server:
            plain_client, streamed_client = client(server, "plain"), client(server, "streamed")
            plain = await plain_client.chat.completions.create(**request)
            chunks = []
            async with streamed_client.chat.completions.stream(
                **request, stream_options={"include_usage": True}
            ) as stream:
                async for event in stream:
                    if event.type == "chunk":
                        chunks.append(event.chunk)
                # what the client accumulated (get_final_completion raises on a 'length' finish)
                streamed = stream.current_completion_snapshot
            await plain_client.close()
            await streamed_client.close()
            return (
                plain,
                chunks,
                streamed,
                server.captures.finish("plain", 1.0),
                server.captures.finish("streamed", 1.0),
            )

    plain, chunks, streamed, plain_capture, streamed_capture = asyncio.run(main())
    (p,), (s,) = plain.choices, streamed.choices
    assert s.message.content == p.message.content and s.finish_reason == p.finish_reason
    assert s.logprobs is not None and p.logprobs is not None
    assert [(t.token, t.logprob) for t in s.logprobs.content or []] == [
        (t.token, t.logprob) for t in p.logprobs.content or []
    ]
    assert plain.usage is not None and len(p.logprobs.content or []) == plain.usage.completion_tokens
    assert streamed.usage == plain.usage
    # The chunks as OpenAI sends them: the role first, usage (only) in the last, null before it.
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == p.finish_reason
    assert (chunks[-2].model_extra or {})["toolgym"]["conversation_id"] == "streamed"
    same_capture(plain_capture, streamed_capture)


def test_streamed_tool_calls_come_as_openai_streams_them_and_add_up_to_the_message(chat):
    reply = f"Let me look.\n{CALL}\n{CALL.replace('kite', 'sail')}"
    policy = ScriptedPolicy(chat, [reply, reply, "8.10", "8.10"])
    request = {"model": "m", "messages": [{"role": "user", "content": "3 kites?"}], "tools": [PRICE_TOOL]}

    async def main():
        async with PolicyServer(policy, chat) as server:
            plain_client, streamed_client = client(server, "plain"), client(server, "streamed")
            plain = await plain_client.chat.completions.create(**request)
            chunks = [c async for c in await streamed_client.chat.completions.create(**request, stream=True)]
            # Both agents go on from what they got: the streamed one from the deltas joined.
            message = plain.choices[0].message.model_dump(exclude_none=True)
            tool_message = {"role": "tool", "tool_call_id": "x", "content": "8.10"}
            for c in (plain_client, streamed_client):
                await c.chat.completions.create(
                    **{**request, "messages": [*request["messages"], message, tool_message]}
                )
                await c.close()
            return (
                plain,
                chunks,
                server.captures.finish("plain", 1.0),
                server.captures.finish("streamed", 1.0),
            )

    plain, chunks, plain_capture, streamed_capture = asyncio.run(main())
    choice = plain.choices[0]
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.usage is None for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == choice.message.content == "Let me look."
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.index not in calls:  # a call's first delta: its id, type and name, no arguments yet
                assert delta.id and delta.type == "function" and delta.function and delta.function.name
                assert delta.function.arguments == ""
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:  # then only argument fragments
                assert delta.id is None and delta.function and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    expected = choice.message.tool_calls or []
    assert [calls[i] for i in sorted(calls)] == [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in expected
    ]
    assert [json.loads(calls[i]["arguments"])["item"] for i in sorted(calls)] == ["kite", "sail"]
    assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks) > len(calls)  # fragments
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason == "tool_calls"
    same_capture(plain_capture, streamed_capture)
    assert streamed_capture.stop_reason == StopReason.ANSWERED


def test_n_streamed_choices_each_add_up_to_their_non_streamed_message(chat):
    policy = ScriptedPolicy(chat, ["red sky", "blue sea at noon", "red sky", "blue sea at noon"])
    request = {"model": "m", "messages": [{"role": "user", "content": "colour?"}], "n": 2}

    async def main():
        async with PolicyServer(policy, chat) as server:
            c = client(server, "n")
            plain = await c.chat.completions.create(**request)
            async with c.chat.completions.stream(**request) as stream:
                async for _ in stream:
                    pass
                streamed = stream.current_completion_snapshot
            await c.close()
            return plain, streamed

    plain, streamed = asyncio.run(main())
    assert [(ch.index, ch.message.content, ch.finish_reason) for ch in streamed.choices] == [
        (ch.index, ch.message.content, ch.finish_reason) for ch in plain.choices
    ]
    assert [ch.message.content for ch in plain.choices] == ["red sky", "blue sea at noon"]


def test_64_concurrent_streams_all_finish_and_are_all_captured(chat, torch_engine):
    async def agent(server: PolicyServer, i: int):
        c = client(server, f"agent-{i}")
        stream = await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"agent {i} says hello"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        await c.close()
        return chunks

    async def main():
        async with PolicyServer(torch_engine, chat) as server:
            streams = await asyncio.gather(*(agent(server, i) for i in range(64)))
            assert sorted(server.captures.open) == sorted(f"agent-{i}" for i in range(64))
            return streams, [server.captures.finish(f"agent-{i}", 1.0) for i in range(64)], server

    streams, captures, server = asyncio.run(main())
    for chunks, trajectory in zip(streams, captures, strict=True):
        (transition,) = trajectory.transitions
        tokens = transition.action.tokens
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(tokens) > 0
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == chat.decode(tokens, skip_special_tokens=True)
        assert trajectory.error is None
    assert server.stats.requests == 64 and server.stats.errors == 0 and server.stats.disconnects == 0
    assert len(build_episodes(captures, [1.0] * 64)[0]) == 64


def test_a_client_gone_mid_stream_leaves_its_turn_recorded_and_nothing_behind(chat):
    """The reply is sampled and captured before its first byte is sent: a client that reads one
    chunk and hangs up leaves its turn in the capture, and the conversation goes on."""
    long_reply = " ".join(f"word{i}" for i in range(60))
    policy = ScriptedPolicy(chat, [long_reply, "next"], max_seq_len=4096)
    body = {"model": "m", "messages": [{"role": "user", "content": "talk"}], "stream": True}

    async def main():
        async with PolicyServer(policy, chat) as server, httpx.AsyncClient(timeout=None) as http:
            idle = len(asyncio.all_tasks())
            headers = {"authorization": "Bearer cut"}
            async with http.stream(
                "POST", server.base_url + "/chat/completions", json=body, headers=headers
            ) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        first = msgspec.json.decode(line[6:])
                        break
            await http.aclose()  # the connection is gone
            # Nothing waits on the gone client: the server's tasks go back to what idle had.
            await until(lambda: len(asyncio.all_tasks()) <= idle, "the server's tasks to settle")
            conversation = server.captures.open["cut"]
            assert not conversation.lock.locked() and conversation.pending is not None
            assert server._gate is None and server.stats.errors == 0
            c = client(server, "cut")  # the agent goes on with the whole reply
            messages = [*body["messages"], {"role": "assistant", "content": long_reply}]
            await c.chat.completions.create(
                model="m", messages=[*messages, {"role": "user", "content": "go"}]
            )
            await c.close()
            return first, server.captures.finish("cut", 1.0)

    first, trajectory = asyncio.run(main())
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert len(trajectory.transitions) == 2 and trajectory.error is None
    assert chat.decode(trajectory.transitions[0].action.tokens, skip_special_tokens=True) == long_reply


def test_a_stream_cancelled_mid_generation_frees_its_slot_and_breaks_only_its_capture(chat):
    long_engine = engine(max_batch_size=2, max_seq_len=8192)
    policy = NoStop(long_engine)
    scheduler = long_engine._scheduler

    async def main():
        config = EndpointConfig(max_tokens_per_turn=8000)
        async with PolicyServer(policy, chat, config) as server:  # type: ignore[arg-type]
            idle = len(asyncio.all_tasks())
            c = client(server, "gone")
            request = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 8000}
            waiting = asyncio.ensure_future(c.chat.completions.create(**request, stream=True))
            await until(lambda: scheduler.slots.running, "its slot to decode")
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await c.close()
            await until(lambda: server.stats.disconnects and not scheduler.slots.running, "the slot freed")
            await until(lambda: len(asyncio.all_tasks()) <= idle, "the server's tasks to settle")
            return server.captures.finish("gone", 1.0)

    try:
        broken = asyncio.run(main())
    finally:
        long_engine.close()
    assert broken.stop_reason == StopReason.TIMEOUT and "ClientDisconnected" in (broken.error or "")
    assert broken.transitions == [] and build_episodes([broken], [1.0])[1].dropped_infra == 1


def test_stream_options_without_stream_and_streamed_completions_are_refused(chat):
    async def main():
        async with (
            PolicyServer(ScriptedPolicy(chat, []), chat) as server,
            httpx.AsyncClient(timeout=None) as http,
        ):
            message = [{"role": "user", "content": "x"}]
            options = await http.post(
                server.base_url + "/chat/completions",
                json={"messages": message, "stream_options": {"include_usage": True}},
            )
            unknown = await http.post(
                server.base_url + "/chat/completions",
                json={"messages": message, "stream": True, "stream_options": {"bogus": True}},
            )
            text = await http.post(server.base_url + "/completions", json={"prompt": "x", "stream": True})
            return options, unknown, text

    for response in asyncio.run(main()):
        assert response.status_code == 400
        assert response.json()["error"]["param"] in ("stream_options", "stream")
