"""Recordings remember their chat template: the header keeps the template's text, `replay` rebuilds
the same renderer from it (plain ChatML when the header has none), and `replay --verify` checks a
templated episode's token stream turn by turn, restarts (`sequence_start`) included."""

import json

import msgspec
import numpy as np
import pytest
from chat_templates_testlib import QWEN3_LIKE, QWEN3_NO_TOOLS, SHIPPED_TOKENIZER
from tokenizers import Tokenizer

from toolgym.agents.chat import ChatRenderer
from toolgym.agents.chat_template import ChatTemplate, TemplateRenderer
from toolgym.agents.tokenizer import tokenizer_fingerprint
from toolgym.configs.cli.main import main
from toolgym.configs.load import SHIPPED_CHAT_TEMPLATES, ConfigError, load_config
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.recording.format import (
    CHAT_TEMPLATE,
    RecordingError,
    RecordingHeader,
    RecordingReader,
    RecordingWriter,
    chat_template_entry,
    read_recording,
)
from toolgym.rollouts.recording.replay import recorded_renderer, verify_tokens, verify_trajectories
from toolgym.rollouts.scripted import OracleConfig, OraclePolicy, ScriptedEpisodePolicy, plan_actions
from toolgym.rollouts.types import SEQUENCE_START, StopReason

QWEN25_STYLE = SHIPPED_CHAT_TEMPLATES / "qwen2.5-style.jinja"
TOKENIZER = str(SHIPPED_TOKENIZER)


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER)


def record_cli(tmp_path, env_id, env_kwargs, chat_template="qwen2.5-style", tasks=3):
    out = tmp_path / f"{env_id.split('/')[-1]}-{len(list(tmp_path.iterdir()))}.jsonl"
    args = ["record", "--env", env_id, "--env-kwargs", json.dumps(env_kwargs), "--tasks", str(tasks)]
    args += ["--group-size", "2", "--out", str(out), "--no-progress"]
    if chat_template:
        args += ["--chat-template", chat_template]
    assert main(args) == 0
    return out


def replay_verify(path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["replay", str(path), "--verify", "--summary-only", "--tokenizer", TOKENIZER])
    return code, capsys.readouterr().out


def rewrite(path, out, change):
    """`path`'s header and records into `out`, each record through `change` (a Trajectory -> one)."""
    header, trajectories = read_recording(path)
    with RecordingWriter(out, header) as writer:
        writer.write_all(change(t) for t in trajectories)
    return out


@pytest.mark.parametrize(
    ("env_id", "env_kwargs"),
    [("toolgym/Shop-v0", {}), ("toolgym/Zorplex-v0", {"tool_format": "json"})],
    ids=["shop", "zorplex_json"],
)
def test_a_templated_cli_recording_verifies_exactly(tmp_path, capsys, shipped, env_id, env_kwargs):
    path = record_cli(tmp_path, env_id, env_kwargs)
    header, trajectories = read_recording(path)
    entry = header.extra[CHAT_TEMPLATE]
    assert entry["text"] == QWEN25_STYLE.read_text() and entry["source"] == str(QWEN25_STYLE)
    assert entry["special_tokens"] == {} and entry["template_kwargs"] == {}
    renderer = recorded_renderer(header, shipped)
    assert isinstance(renderer, TemplateRenderer) and renderer.renders_tools
    assert all(t.stop_reason == StopReason.ANSWERED for t in trajectories)
    assert all(t.reset_info["tools"] and "instructions" in t.reset_info for t in trajectories)
    assert any(len(t.transitions) > 1 for t in trajectories)  # tool turns, rendered as <tool_response>s
    assert any("tool_results" in tr.info for t in trajectories for tr in t.transitions)
    code, out = replay_verify(path, capsys)
    assert code == 0, out
    assert f"verify: {len(trajectories)}/{len(trajectories)} episodes replay exactly" in out
    assert f"chat template {QWEN25_STYLE}" in out
    assert verify_trajectories(trajectories, renderer) == []
    # plain ChatML does not explain these tokens: the header's template is what makes them exact
    assert all(verify_tokens(t, ChatRenderer(shipped)) for t in trajectories)

    # transcripts decode through the rebuilt renderer
    capsys.readouterr()
    assert main(["replay", str(path), "--limit", "1", "--tokenizer", TOKENIZER]) == 0
    assert "<tool_response>" in capsys.readouterr().out


