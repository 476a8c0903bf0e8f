"""The endpoint teacher of on-policy distillation and the endpoint's `prompt_logprobs`: through
the official client, each prompt position's logprob (and top-k, ranks) is the float32 model's;
an endpoint teacher over `toolgym serve` gives the checkpoint teacher's per-token log-ratios on a
recorded episode; an endpoint without prompt logprobs, or with another tokenizer, is refused in
one line; and a server that goes away makes its groups scoring failures that stop the run at the
limit. The servers are real (in process, or `toolgym serve` as a process) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import copy
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import torch
from endpoint_testlib import TOKENIZER, engine, renderer, tiny_model
from serve_testlib import toolgym_serve

from toolgym.agents.model.checkpoint import save_hf_checkpoint
from toolgym.agents.model.transformer import causal_lm_logprobs
from toolgym.agents.tokenizer import tokenizer_fingerprint
from toolgym.agents.types import Completion, Message
from toolgym.rollouts.endpoint import PolicyServer
from toolgym.rollouts.endpoint.prompt_logprobs import PromptScorer
from toolgym.rollouts.recording.format import RecordingHeader, RecordingWriter, read_recording
from toolgym.rollouts.scoring.distill import (
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
    DistillConfig,
    teacher_log_ratios,
)
from toolgym.rollouts.scoring.endpoint_teacher import EndpointTeacher
from toolgym.rollouts.scoring.teacher import Teacher, TeacherError
from toolgym.rollouts.types import CONTEXT_REWRITE, SEQUENCE_START, StopReason, Trajectory, Transition


def checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model = tiny_model(seed=3)
    return save_hf_checkpoint(model, model.config, tmp_path / "ckpt", tokenizer_path=TOKENIZER), model


def test_prompt_logprobs_through_the_openai_client_are_the_float32_models(tmp_path):
    directory, model = checkpoint(tmp_path)
    chat = renderer()
    scorer = PromptScorer(directory, lambda t: chat.decode([t]))
    prompt = [*chat.render_prompt([Message("user", "how many apples are left?")]), *chat.encode("three")]
    with torch.no_grad():
        expected = causal_lm_logprobs(model, torch.tensor([prompt]))[0].tolist()
        log_softmax = torch.log_softmax(model(torch.tensor([prompt]))[0, :-1].float(), dim=-1)

    async def main():
        async with PolicyServer(engine(), chat, scorer=scorer) as server:
            c = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            models = await c.models.list()
            card = models.data[0].model_extra or {}
            only = await c.completions.create(
                model="m", prompt=prompt, max_tokens=0, extra_body={"prompt_logprobs": 2}
            )
            sampled = await c.completions.create(
                model="m", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0}
            )
            async with PolicyServer(engine(), chat) as plain:  # no checkpoint to score with
                p = openai.AsyncOpenAI(base_url=plain.base_url, api_key="x", max_retries=0)
                with pytest.raises(openai.BadRequestError) as refused:
                    await p.completions.create(
                        model="m", prompt=prompt, max_tokens=0, extra_body={"prompt_logprobs": 0}
                    )
                await p.close()
            # an id the padded embedding has and the tokenizer lacks is scored; one past the model's is not
            padded = await c.completions.create(
                model="m", prompt=[*prompt, 1010], max_tokens=0, extra_body={"prompt_logprobs": 0}
            )
            assert "1010" in (padded.choices[0].model_extra or {})["prompt_logprobs"][-1]
            with pytest.raises(openai.BadRequestError, match="token id 1030 is outside"):
                await c.completions.create(
                    model="m", prompt=[*prompt, 1030], max_tokens=0, extra_body={"prompt_logprobs": 0}
                )
            with pytest.raises(openai.BadRequestError, match="prompt_logprobs must be between 0 and 20"):
                await c.completions.create(
                    model="m", prompt=prompt, max_tokens=0, extra_body={"prompt_logprobs": -1}
                )
            await c.close()
            return card, only, sampled, refused.value

    card, only, sampled, refused = asyncio.run(main())
    assert card["toolgym"] == {"tokenizer_fingerprint": tokenizer_fingerprint(chat.tokenizer)}
    choice = only.choices[0]
    assert only.usage is not None and sampled.usage is not None
    got = (choice.model_extra or {})["prompt_logprobs"]
    assert choice.text == "" and only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(prompt)
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        entry, row = got[p], log_softmax[p - 1]
        own = entry[str(prompt[p])]
        assert own["logprob"] == pytest.approx(expected[p - 1], abs=1e-5)
        assert own["rank"] == int((row > row[prompt[p]]).sum()) + 1
        assert own["decoded_token"] == chat.decode([prompt[p]])
        best = row.topk(2)
        for j, (value, token) in enumerate(zip(best.values.tolist(), best.indices.tolist(), strict=True)):
            assert entry[str(token)]["rank"] == j + 1
            assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-5)
        assert len(entry) == 2 + (own["rank"] > 2)  # the prompt's own token, and the top 2
    # max_tokens 1: a sampled token and the same prompt logprobs (k = 0: the prompt's tokens only)
    scored = (sampled.choices[0].model_extra or {})["prompt_logprobs"]
    assert sampled.usage.completion_tokens == 1 and all(len(e) == 1 for e in scored[1:])
    assert [e[str(t)]["logprob"] for e, t in zip(scored[1:], prompt[1:], strict=True)] == pytest.approx(
        expected, abs=1e-5
    )
    assert refused.status_code == 400 and "prompt_logprobs is not supported" in str(refused)


def recorded_episodes(tmp_path: Path) -> list[Trajectory]:
    """Two episodes of chat tokens (one with a context rewrite: a training sequence of its own),
    written to a recording and read back."""
    chat = renderer()

    def turn(obs: str, act: str, restart: bool = False) -> Transition:
        tokens = [*chat.encode(act), chat.im_end_id]
        info = {SEQUENCE_START: True, CONTEXT_REWRITE: True} if restart else {}
        prompt = chat.render_prompt([Message("user", obs)])
        return Transition(obs, prompt, Completion(tokens, [-1.5] * len(tokens), "stop", act), info=info)

    episodes = [
        Trajectory(
            env_id="test", env_kwargs={}, task_seed=1, group_id=0, sample_index=0,
            transitions=[
                turn("list the files", "ls -la"),
                turn("now count them", "there are 4"),
                turn("notes: 4 files; what next?", "done", restart=True),
            ],
            stop_reason=StopReason.ANSWERED, total_reward=1.0,
        ),
        Trajectory(
            env_id="test", env_kwargs={}, task_seed=1, group_id=0, sample_index=1,
            transitions=[turn("list the files", "I cannot")],
            stop_reason=StopReason.ANSWERED, total_reward=0.0,
        ),
    ]  # fmt: skip
    path = tmp_path / "episodes.jsonl"
    header = RecordingHeader(tokenizer_fingerprint=tokenizer_fingerprint(chat.tokenizer), env_id="test")
    writer = RecordingWriter(path, header)
    for episode in episodes:
        writer.write(episode)
    writer.close()
    return read_recording(path)[1]


@pytest.mark.slow
def test_an_endpoint_teacher_over_toolgym_serve_gives_the_checkpoint_teachers_log_ratios(tmp_path):
    directory, _ = checkpoint(tmp_path)
    student = tokenizer_fingerprint(renderer().tokenizer)
    group = recorded_episodes(tmp_path)
    by_checkpoint, by_endpoint = copy.deepcopy(group), copy.deepcopy(group)
    local = Teacher(DistillConfig(teacher=str(directory), top_k=3), student_fingerprint=student)
    assert local.annotate(by_checkpoint) is None
    with toolgym_serve(directory) as url:
        config = DistillConfig(teacher=url, max_consecutive_failures=2, teacher_timeout_s=60, top_k=3)
        remote = EndpointTeacher(config, student_fingerprint=student)
        assert remote.fingerprint == student and "the student's" in remote.describe()
        assert remote.annotate(by_endpoint) is None
        with pytest.raises(TeacherError) as other:  # the served tokenizer is not this student's
            EndpointTeacher(config, student_fingerprint="f" * 64)
        message = str(other.value)
        assert (
            "\n" not in message
            and url in message
            and "ffffffffffffffff" in message
            and student[:16] in message
        )
        with pytest.raises(TeacherError, match=r"does not serve distill\.teacher_model 'nope'"):
            EndpointTeacher(DistillConfig(teacher=url, teacher_model="nope"), student_fingerprint=student)
        with pytest.raises(TeacherError, match=r"temperature 1 and the policy samples at 0\.7"):
            EndpointTeacher(config, student_fingerprint=student, temperature=0.7)
    for a, b in zip(by_checkpoint, by_endpoint, strict=True):
        ratios_a, ratios_b = teacher_log_ratios(a), teacher_log_ratios(b)
        assert [len(t) for t in ratios_a] == [len(t.action.tokens) for t in a.transitions]
        assert [x for t in ratios_b for x in t] == pytest.approx([x for t in ratios_a for x in t], abs=1e-5)
        for ta, tb in zip(a.transitions, b.transitions, strict=True):  # and the same top-k
            assert tb.info[TEACHER_TOPK_IDS] == ta.info[TEACHER_TOPK_IDS]
            assert len(ta.info[TEACHER_TOPK_IDS]) == len(ta.action.tokens)
            assert [x for row in tb.info[TEACHER_TOPK_LOGPROBS] for x in row] == pytest.approx(
                [x for row in ta.info[TEACHER_TOPK_LOGPROBS] for x in row], abs=1e-5
            )
    # the server has stopped: connection errors are scoring failures, counted, then the run stops
    again = copy.deepcopy(group)
    cause = remote.annotate(again)
    assert cause is not None and url in cause and remote.failures == 1
    assert not any(
        key in t.info for e in again for t in e.transitions for key in ("teacher_logprobs", TEACHER_TOPK_IDS)
    )
    with pytest.raises(
        TeacherError, match=r"failed 2 groups in a row \(distill.max_consecutive_failures = 2\)"
    ):
        remote.annotate(again)


@contextmanager
def server_in_a_thread() -> Iterator[str]:
    """An in-process endpoint with no checkpoint to score with, on a thread of its own (the
    teacher's requests block the calling thread)."""
    ready: list[str] = []
    started, stop = threading.Event(), threading.Event()

    async def main() -> None:
        async with PolicyServer(engine(), renderer()) as server:
            ready.append(server.base_url)
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.01)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    started.wait()
    try:
        yield ready[0]
    finally:
        stop.set()
        thread.join()


def test_an_endpoint_without_prompt_logprobs_or_unreachable_is_refused_in_one_line(tmp_path):
    student = tokenizer_fingerprint(renderer().tokenizer)
    with server_in_a_thread() as url, pytest.raises(TeacherError) as info:
        EndpointTeacher(DistillConfig(teacher=url), student_fingerprint=student)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"distill.teacher {url} returns no prompt logprobs")
    assert "`prompt_logprobs`" in message
    with pytest.raises(TeacherError, match=re.escape(f"distill.teacher {url}: cannot list its models")):
        EndpointTeacher(DistillConfig(teacher=url), student_fingerprint=student)  # gone now


def test_the_endpoint_settings_are_checked():
    assert DistillConfig(teacher="http://127.0.0.1:8000/v1").endpoint
    assert not DistillConfig(teacher="runs/x/final_model").endpoint
    with pytest.raises(ValueError, match=r"distill\.teacher_model names an endpoint's model"):
        DistillConfig(teacher="runs/x/final_model", teacher_model="m")
    with pytest.raises(ValueError, match="teacher_timeout_s must be a finite number > 0"):
        DistillConfig(teacher="http://h/v1", teacher_timeout_s=0.0)
