"""The trace format and its tools without a browser: the viewer's index (rows, filters, sorting,
pages, damaged and foreign files, the per-token view), the comparison by task seed, the JSON API,
the checked-in JSON Schema, and export to / import from OpenAI chat-messages JSONL."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
from traces_testlib import play, shipped_renderer, write

from toolgym.configs.cli import main
from toolgym.rollouts.episodes import trajectory_to_episodes
from toolgym.rollouts.recording import read_recording
from toolgym.rollouts.replay import episodes_from_trajectories, verify_tokens, verify_trajectory
from toolgym.rollouts.scripted import OracleConfig
from toolgym.rollouts.traces.chat_jsonl import (
    IMPORT_ENV_ID,
    chat_record,
    chat_trajectory,
    export_chat_jsonl,
    import_chat_jsonl,
)
from toolgym.rollouts.traces.index import RecordingIndex, compare, token_texts
from toolgym.rollouts.traces.schema import schema_filename, schema_text, trace_schema
from toolgym.rollouts.traces.server import ViewerData, ViewerServer

ROOT = Path(__file__).resolve().parents[2]
ZORPLEX = "toolgym/Zorplex-v0"
SHOP = "toolgym/Shop-v0"


@pytest.fixture(scope="module")
def zorplex(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("traces") / "zorplex.jsonl"
    return write(
        path, play(ZORPLEX, list(range(6)), env_kwargs={"tier": "simple"}), ZORPLEX, {"tier": "simple"}
    )


@pytest.fixture(scope="module")
def shop(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("traces") / "shop.jsonl"
    return write(path, play(SHOP, list(range(4))), SHOP)


# ---- index --------------------------------------------------------------------------------------


def test_index_rows_match_the_recording(zorplex):
    _, trajectories = read_recording(zorplex)
    index = RecordingIndex(zorplex)
    assert index.problems == [] and index.skipped == 0
    assert len(index.rows) == len(trajectories) == 12
    for row, t in zip(index.rows, trajectories, strict=True):
        assert (row["seed"], row["group"], row["sample"], row["stop"]) == (
            t.task_seed,
            t.group_id,
            t.sample_index,
            t.stop_reason.value,
        )
        assert row["reward"] == pytest.approx(t.total_reward)
        assert row["tokens"] == sum(len(tr.action.tokens) for tr in t.transitions)
        assert row["failure"] == t.metrics["failure_mode"]
    # GRPO advantages within each group: they sum to zero per group
    for group in {r["group"] for r in index.rows}:
        assert sum(r["adv"] for r in index.rows if r["group"] == group) == pytest.approx(0.0, abs=1e-6)


def test_filters_sorting_and_pages(zorplex):
    index = RecordingIndex(zorplex)
    failures = index.facets()["failure"]
    assert len(failures) >= 2  # p_omit_tag=0.5: success and wrong_format
    page = index.query({"failure": failures[0]})
    assert page["total"] == sum(r["failure"] == failures[0] for r in index.rows) < len(index.rows)
    assert all(r["failure"] == failures[0] for r in page["rows"])
    assert [r["seed"] for r in index.query({"seed": "3"})["rows"]] == [3, 3]
    rewards = [r["reward"] for r in index.query({"sort": "reward", "desc": "1"})["rows"]]
    assert rewards == sorted(rewards, reverse=True)
    high = max(rewards)
    assert all(r["reward"] >= high for r in index.query({"rmin": str(high)})["rows"])
    assert index.query({"version": "7"})["total"] == 0
    second = index.query({"offset": "5", "limit": "5"})
    assert [r["i"] for r in second["rows"]] == [5, 6, 7, 8, 9] and second["total"] == 12
    with pytest.raises(ValueError, match="sort"):
        index.query({"sort": "bogus"})


def test_episode_stream_is_what_training_reads(zorplex):
    index = RecordingIndex(zorplex)
    _, trajectories = read_recording(zorplex)
    renderer = shipped_renderer()
    for i in (0, 5):
        ep = index.episode(i, renderer)
        (built,) = trajectory_to_episodes(trajectories[i], index.rows[i]["adv"])
        s = ep["stream"]
        assert s["id"] == built.tokens and s["mask"] == built.loss_mask and s["adv"] == built.advantages
        assert s["logprob"] == pytest.approx(built.sampler_logprobs)
        assert "".join(s["text"]) == renderer.decode(built.tokens)
        assert len(s["turn"]) == len(s["pv"]) == len(s["id"])
        assert ep["notice"] is None and len(ep["turn_list"]) == len(trajectories[i].transitions)
    with pytest.raises(IndexError):
        index.episode(99, renderer)


def test_token_texts_keep_a_split_character_whole():
    renderer = shipped_renderer()
    ids = renderer.encode("price of 🦜 and é ok")
    pieces = token_texts(renderer, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == renderer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_damaged_torn_and_foreign_files_show_what_they_could_read(zorplex, tmp_path):
    lines = zorplex.read_bytes().splitlines(keepends=True)
    damaged = tmp_path / "damaged.jsonl"
    flipped = lines[3].replace(b'"task_seed":', b'"task_seed":9', 1)
    damaged.write_bytes(b"".join([*lines[:3], flipped, *lines[4:], lines[5][:40]]))
    index = RecordingIndex(damaged)
    assert len(index.rows) == len(lines) - 2 and index.skipped == 2
    assert any("line 4 is corrupt" in p and "checksum" in p for p in index.problems)
    assert any("torn" in p for p in index.problems)

    headless = tmp_path / "headless.jsonl"  # header damaged: the records still read
    headless.write_bytes(
        lines[0].replace(b"toolgym.trajectories", b"toolgym.trajectorieX") + b"".join(lines[1:])
    )
    index = RecordingIndex(headless)
    assert index.header is None and len(index.rows) == len(lines) - 1
    assert "line 1" in index.problems[0]

    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("hello\n" + "".join(f'{{"x": {i}}}\n' for i in range(300)))
    index = RecordingIndex(foreign)
    assert index.rows == [] and index.skipped == 300
    assert len(index.problems) == 101  # the first 100 problems, then one line saying there are more
    assert index.problems[-1].startswith("more lines were skipped")
    assert index.summary()["episodes"] == 0

    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert RecordingIndex(empty).problems == ["empty file: not a toolgym recording"]


def test_compare_aligns_by_task_seed(tmp_path):
    a = write(tmp_path / "a.jsonl", play(ZORPLEX, [0, 1, 2, 3], group_size=1), ZORPLEX)
    b_trajectories = play(
        ZORPLEX, [2, 3, 4], group_size=1, oracle=OracleConfig(p_omit_tag=1.0), policy_version=5
    )
    b = write(tmp_path / "b.jsonl", b_trajectories, ZORPLEX)
    result = compare(RecordingIndex(a), RecordingIndex(b), {})
    assert (result["common"], result["only_a"], result["only_b"], result["total"]) == (2, 2, 1, 5)
    assert [r["seed"] for r in result["rows"]] == [0, 1, 2, 3, 4]
    by_seed = {r["seed"]: r for r in result["rows"]}
    assert by_seed[0]["b"] is None and by_seed[4]["a"] is None
    for seed in (2, 3):
        ia, ib = by_seed[seed]["a"]["i"], by_seed[seed]["b"]["i"]
        assert RecordingIndex(a).rows[ia]["seed"] == RecordingIndex(b).rows[ib]["seed"] == seed
        assert by_seed[seed]["b"]["version"] == 5


def test_api_answers_and_refuses(zorplex, tmp_path):
    data = ViewerData([zorplex, tmp_path / "missing.jsonl"], shipped_renderer())
    with ViewerServer(data) as server:

        def get(route: str):
            try:
                with urllib.request.urlopen(server.url + route) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        status, body = get("api/recordings")
        assert status == 200 and [r["label"] for r in body["recordings"]] == [
            "zorplex.jsonl",
            "missing.jsonl",
        ]
        assert body["charts_kind"] == "recordings" and body["charts"]["reward"][0]["points"]
        assert get("api/episodes?r=0&limit=3")[1]["rows"][2]["i"] == 2
        assert get("api/episode?r=0&i=1")[1]["stream"]["mask"]
        assert get("api/recording?r=1")[1]["problems"][0].startswith("cannot read")
        assert get("api/episode?r=0&i=999")[0] == 404
        assert get("api/episodes?r=zero")[0] == 400
        assert get("api/nothing")[0] == 404
        with urllib.request.urlopen(server.url) as response:
            assert b"viewer.js" in response.read()
        with urllib.request.urlopen(server.url + "static/viewer.js") as response:
            assert b"fetch(" in response.read()
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(server.url + "static/..%2Fserver.py")


# ---- the schema ---------------------------------------------------------------------------------


def test_checked_in_schema_is_generated_from_the_structs():
    path = ROOT / "docs" / schema_filename()
    assert path.read_text() == schema_text(), (
        f"{path} is stale: regenerate it with `python -m toolgym.rollouts.traces.schema docs/`"
    )


def test_schema_validates_recordings_and_rejects_bad_lines(zorplex):
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(trace_schema())
    lines = [json.loads(line) for line in zorplex.read_text().splitlines()]
    for line in lines:
        assert not list(validator.iter_errors(line))
    nan_reward = {**lines[1], "total_reward": "nan"}
    assert validator.is_valid(nan_reward)
    assert not validator.is_valid({**lines[1], "stop_reason": "bored"})
    assert not validator.is_valid({**lines[1], "crc32": "xyz"})
    assert not validator.is_valid({**lines[0], "format": "other"})


# ---- export and import --------------------------------------------------------------------------


def test_export_writes_tools_and_tool_calls_for_json_envs(shop, tmp_path):
    out = tmp_path / "shop.chat.jsonl"
    with out.open("w") as f:
        report = export_chat_jsonl(shop, f)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    _, trajectories = read_recording(shop)
    assert report.episodes == len(records) == len(trajectories) and report.problems == []
    for record, t in zip(records, trajectories, strict=True):
        assert record["tools"][0]["function"]["name"] == "price"
        messages = record["messages"]
        assert messages[0]["role"] == "system" and "<tools>" not in messages[0]["content"]
        assert messages[1] == {"role": "user", "content": t.transitions[0].observation}
        calls = [m for m in messages if m.get("tool_calls")]
        assert calls, "the oracle calls price() first"
        call = calls[0]["tool_calls"][0]
        assert call["function"]["name"] == "price" and set(json.loads(call["function"]["arguments"])) == {
            "item",
            "quantity",
        }
        tool_messages = [m for m in messages if m["role"] == "tool"]
        assert tool_messages[0]["tool_call_id"] == call["id"]
        assert tool_messages[0]["content"] == t.transitions[0].info["tool_results"][0]
        assert (
            messages[-1]["role"] == "assistant" and messages[-1]["content"] == t.transitions[-1].action.text
        )
        assert record["metadata"]["task_seed"] == t.task_seed


def test_export_of_a_bracket_env_keeps_the_text(zorplex, tmp_path):
    _, trajectories = read_recording(zorplex)
    record = chat_record(trajectories[0])
    roles = [m["role"] for m in record["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert "tools" not in record and all("tool_calls" not in m for m in record["messages"])
    assert record["messages"][2]["content"] == trajectories[0].transitions[0].action.text
    assert chat_record(trajectories[0], observation_role="tool")["messages"][3]["role"] == "tool"
    assert "metadata" not in chat_record(trajectories[0], metadata=False)


def test_import_round_trip_is_sft_data(shop, tmp_path):
    chat = tmp_path / "chat.jsonl"
    with chat.open("w") as f:
        export_chat_jsonl(shop, f)
    with chat.open("a") as f:
        f.write("not json\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}) + "\n")
    renderer = shipped_renderer()
    problems: list[str] = []
    imported = list(import_chat_jsonl(chat, renderer, problems))
    _, recorded = read_recording(shop)
    assert len(imported) == len(recorded) and len(problems) == 3
    assert "line 9" in problems[0] and "no assistant message" in problems[1] and "not text" in problems[2]
    for t, original in zip(imported, recorded, strict=True):
        assert t.env_id == IMPORT_ENV_ID and t.metrics["token_exact"] is False
        assert [tr.action.text.strip() for tr in t.transitions] == [
            tr.action.text.strip() for tr in original.transitions
        ]
        assert verify_tokens(t, renderer) == []  # tokens agree with the text under ChatML
        assert verify_trajectory(t)  # but no env can re-run it: never reported as verified
    episodes, stats = episodes_from_trajectories(imported)
    assert stats.built == len(imported) and all(sum(e.loss_mask) > 0 for e in episodes)


def test_import_renders_tool_calls_and_refuses_two_assistant_turns_in_a_row():
    renderer = shipped_renderer()
    record = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "2 pens?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "price", "arguments": '{"item": "pen"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "3.5"},
            {"role": "assistant", "content": "3.5"},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [{"type": "function", "function": {"name": "price", "parameters": {}}}],
    }
    t = chat_trajectory(record, renderer, 7)
    assert t.task_seed == 7 and t.system_prompt.startswith("Be brief.") and "<tools>" in t.system_prompt
    assert (
        t.transitions[0].action.text
        == '<tool_call>\n{"name": "price", "arguments": {"item": "pen"}}\n</tool_call>'
    )
    assert t.transitions[1].observation == "3.5" and t.final_observation == "thanks"
    assert t.transitions[0].action.tokens[-1] == renderer.im_end_id
    bad = {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "a"},
            {"role": "assistant", "content": "b"},
        ]
    }
    with pytest.raises(ValueError, match="two assistant"):
        chat_trajectory(bad, renderer, 0)


def test_cli_export_import_and_sft_reads_the_result(shop, tmp_path, capsys):
    chat, demos = tmp_path / "c.jsonl", tmp_path / "demos.jsonl"
    assert main(["export", str(shop), "--out", str(chat)]) == 0
    assert "with tools" in capsys.readouterr().out
    assert main(["import", str(chat), "--out", str(demos)]) == 0
    header, trajectories = read_recording(demos)
    assert header.extra["token_exact"] is False and len(trajectories) == len(chat.read_text().splitlines())
    from toolgym.configs.build.demos import demo_episodes
    from toolgym.configs.load import load_config

    config, _ = load_config(None, ["sft.enabled=true", 'sft.source="recording"', f'sft.recording="{demos}"'])
    episodes, metrics, source = demo_episodes(config, shipped_renderer(), max_seq_len=4096)
    assert len(episodes) == len(trajectories) and str(demos) in source
    assert metrics["sft_data/episodes_built"] == len(trajectories)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"messages": []}\n')
    assert main(["import", str(empty), "--out", str(tmp_path / "none.jsonl")]) == 1
    assert "no line" in capsys.readouterr().err


def test_view_of_a_missing_path_is_a_one_line_error(tmp_path, capsys):
    assert main(["view", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such recording" in capsys.readouterr().err


def test_view_sources_of_a_run_directory(tmp_path, zorplex):
    from toolgym.configs.cli import _view_sources

    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    for name in ("train_rank0.jsonl", "eval_step_00000010.jsonl", "eval_step_00000000.jsonl"):
        (run / "trajectories" / name).write_bytes(zorplex.read_bytes())
    (run / "metrics.jsonl").write_text(
        json.dumps({"kind": "train", "step": 1, "rollout/reward_mean": 0.5})
        + "\n"
        + json.dumps({"kind": "eval", "step": 0, "eval/reward_mean": 0.25, "eval/accuracy": 1.0})
        + "\n"
    )
    recordings, metrics, tokenizer = _view_sources([str(run)])
    assert [p.name for p in recordings] == [
        "eval_step_00000000.jsonl",
        "eval_step_00000010.jsonl",
        "train_rank0.jsonl",
    ]
    assert metrics is not None and len(metrics) == 2 and tokenizer is None
    charts = ViewerData(recordings, None, metrics).recordings()["charts"]
    assert charts["reward"] == [
        {"name": "train", "points": [[1, 0.5]]},
        {"name": "eval", "points": [[0, 0.25]]},
    ]
    assert charts["accuracy"] == [{"name": "eval", "points": [[0, 1.0]]}]
    with pytest.raises(ValueError, match="no recordings"):
        _view_sources([str(tmp_path)])
    assert msgspec.json.decode(msgspec.json.encode(charts))  # JSON-safe