def test_a_tampered_token_in_a_templated_recording_is_reported(tmp_path, capsys, shipped):
    path = record_cli(tmp_path, "toolgym/Shop-v0", {}, tasks=2)
    _, trajectories = read_recording(path)
    victim = next(i for i, t in enumerate(trajectories) if len(t.transitions) > 1)

    def bump(index, turn, position):
        key = (trajectories[index].task_seed, trajectories[index].sample_index)

        def change(t):
            if (t.task_seed, t.sample_index) == key:
                t.transitions[turn].observation_tokens[position] += 1
            return t

        return change

    for turn, position, problem in [
        (1, 3, "turn 1: observation tokens are not the rendered env reply"),
        (0, 5, "turn 0: observation tokens are not the rendered prompt"),
    ]:
        bad = rewrite(path, tmp_path / f"bad{turn}.jsonl", bump(victim, turn, position))
        code, out = replay_verify(bad, capsys)
        assert code == 1
        assert f"episode {victim} (task seed {trajectories[victim].task_seed}) does not replay:" in out
        assert problem in out
        assert f"verify: {len(trajectories) - 1}/{len(trajectories)} episodes replay exactly, 1 differ" in out


def test_recorded_tools_and_instructions_are_what_verification_renders(tmp_path, shipped):
    path = record_cli(tmp_path, "toolgym/Zorplex-v0", {"tool_format": "json"}, tasks=1)
    header, (t, *_) = read_recording(path)
    renderer = recorded_renderer(header, shipped)
    assert verify_tokens(t, renderer) == []
    renamed = msgspec.structs.replace(t, reset_info={**t.reset_info, "instructions": "Be brief."})
    assert verify_tokens(renamed, renderer) == ["turn 0: observation tokens are not the rendered prompt"]
    other_tool = json.loads(json.dumps(t.reset_info))
    other_tool["tools"][0]["function"]["description"] = "something else"
    assert verify_tokens(msgspec.structs.replace(t, reset_info=other_tool), renderer) == [
        "turn 0: observation tokens are not the rendered prompt"
    ]


def test_an_old_recording_without_the_key_verifies_with_chatml(tmp_path, capsys, shipped):
    path = record_cli(tmp_path, "toolgym/Zorplex-v0", {"tool_format": "json"}, chat_template="")
    header, trajectories = read_recording(path)
    assert CHAT_TEMPLATE not in header.extra and all(t.reset_info == {} for t in trajectories)
    assert isinstance(recorded_renderer(header, shipped), ChatRenderer)
    # as written before templates: a version-1 file whose records have no reset_info key at all
    old = tmp_path / "old.jsonl"
    RecordingWriter(old, msgspec.structs.replace(header, schema_version=1)).close()
    with old.open("ab") as f:
        for t in trajectories:
            record = msgspec.to_builtins(t)
            del record["reset_info"]
            f.write(json.dumps(record).encode() + b"\n")
    assert b"reset_info" not in old.read_bytes()
    code, out = replay_verify(old, capsys)
    assert code == 0, out
    assert f"verify: {len(trajectories)}/{len(trajectories)} episodes replay exactly" in out
    assert "chat template" not in out


class ThinkingOracle(OraclePolicy):
    """The oracle's actions, each after a think block (a policy that reasons before acting)."""

    def for_episode(self, env, seed):
        script = plan_actions(env.unwrapped, self.config, np.random.default_rng(seed))
        return ScriptedEpisodePolicy(
            self.renderer, [f"<think>\nstep {i}\n</think>\n\n{a}" for i, a in enumerate(script)]
        )


def record_with(renderer, template, path, config, policy, seeds):
    trajectories = RolloutRunner(policy, renderer, config).run(seeds)
    header = RecordingHeader(
        tokenizer_fingerprint=tokenizer_fingerprint(renderer.tokenizer),
        env_id=config.env_id,
        env_kwargs=config.env_kwargs,
        extra={CHAT_TEMPLATE: chat_template_entry(template)},
    )
    with RecordingWriter(path, header) as writer:
        writer.write_all(trajectories)
    return trajectories


def test_restarted_sequences_verify_and_a_moved_restart_is_reported(tmp_path, capsys, shipped):
    # Qwen3-like reasoning rules without a tools block: env replies go back as user turns, after
    # which the template drops earlier reasoning, so every later turn restarts the sequence.
    template = ChatTemplate(QWEN3_NO_TOOLS, "qwen3-no-tools.jinja")
    renderer = TemplateRenderer(shipped, template)
    config = EnvRolloutConfig(
        env_id="toolgym/Zorplex-v0",
        env_kwargs={"tier": "compositional"},
        group_size=1,
        max_turns=8,
        observation_role="user",
    )
    path = tmp_path / "restarts.jsonl"
    trajectories = record_with(
        renderer, template, path, config, ThinkingOracle(renderer, OracleConfig()), [3, 4]
    )
    restarts = [[bool(tr.info.get(SEQUENCE_START)) for tr in t.transitions] for t in trajectories]
    assert all(r[0] is False and len(r) > 2 and all(r[1:]) for r in restarts)
    code, out = replay_verify(path, capsys)
    assert code == 0, out
    assert "verify: 2/2 episodes replay exactly" in out

    def unmark(t):
        if t.task_seed == 4:
            del t.transitions[2].info[SEQUENCE_START]
        return t

    code, out = replay_verify(rewrite(path, tmp_path / "unmarked.jsonl", unmark), capsys)
    assert code == 1
    assert "turn 2: sequence_start is False, but the rendering restarts there" in out
    assert "verify: 1/2 episodes replay exactly, 1 differ" in out

    # the same episodes checked with plain ChatML differ
    _, recorded = read_recording(path)
    assert all(verify_tokens(t, ChatRenderer(shipped)) for t in recorded)


