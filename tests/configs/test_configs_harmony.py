"""`policy.chat_template = "harmony"` (gpt-oss's format, agents/harmony.py) end to end through
`toolgym train`: SFT on the oracle's harmony calls and an RL step on a tokenizer with harmony's
tokens, the recording naming the format and replaying token for token; a note where the env
speaks another format; a one-line refusal for a tokenizer without harmony's tokens or an option
harmony does not have."""

from __future__ import annotations

from pathlib import Path

import pytest
from harmony_reference import harmony_tokenizer

from toolgym.agents.harmony import HarmonyRenderer
from toolgym.configs.assembly.parts import make_renderer
from toolgym.configs.cli.main import main
from toolgym.rollouts.recording.format import CHAT_TEMPLATE, read_recording

SMALL = [
    "run.steps=1", "run.export_hf=false", "run.plot=false",
    "sft.steps=2", "sft.num_tasks=4", "sft.batch_episodes=2", "sft.optimizer.warmup_steps=0",
    "model.name='test'", "model.overrides={vocab_size=1024, max_position_embeddings=2048}",
    "policy.max_batch_size=8", "policy.max_seq_len=1536", "policy.chat_template='harmony'",
    "policy.chat_template_kwargs={reasoning_effort='low'}",
    "rollout.group_size=2", "batch.groups_per_batch=1", "batch.dynamic_sampling=false",
    "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
    "checkpoint.every_steps=0", "checkpoint.at_end=false", "logging.record_training=true",
]  # fmt: skip


def tokenizer_file(tmp_path: Path) -> Path:
    path = tmp_path / "harmony-tokenizer.json"
    harmony_tokenizer().save(str(path))
    return path


def train(tmp_path: Path, capsys, *overrides: str) -> tuple[int, str]:
    args = ["train", "shop_tiny", "--no-progress", "--set", f"run.run_dir='{tmp_path / 'run'}'"]
    for item in [*SMALL, *overrides]:
        args += ["--set", item]
    code = main(args)
    out, err = capsys.readouterr()
    return code, out + err


def test_a_harmony_run_trains_on_harmony_calls_and_replays_token_for_token(tmp_path, capsys):
    tokenizer = tokenizer_file(tmp_path)
    code, out = train(tmp_path, capsys, f"tokenizer.path='{tokenizer}'", "env.kwargs.tool_format='harmony'")
    assert code == 0 and "done in" in out, out
    assert not [line for line in out.splitlines() if line.startswith(("warning:", "note:")) and "tool" in line]
    run = tmp_path / "run" / "trajectories"
    header, demos = read_recording(run / "sft_demos.jsonl")
    assert header.extra[CHAT_TEMPLATE]["harmony"] is True
    assert header.extra[CHAT_TEMPLATE]["template_kwargs"] == {"reasoning_effort": "low"}
    calls = [t.action.text for d in demos for t in d.transitions[:-1]]
    assert calls and all(text.startswith(" to=functions.") and "<|message|>" in text for text in calls)
    assert all(d.total_reward > 0 for d in demos)  # the oracle wins in harmony
    for recording in (run / "sft_demos.jsonl", run / "train_rank0.jsonl"):
        args = ["replay", str(recording), "--verify", "--tokenizer", str(tokenizer)]
        assert main(args) == 0, capsys.readouterr()
        assert "token mismatch" not in capsys.readouterr().out


def test_an_env_in_another_format_gets_a_note(tmp_path, capsys):
    tokenizer = tokenizer_file(tmp_path)
    code, out = train(tmp_path, capsys, f"tokenizer.path='{tokenizer}'", "sft.enabled=false")
    assert code == 0, out
    (line,) = [line for line in out.splitlines() if line.startswith("note:") and "tool" in line]
    assert line == (
        "note: model 'test' renders harmony, which speaks 'harmony' tool calls; toolgym/Shop-v0's "
        "tool_format is 'json' (its default) (--set env.kwargs.tool_format=harmony to match)"
    )


def test_a_tokenizer_without_harmony_tokens_or_an_unknown_option_is_refused(tmp_path, capsys):
    code, out = train(tmp_path, capsys, "env.kwargs.tool_format='harmony'")
    assert code != 0
    assert "policy.chat_template" in out and "the tokenizer has no '<|start|>' token" in out
    with pytest.raises(ValueError, match="harmony has no option 'enable_thinking'"):
        make_renderer(tokenizer_file(tmp_path), "harmony", {"enable_thinking": True})
    assert isinstance(make_renderer(tokenizer_file(tmp_path), "harmony"), HarmonyRenderer)


def test_the_openai_endpoint_refuses_harmony_in_one_line():
    """`toolgym serve` and an agent program's endpoint alike: the refusal is PolicyServer's."""
    import msgspec

    from toolgym.agents.engine.engine import TorchEngine
    from toolgym.agents.model.config import ModelConfig
    from toolgym.agents.model.transformer import build_model
    from toolgym.rollouts.endpoint.server import PolicyServer

    renderer = HarmonyRenderer(harmony_tokenizer())
    model = build_model(msgspec.structs.replace(ModelConfig.named("test"), vocab_size=1024), seed=0)
    engine = TorchEngine(model, max_batch_size=2, max_seq_len=64, tokenizer=renderer.tokenizer)
    with engine, pytest.raises(ValueError, match="the OpenAI endpoint does not speak harmony"):
        PolicyServer(engine, renderer)
