"""The recording as a published trace format and its tools: the checked-in JSON Schema, and export
to / import from OpenAI chat-messages JSONL (library calls and the `toolgym export|import` commands)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recording_testlib import play, shipped_renderer, write

from toolgym.configs.cli.main import main
from toolgym.rollouts.recording.chat_jsonl import (
    IMPORT_ENV_ID,
    chat_record,
    chat_trajectory,
    export_chat_jsonl,
    import_chat_jsonl,
)
from toolgym.rollouts.recording.format import read_recording
from toolgym.rollouts.recording.replay import episodes_from_trajectories, verify_tokens, verify_trajectory
from toolgym.rollouts.recording.schema import schema_filename, schema_text, trace_schema

ROOT = Path(__file__).resolve().parents[3]
ZORPLEX = "toolgym/Zorplex-v0"
SHOP = "toolgym/Shop-v0"


@pytest.fixture(scope="module")
def zorplex(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("traces") / "zorplex.jsonl"
    return write(path, play(ZORPLEX, list(range(6)), env_kwargs={"tier": "simple"}), ZORPLEX, {"tier": "simple"})


@pytest.fixture(scope="module")
def shop(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("traces") / "shop.jsonl"
    return write(path, play(SHOP, list(range(4))), SHOP)


# ---- the schema ---------------------------------------------------------------------------------


def test_checked_in_schema_is_generated_from_the_structs():
    path = ROOT / "docs" / schema_filename()
    assert path.read_text() == schema_text(), (
        f"{path} is stale: regenerate it with `python -m toolgym.rollouts.recording.schema docs/`"
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
        assert messages[-1]["role"] == "assistant" and messages[-1]["content"] == t.transitions[-1].action.text
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


def test_a_bracket_env_round_trips_with_its_prompt_and_metadata(zorplex, tmp_path):
    chat = tmp_path / "chat.jsonl"
    with chat.open("w") as f:
        report = export_chat_jsonl(zorplex, f)
    assert report.with_tools == 0  # a bracket env's tools are taught by its own prompt
    records = [json.loads(line) for line in chat.read_text().splitlines()]
    assert all("tools" not in r for r in records)
    imported = list(import_chat_jsonl(chat, shipped_renderer()))
    _, recorded = read_recording(zorplex)
    assert len(imported) == len(recorded)
    for t, original in zip(imported, recorded, strict=True):
        assert t.system_prompt == original.system_prompt and "<tools>" not in t.system_prompt
        assert "LOOKUP[word]" in t.system_prompt
        assert (t.task_seed, t.group_id, t.sample_index, t.policy_version, t.stop_reason) == (
            original.task_seed, original.group_id, original.sample_index, original.policy_version, original.stop_reason
        )
        assert t.total_reward == pytest.approx(original.total_reward)
        assert sum(tr.reward for tr in t.transitions) == pytest.approx(t.total_reward)
        assert t.reward_components == pytest.approx(original.reward_components)
        assert t.metrics["failure_mode"] == original.metrics["failure_mode"]
        assert t.metrics["env"] == pytest.approx(original.metrics["env"])
        assert t.metrics["source_env"] == {"env_id": ZORPLEX, "env_kwargs": {"tier": "simple"}}
        assert t.env_id == IMPORT_ENV_ID and t.metrics["token_exact"] is False
        assert t.final_observation == original.final_observation
    # what SFT's only_successful reads came along: the same episodes are kept
    kept, _ = episodes_from_trajectories(imported, only_successful=True)
    assert len(kept) == len(episodes_from_trajectories(recorded, only_successful=True)[0]) > 0


def test_import_renders_tool_calls_and_refuses_two_assistant_turns_in_a_row():
    renderer = shipped_renderer()
    record = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "2 pens?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "price", "arguments": '{"item": "pen"}'}}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "3.5"},
            {"role": "assistant", "content": "3.5"},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [{"type": "function", "function": {"name": "price", "parameters": {}}}],
    }
    t = chat_trajectory(record, renderer, 7)
    assert t.task_seed == 7 and t.system_prompt.startswith("Be brief.") and "<tools>" in t.system_prompt
    assert t.transitions[0].action.text == '<tool_call>\n{"name": "price", "arguments": {"item": "pen"}}\n</tool_call>'
    assert t.transitions[1].observation == "3.5" and t.final_observation == "thanks"
    assert t.transitions[0].action.tokens[-1] == renderer.im_end_id
    bad = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]}
    with pytest.raises(ValueError, match="two assistant"):
        chat_trajectory(bad, renderer, 0)


def test_cli_export_import_and_sft_reads_the_result(shop, tmp_path, capsys):
    chat, demos = tmp_path / "c.jsonl", tmp_path / "demos.jsonl"
    assert main(["export", str(shop), "--out", str(chat)]) == 0
    assert "with tools" in capsys.readouterr().out
    assert main(["import", str(chat), "--out", str(demos)]) == 0
    header, trajectories = read_recording(demos)
    assert header.extra["token_exact"] is False and len(trajectories) == len(chat.read_text().splitlines())
    from toolgym.configs.assembly.demos import demo_episodes
    from toolgym.configs.load import load_config

    config, _ = load_config(None, ["sft.enabled=true", 'sft.source="recording"', f'sft.recording="{demos}"'])
    episodes, metrics, source = demo_episodes(config, shipped_renderer(), max_seq_len=4096)
    assert len(episodes) == len(trajectories) and str(demos) in source
    assert metrics["sft_data/episodes_built"] == len(trajectories)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"messages": []}\n')
    assert main(["import", str(empty), "--out", str(tmp_path / "none.jsonl")]) == 1
    assert "no line" in capsys.readouterr().err