def test_qwen3_like_tool_recording_verifies_and_an_unneeded_restart_is_reported(tmp_path, capsys, shipped):
    template = ChatTemplate(QWEN3_LIKE, "qwen3-like.jinja")
    renderer = TemplateRenderer(shipped, template)
    config = EnvRolloutConfig(
        env_id="toolgym/Zorplex-v0", env_kwargs={"tool_format": "json"}, group_size=1, max_turns=8
    )
    path = tmp_path / "qwen3.jsonl"
    trajectories = record_with(renderer, template, path, config, OraclePolicy(renderer), [0, 1])
    assert all(len(t.transitions) > 1 and t.metrics["sequence_restarts"] == 0 for t in trajectories)
    code, out = replay_verify(path, capsys)
    assert code == 0, out

    def mark(t):
        if t.task_seed == 1:
            t.transitions[1].info[SEQUENCE_START] = True
        return t

    code, out = replay_verify(rewrite(path, tmp_path / "marked.jsonl", mark), capsys)
    assert code == 1 and "turn 1: sequence_start is True, but the rendering does not restart there" in out


def test_a_broken_recorded_template_is_one_line(tmp_path, capsys, shipped):
    path = record_cli(tmp_path, "toolgym/Zorplex-v0", {"tool_format": "json"}, tasks=1)
    header, trajectories = read_recording(path)
    for i, entry in enumerate([{"text": "{% if %}", "special_tokens": {}, "template_kwargs": {}}, "qwen"]):
        bad = tmp_path / f"broken{i}.jsonl"
        with RecordingWriter(bad, msgspec.structs.replace(header, extra={CHAT_TEMPLATE: entry})) as w:
            w.write_all(trajectories)
        capsys.readouterr()
        assert main(["replay", str(bad), "--verify", "--tokenizer", TOKENIZER]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(bad) in err
        assert ("does not compile" if i == 0 else "not a recorded chat template") in err


def test_appending_episodes_rendered_otherwise_is_refused(tmp_path):
    path = record_cli(tmp_path, "toolgym/Zorplex-v0", {"tool_format": "json"}, tasks=1)
    header = RecordingReader(path).header
    with RecordingWriter(path, header):  # the same template appends
        pass
    for extra, what in [
        ({}, "plain ChatML"),
        ({CHAT_TEMPLATE: chat_template_entry(ChatTemplate(QWEN3_LIKE, "q3"))}, "q3"),
    ]:
        with pytest.raises(
            RecordingError,
            match=f"rendered with chat template .*, refusing to append episodes rendered with .*{what}",
        ):
            RecordingWriter(path, msgspec.structs.replace(header, extra=extra))
    args = [
        "record",
        "--env",
        "toolgym/Zorplex-v0",
        "--env-kwargs",
        '{"tool_format": "json"}',
        "--tasks",
        "1",
    ]
    assert main([*args, "--out", str(path), "--no-progress"]) == 2  # a ChatML run into that file


def test_run_recordings_and_sft_demos_keep_the_template(tmp_path, capsys, shipped):
    from toolgym.configs.assembly.demos import check_demo_rendering, demo_episodes
    from toolgym.configs.assembly.parts import build_renderer, run_chat_template_extra

    overrides = ["policy.chat_template=qwen2.5-style", 'env.kwargs={tool_format = "json"}', "sft.num_tasks=3"]
    config, _ = load_config("zorplex_tiny", overrides)
    renderer, _ = build_renderer(config)
    extra = run_chat_template_extra(config)
    assert extra[CHAT_TEMPLATE]["text"] == QWEN25_STYLE.read_text()
    plain, _ = load_config("zorplex_tiny")
    assert run_chat_template_extra(plain) == {}

    demos = tmp_path / "sft_demos.jsonl"
    demo_episodes(config, renderer, 2048, record_to=demos)
    header = RecordingReader(demos).header
    assert header.extra == extra
    code, out = replay_verify(demos, capsys)
    assert code == 0 and "verify: 3/3 episodes replay exactly" in out, out

    # SFT from a recording rendered otherwise than the run is refused in one line
    check_demo_rendering(config, renderer, header)
    chatml = record_cli(tmp_path, "toolgym/Zorplex-v0", {"tool_format": "json"}, chat_template="", tasks=1)
    recorded = msgspec.structs.replace(config.sft, source="recording", recording=str(chatml))
    with pytest.raises(
        ConfigError, match="was rendered with plain ChatML, but this run renders with chat template"
    ):
        check_demo_rendering(
            msgspec.structs.replace(config, sft=recorded), renderer, RecordingReader(chatml).header
        )
