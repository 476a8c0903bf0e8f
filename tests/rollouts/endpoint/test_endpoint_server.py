"""The OpenAI-compatible endpoint with the real `openai` client on 127.0.0.1 (no HTTP mocks): chat
and completions, tool calls, token-exact capture (history reuse, rewrites split into sequences),
OpenAI-style 4xx errors, a client killed mid-generation, shutdown with captures open."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading

import httpx
import openai
import pytest
from endpoint_testlib import PATIENCE_S, PRICE_TOOL, NoStop, ScriptedPolicy, engine, renderer, until

from toolgym.agents.chat import ChatRenderer
from toolgym.agents.tokenizer import RELEASE_GIL_CHARS
from toolgym.agents.types import Message
from toolgym.rollouts.endpoint import EndpointConfig, PolicyServer
from toolgym.rollouts.endpoint.capture import HISTORY_REWRITES, INCOMPLETE, Conversation
from toolgym.rollouts.episodes import build_episodes, trajectory_to_episodes
from toolgym.rollouts.recording.format import RecordingHeader, RecordingWriter, read_recording
from toolgym.rollouts.types import SEQUENCE_START, StopReason

CALL = '<tool_call>\n{"name": "price", "arguments": {"item": "kite", "quantity": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def chat() -> ChatRenderer:
    return renderer()


@pytest.fixture(scope="module")
def torch_engine():
    with engine(max_batch_size=8, max_seq_len=512) as e:
        yield e


def client(server: PolicyServer, key: str = "conv") -> openai.AsyncOpenAI:
    # no timeout: a request waits for its answer (pytest's own timeout ends a hung test)
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=None)


def test_models_lists_the_policy_and_a_tool_call_comes_back_as_tool_calls(chat):
    policy = ScriptedPolicy(chat, [f"Let me look.\n{CALL}", "8.10"])

    async def main():
        async with PolicyServer(policy, chat, EndpointConfig(model_name="tiny")) as server:
            assert server.base_url.startswith("http://127.0.0.1:")
            c = client(server)
            models = await c.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            messages = [{"role": "user", "content": "What do 3 kites cost?"}]
            first = await c.chat.completions.create(model="any", messages=messages, tools=[PRICE_TOOL])
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "Let me look."
            (call,) = choice.message.tool_calls
            assert call.function.name == "price"
            assert json.loads(call.function.arguments) == {"item": "kite", "quantity": 3}
            assert first.usage.completion_tokens == len(chat.encode(f"Let me look.\n{CALL}")) + 1
            messages += [
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "8.10"},
            ]
            second = await c.chat.completions.create(model="any", messages=messages, tools=[PRICE_TOOL])
            assert second.choices[0].message.content == "8.10"
            assert second.choices[0].finish_reason == "stop"
            await c.close()
            trajectory = server.captures.finish("conv", 1.0)
        # The tools were described in the system message (plain ChatML renders no tools block).
        assert "price" in chat.decode(policy.prompts[0])
        # The tool result came back as the JSON format's <tool_response> block, in a tool turn.
        assert "<tool_response>\n8.10\n</tool_response>" in chat.decode(policy.prompts[1])
        assert trajectory.stop_reason == StopReason.ANSWERED and trajectory.total_reward == 1.0
        assert len(trajectory.transitions) == 2 and trajectory.metrics[HISTORY_REWRITES] == 0

    asyncio.run(main())


def test_capture_reuses_the_sampled_tokens_verbatim_and_is_the_training_episode(chat, torch_engine):
    """Each prompt is the history + the exact sampled tokens + the rendered delta; the Episode's
    tokens are the last prompt + its sample, loss mask 1 exactly on the sampled tokens, with the
    logprobs the client was given."""
    seen: list[list[int]] = []

    class Spy:
        max_seq_len = torch_engine.max_seq_len
        policy_version = 0

        async def generate(self, prompts, params):
            seen.extend(prompts)
            return await torch_engine.generate(prompts, params)

    async def main():
        async with PolicyServer(Spy(), chat) as server:  # type: ignore[arg-type]
            c = client(server, "exact")
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
            replies = []
            for turn in range(3):
                r = await c.chat.completions.create(
                    model="m", messages=messages, max_tokens=12, logprobs=True, temperature=1.0, seed=turn
                )
                replies.append(r)
                messages += [
                    r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": f"more {turn}"},
                ]
            await c.close()
            return server.captures.finish("exact", 0.5), replies

    trajectory, replies = asyncio.run(main())
    assert chat.render_prompt([Message("system", "Be brief."), Message("user", "Hello")]) == seen[0]
    for i, transition in enumerate(trajectory.transitions):
        lp = [x.logprob for x in replies[i].choices[0].logprobs.content]
        assert transition.action.logprobs == pytest.approx(lp)
        if i:  # the next prompt starts with the previous prompt and its sampled tokens, verbatim
            assert seen[i][: len(seen[i - 1]) + len(trajectory.transitions[i - 1].action.tokens)] == (
                seen[i - 1] + trajectory.transitions[i - 1].action.tokens
            )
    (episode,) = trajectory_to_episodes(trajectory, 1.0)
    assert episode.tokens == seen[-1] + trajectory.transitions[-1].action.tokens
    sampled = [tok for t in trajectory.transitions for tok in t.action.tokens]
    assert [tok for tok, m in zip(episode.tokens, episode.loss_mask, strict=True) if m] == sampled
    assert trajectory.total_reward == 0.5 and trajectory.transitions[-1].reward == 0.5


def test_a_history_rewrite_starts_a_new_training_sequence_and_is_counted(chat):
    policy = ScriptedPolicy(chat, ["one", "two", "three"])

    async def main():
        async with PolicyServer(policy, chat) as server:
            c = client(server, "rw")
            messages = [{"role": "user", "content": "a"}]
            r = await c.chat.completions.create(model="m", messages=messages)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "b"}]
            r = await c.chat.completions.create(model="m", messages=messages)
            # The agent drops the first exchange (a summarising or windowing agent).
            messages = [{"role": "user", "content": "b"}, r.choices[0].message.model_dump(exclude_none=True)]
            messages.append({"role": "user", "content": "c"})
            await c.chat.completions.create(model="m", messages=messages)
            await c.close()
            return server.captures.finish("rw", 1.0)

    trajectory = asyncio.run(main())
    assert trajectory.metrics[HISTORY_REWRITES] == 1 and trajectory.metrics["sequence_restarts"] == 1
    assert [bool(t.info.get(SEQUENCE_START)) for t in trajectory.transitions] == [False, False, True]
    first, second = trajectory_to_episodes(trajectory, 1.0)
    assert second.tokens[: len(trajectory.transitions[2].observation_tokens)] == chat.render_prompt(
        [Message("user", "b"), Message("assistant", "two"), Message("user", "c")]
    )
    assert sum(first.loss_mask) + sum(second.loss_mask) == sum(
        len(t.action.tokens) for t in trajectory.transitions
    )


def test_n_samples_continue_with_the_chosen_one(chat):
    policy = ScriptedPolicy(chat, ["red", "blue", "next"])

    async def main():
        async with PolicyServer(policy, chat) as server:
            c = client(server, "n")
            messages = [{"role": "user", "content": "colour?"}]
            r = await c.chat.completions.create(model="m", messages=messages, n=2)
            assert [ch.message.content for ch in r.choices] == ["red", "blue"]
            messages += [
                r.choices[1].message.model_dump(exclude_none=True),
                {"role": "user", "content": "ok"},
            ]
            await c.chat.completions.create(model="m", messages=messages)
            await c.close()
            return server.captures.finish("n", 1.0)

    trajectory = asyncio.run(main())
    assert trajectory.metrics[HISTORY_REWRITES] == 0
    assert chat.decode(trajectory.transitions[0].action.tokens, skip_special_tokens=True) == "blue"
    assert policy.params[0].n == 2


def test_stop_strings_cut_the_reply_and_the_capture_keeps_the_sampled_prefix(chat):
    policy = ScriptedPolicy(chat, ["The answer is 42. END and more text"])

    async def main():
        async with PolicyServer(policy, chat) as server:
            c = client(server, "stop")
            r = await c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}], stop=["END"]
            )
            await c.close()
            return r, server.captures.finish("stop", 0.0)

    r, trajectory = asyncio.run(main())
    assert r.choices[0].message.content == "The answer is 42. " and r.choices[0].finish_reason == "stop"
    tokens = trajectory.transitions[0].action.tokens
    assert (
        chat.decode(tokens).startswith("The answer is 42. END") and chat.decode(tokens[:-1]).find("END") < 0
    )


def test_completions_endpoint_extends_a_raw_text_history(chat):
    policy = ScriptedPolicy(chat, [" world", " again"])

    async def main():
        async with PolicyServer(policy, chat) as server:
            c = client(server, "raw")
            r = await c.completions.create(model="m", prompt="hello", logprobs=1)
            text = "hello" + r.choices[0].text
            await c.completions.create(model="m", prompt=text + " and")
            await c.close()
            return r, server.captures.finish("raw", 1.0)

    r, trajectory = asyncio.run(main())
    assert r.choices[0].logprobs.token_logprobs == [-0.25] * len(trajectory.transitions[0].action.tokens)
    assert (
        trajectory.transitions[1].observation_tokens
        == chat.tokenizer.encode(" and", add_special_tokens=False).ids
    )
    assert trajectory.metrics[HISTORY_REWRITES] == 0


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "not valid JSON"),  # not UTF-8
        (
            b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": '
            b'{"name": "f", "parameters": {"type": "objekt"}}}]}',
            400,
            "Invalid schema for function 'f'",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]}',
            400,
            "must answer a preceding assistant message with 'tool_calls'",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000000000000}', 400, "too large"),
        (b"", 400, "empty"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_token": 5}', 400, "max_token"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": "2"}', 400, "$.n"),
        (b'{"messages": "hello"}', 400, "$.messages"),
        (b'{"messages": []}', 400, "at least one message"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', 400, "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 99}', 400, "n must be between 1 and 16"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
            400,
            "max_tokens must be >= 1",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}',
            400,
            "only allowed when 'stream' is enabled",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}', 400, "tool_choice"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}', 400, "top_logprobs"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 7}', 400, "temperature"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}', 400, "tools"),
    ],
)
def test_malformed_requests_get_openai_style_errors_that_say_what_is_wrong(chat, body, status, says):
    async def main():
        async with (
            PolicyServer(ScriptedPolicy(chat, []), chat) as server,
            httpx.AsyncClient(timeout=None) as http,
        ):
            url = server.base_url + "/chat/completions"
            return await http.post(url, content=body, headers={"content-type": "application/json"})

    response = asyncio.run(main())
    assert response.status_code == status
    error = response.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"


def test_null_stream_logprobs_and_echo_mean_false_as_in_openai(chat):
    """`"stream": null` was a 400 (`Expected bool, got null`); OpenAI reads null as false."""
    policy = ScriptedPolicy(chat, ["Hello.", "Again."])
    message = [{"role": "user", "content": "x"}]

    async def main():
        async with PolicyServer(policy, chat) as server, httpx.AsyncClient(timeout=None) as http:
            chat_body = {"messages": message, "stream": None, "logprobs": None}
            chat_answer = await http.post(server.base_url + "/chat/completions", json=chat_body)
            text_body = {"prompt": "x", "stream": None, "echo": None}
            text_answer = await http.post(server.base_url + "/completions", json=text_body)
            return chat_answer, text_answer

    chat_answer, text_answer = asyncio.run(main())
    assert chat_answer.status_code == 200, chat_answer.text
    (choice,) = chat_answer.json()["choices"]
    assert choice["message"]["content"] == "Hello." and choice["logprobs"] is None
    assert text_answer.status_code == 200, text_answer.text
    assert text_answer.json()["choices"][0]["text"] == "Again."


def test_a_missing_field_names_its_param(chat):
    async def main():
        async with (
            PolicyServer(ScriptedPolicy(chat, []), chat) as server,
            httpx.AsyncClient(timeout=None) as http,
        ):
            return await http.post(server.base_url + "/chat/completions", json={"model": "x"})

    response = asyncio.run(main())
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_only_its_own_host_names_are_answered(chat):
    """DNS rebinding: a page elsewhere can reach 127.0.0.1 under a name it controls."""

    async def main():
        async with (
            PolicyServer(ScriptedPolicy(chat, []), chat) as server,
            httpx.AsyncClient(timeout=None) as http,
        ):
            url = server.base_url + "/models"
            return [
                (await http.get(url, headers={"host": host})).status_code
                for host in ("evil.example", "evil.example:80", "127.0.0.1", "localhost:1234", "[::1]:80")
            ]

    assert asyncio.run(main()) == [400, 400, 200, 200, 200]


def test_ending_an_unknown_conversation_is_404_and_records_nothing(chat, tmp_path):
    path = tmp_path / "captures.jsonl"
    writer = RecordingWriter(path, RecordingHeader(tokenizer_fingerprint="t", env_id="toolgym/endpoint"))

    async def main():
        async with (
            PolicyServer(ScriptedPolicy(chat, []), chat, writer=writer) as server,
            httpx.AsyncClient(timeout=None) as http,
        ):
            url = server.base_url.removesuffix("/v1") + "/toolgym/conversations/nobody/end"
            return await http.post(url, json={"reward": 1.0})

    response = asyncio.run(main())
    writer.close()
    assert (
        response.status_code == 404 and "no open conversation 'nobody'" in response.json()["error"]["message"]
    )
    assert read_recording(path)[1] == []


def test_a_huge_message_does_not_stall_other_requests(chat, monkeypatch):
    """Rendering and tokenizing a long message (seconds of work for a multi-megabyte one) runs off
    the event loop, so a small request sent meanwhile is answered while it renders. The big
    message's render is held until the small request is answered: off the loop, that is at once;
    on the loop, which the server shares with this test's client, nothing could be answered until
    the hold gave up (after PATIENCE_S), and the test fails."""
    rendering, answered, released = threading.Event(), threading.Event(), []
    render = Conversation.chat_prompt

    def held_render(self, renderer, messages, tools):
        if sum(len(str(m.get("content") or "")) for m in messages) > RELEASE_GIL_CHARS:
            rendering.set()
            released.append(answered.wait(PATIENCE_S))
        return render(self, renderer, messages, tools)

    monkeypatch.setattr(Conversation, "chat_prompt", held_render)

    async def main():
        async with (
            PolicyServer(ScriptedPolicy(chat, ["ok"] * 4), chat) as server,
            httpx.AsyncClient(timeout=None) as http,
        ):
            huge = {
                "messages": [{"role": "user", "content": "word " * (RELEASE_GIL_CHARS // 4)}],
                "max_tokens": 1,
            }
            big = asyncio.ensure_future(http.post(server.base_url + "/chat/completions", json=huge))
            await until(rendering.is_set, "the big message's render")
            small = await http.get(server.base_url + "/models")
            answered.set()
            return small.status_code, (await big).status_code

    status, big_status = asyncio.run(main())
    assert status == 200 and big_status == 400  # answered: longer than the context
    assert released == [True], "/models was answered only after the big message's render gave up waiting"


def test_the_openai_client_raises_the_errors_with_their_message(chat):
    async def main():
        policy = ScriptedPolicy(chat, [], max_seq_len=64)
        async with PolicyServer(policy, chat) as server:
            c = client(server)
            with pytest.raises(openai.BadRequestError, match="maximum context length is 64") as over:
                await c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "word " * 80}]
                )
            assert over.value.code == "context_length_exceeded"
            with pytest.raises(openai.BadRequestError, match="unrecognized request argument supplied: bogus"):
                await c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}], extra_body={"bogus": 1}
                )
            with pytest.raises(openai.NotFoundError, match="/v1/nothing"):
                await c.get("/nothing", cast_to=object)
            await c.close()

    asyncio.run(main())


CLIENT = textwrap.dedent(
    """
    import sys, openai
    c = openai.OpenAI(base_url=sys.argv[1], api_key="killed", max_retries=0)
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], max_tokens=8000)
    """
)


def test_a_client_killed_mid_generation_frees_its_slot_and_breaks_only_its_capture(chat):
    long_engine = engine(max_batch_size=2, max_seq_len=8192)
    policy = NoStop(long_engine)
    scheduler = long_engine._scheduler

    async def main():
        config = EndpointConfig(max_tokens_per_turn=8000)
        async with PolicyServer(policy, chat, config) as server:  # type: ignore[arg-type]
            proc = subprocess.Popen([sys.executable, "-c", CLIENT, server.base_url])
            try:
                await until(policy.started.is_set, "the client's request", proc)
                await until(lambda: scheduler.slots.running, "its slot to decode", proc)  # admitted
                proc.kill()
            finally:
                proc.wait()
            await until(
                lambda: server.stats.disconnects and not scheduler.slots.running,
                "the disconnect to free the slot",
            )
            assert server.stats.disconnects == 1
            assert not scheduler.slots.running  # the slot is free again, 8000 tokens early
            broken = server.captures.finish("killed", 1.0)
            # Another agent is served as before.
            c = client(server, "alive")
            r = await c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            await c.close()
            return broken, r

    try:
        broken, r = asyncio.run(main())
    finally:
        long_engine.close()
    assert broken.stop_reason == StopReason.TIMEOUT and "ClientDisconnected" in (broken.error or "")
    assert broken.transitions == []
    assert build_episodes([broken], [1.0])[1].dropped_infra == 1
    assert r.usage.completion_tokens == 4


def test_shutdown_with_captures_open_flushes_them_marked_incomplete(chat, tmp_path):
    path = tmp_path / "captures.jsonl"
    writer = RecordingWriter(path, RecordingHeader(tokenizer_fingerprint="t", env_id="toolgym/endpoint"))
    policy = ScriptedPolicy(chat, ["a", "b"])

    async def main():
        server = PolicyServer(policy, chat, writer=writer)
        await server.start()
        for key in ("open-1", "open-2"):
            c = client(server, key)
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": key}])
            await c.close()
        await server.stop()
        return server

    server = asyncio.run(main())
    writer.close()
    _, records = read_recording(path)
    assert sorted(t.env_kwargs["conversation_id"] for t in records) == ["open-1", "open-2"]
    for t in records:
        assert t.metrics[INCOMPLETE] is True and t.stop_reason == StopReason.TIMEOUT
        assert (t.error or "").startswith("IncompleteCapture") and len(t.transitions) == 1
    assert server.captures.incomplete == 2 and not server.captures.open
    assert build_episodes(records, [0.0, 0.0])[0] == []  # never trained on


@pytest.mark.slow
def test_toolgym_serve_serves_a_checkpoint_until_interrupted_and_records_the_captures(tmp_path):
    import signal

    from endpoint_testlib import TOKENIZER, tiny_model

    from toolgym.agents.model.checkpoint import save_hf_checkpoint

    model = tiny_model()
    save_hf_checkpoint(model, model.config, tmp_path / "ckpt", tokenizer_path=TOKENIZER)
    record = tmp_path / "captures.jsonl"
    command = [sys.executable, "-m", "toolgym.configs.cli", "serve", "--policy", str(tmp_path / "ckpt")]
    command += ["--port", "0", "--record", str(record)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and not line.startswith("serving "):
            line = proc.stdout.readline()
        url = line.split(" at ", 1)[1].split()[0]
        c = openai.OpenAI(base_url=url, api_key="cli-conv", max_retries=0, timeout=None)
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens == 3
        c.close()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=PATIENCE_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "1 incomplete" in out
    _, (trajectory,) = read_recording(record)
    assert trajectory.env_kwargs == {"conversation_id": "cli-conv"} and trajectory.metrics[INCOMPLETE]
