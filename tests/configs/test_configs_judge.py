"""Rewards from a judge from a config: [judge] loads and is checked in one-line errors, generator
processes are refused with it, and a short `toolgym train` run against a judge server on
127.0.0.1 (judge_testlib.py) logs every criterion as a reward component and the judge's metrics,
and records what the judge saw and said."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from judge_testlib import judge_server
from short_run_testlib import short_run

from toolgym.configs.assembly.placement import check_async
from toolgym.configs.checks import check_environment
from toolgym.configs.cli.main import main
from toolgym.configs.cli.train import train
from toolgym.configs.load import ConfigError, config_from_dict
from toolgym.rollouts.recording.format import RecordingReader, RecordingWriter, read_recording
from toolgym.rollouts.scoring.judge import JUDGE_INFO, transcript
from toolgym.trainers.metrics_log import read_metrics

CRITERIA = [
    {"name": "says_a", "prompt": "The assistant's text contains 'a'.", "weight": 1.0},
    {"name": "says_the", "prompt": "The assistant's text contains 'the'.", "weight": 0.5},
]


def raw_config(run_dir: Path, url: str, **judge) -> dict:
    return short_run(run_dir, judge={"url": url, "criteria": CRITERIA, **judge})


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return str(info.value)


def test_the_judge_section_is_checked_at_load_time(tmp_path):
    raw = raw_config(tmp_path, "http://127.0.0.1:1/v1", api_key_env="sk-the-key-itself")
    assert error_of(raw).startswith("config error: judge.api_key_env: must name an environment variable")
    raw = raw_config(tmp_path, "http://127.0.0.1:1/v1", mode="pairs")
    assert error_of(raw).startswith("config error: judge.mode")
    raw = raw_config(tmp_path, "http://127.0.0.1:1/v1")
    raw["judge"]["criteria"] = [CRITERIA[0], CRITERIA[0]]
    assert "criterion 'says_a' is named twice" in error_of(raw)
    raw = raw_config(tmp_path, "http://127.0.0.1:1/v1")
    raw["loop"] = {"mode": "async", "generator": "process"}
    with pytest.raises(ConfigError, match=r"judge\.url: the judge scores groups in the trainer's process"):
        check_async(config_from_dict(raw), 1, "process")


def test_a_judge_that_cannot_be_reached_or_lacks_its_key_is_a_config_error(tmp_path, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    with pytest.raises(ConfigError) as info:
        check_environment(config_from_dict(raw_config(tmp_path / "run", url)))
    assert str(info.value).startswith(f"config error: judge.url: judge.url {url}: cannot list its models")
    monkeypatch.delenv("TOOLGYM_TEST_JUDGE_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"judge\.url: judge\.api_key_env names \$TOOLGYM_TEST_JUDGE_KEY"):
        check_environment(
            config_from_dict(raw_config(tmp_path / "run", url, api_key_env="TOOLGYM_TEST_JUDGE_KEY"))
        )


@pytest.mark.slow
@pytest.mark.parametrize("loop", [{}, {"mode": "async", "generator": "thread"}], ids=["sync", "async-thread"])
def test_a_run_with_a_judge_logs_each_criterion_and_records_the_judges_answers(tmp_path, monkeypatch, loop, capsys):
    monkeypatch.setenv("TOOLGYM_TEST_JUDGE_KEY", "sekrit")
    run_dir = tmp_path / "run"
    with judge_server(api_key="sekrit") as server:
        raw = raw_config(run_dir, server.url, api_key_env="TOOLGYM_TEST_JUDGE_KEY")
        config = config_from_dict({**raw, "loop": loop})
        check_environment(config)  # reaches the judge with the key
        assert train(config) == 0
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert "rollout/reward/judge_says_a" in r and "rollout/reward/judge_says_the" in r
        assert r["judge/calls"] == 2 * 2 * 2  # groups x episodes x criteria, none cached
        assert r["judge/prompt_tokens"] > 0 and r["judge/completion_tokens"] > 0
        assert r["judge/latency_s"] > 0 and r["batch/groups_scoring_failed"] == 0
    # the async producer may judge groups ahead of the trainer that no step takes
    assert len(server.requests) == 16 if not loop else len(server.requests) >= 16
    assert set(server.authorizations) == {"Bearer sekrit"}
    trajectories = list(RecordingReader(run_dir / "trajectories" / "train_rank0.jsonl"))
    assert len(trajectories) == 8
    for trajectory in trajectories:
        judged = trajectory.transitions[-1].info[JUDGE_INFO]
        text = transcript(trajectory)
        for criterion in CRITERIA:
            entry = judged[criterion["name"]]
            assert text in entry["prompt"]  # the recording keeps what the judge saw
            assert entry["score"] == server.score(criterion["prompt"], text)
            component = trajectory.reward_components["judge_" + criterion["name"]]
            assert component == criterion["weight"] * entry["score"]
        assert trajectory.total_reward == pytest.approx(sum(t.reward for t in trajectory.transitions))
    if loop:
        return
    # the header names the judge (its key's variable, never the key); replay asks another again
    recording = run_dir / "trajectories" / "train_rank0.jsonl"
    entry = RecordingReader(recording).header.extra["judge"]
    assert entry["url"] == server.url and entry["api_key_env"] == "TOOLGYM_TEST_JUDGE_KEY"
    assert "sekrit" not in recording.read_text()
    for mode, verdict in (("rule", "1.000"), ("invert", "0.000")):
        with judge_server(mode) as other:
            assert main(["replay", str(recording), "--rejudge", other.url, "--judge-key-env", ""]) == 0
            out = capsys.readouterr().out
            assert len(other.requests) == 4 * 2 * 2  # every group, every episode, every criterion
        for criterion in CRITERIA:
            assert f"{criterion['name']}: 8 episodes" in out and f"same verdict (>= 0.5) {verdict}" in out
        assert "4 groups, 0 failed; 16 requests, 0 cache hits" in out.replace("\n", " ")
    cache = tmp_path / "judge_cache.jsonl"  # the same judge twice through one cache file: all hits
    with judge_server() as other:
        for hits in (0, 16):
            assert main(["replay", str(recording), "--rejudge", other.url, "--judge-cache", str(cache)]) == 0
            out = capsys.readouterr().out.replace("\n", " ")
            assert f"{16 - hits} requests, {hits} cache hits" in out
        assert len(other.requests) == 16
    with judge_server("garbage") as other:
        assert main(["replay", str(recording), "--rejudge", other.url, "--judge-key-env", ""]) == 1
    assert "4 groups, 4 failed" in capsys.readouterr().out
    plain = tmp_path / "plain.jsonl"  # a recording without a judge in its header
    with RecordingWriter(plain, msgspec.structs.replace(RecordingReader(recording).header, extra={})) as writer:
        writer.write_all(trajectories)
    assert main(["replay", str(plain), "--rejudge", server.url]) == 2
    assert "names no judge in its header" in capsys.readouterr().err


def test_judge_data_asks_as_the_judge_asks_and_answers_with_the_graders_verdict(tmp_path, capsys):
    """`toolgym record` of a fallible oracle, then `toolgym judge-data`: one row per episode, the
    judge's episode-mode question word for word (without the env's last reply, its verdict),
    and the env's success as the answer; `toolgym import` makes the rows a recording."""
    import json

    from toolgym.rollouts.scoring.judge import episode_question, parse_scores

    noisy, rows, imported = tmp_path / "noisy.jsonl", tmp_path / "judge.jsonl", tmp_path / "judge_rec.jsonl"
    assert main(["record", "--env", "toolgym/Zorplex-v0", "--tasks", "24", "--out", str(noisy),
                 "--p-omit-tag", "0.3", "--p-stop-early", "0.3", "--no-progress"]) == 0  # fmt: skip
    criterion = "The final answer is correct."
    assert main(["judge-data", str(noisy), "--criterion", criterion, "--out", str(rows), "--max-transcript-chars", "200"]) == 0
    assert "24 judge examples" in capsys.readouterr().out
    _, trajectories = read_recording(noisy)
    written = [json.loads(line) for line in rows.read_text().splitlines()]
    labels = []
    for t, row in zip(trajectories, written, strict=True):
        *question, answer = row["messages"]
        assert question == episode_question(criterion, t, 200, final_reply=False)
        assert t.final_observation and t.final_observation not in question[1]["content"]
        (score,) = parse_scores(answer["content"], None)
        assert score == t.metrics["env"]["success"]
        labels.append(score)
    assert 0 < sum(labels) < len(labels)  # the oracle's faults give both verdicts
    assert main(["import", str(rows), "--out", str(imported)]) == 0
    assert len(read_recording(imported)[1]) == 24



def test_group_judge_data_asks_as_group_mode_asks_with_the_labels_in_the_order_shown(tmp_path, capsys):
    """`toolgym judge-data --group-size 8`: the episodes in groups of 8 (and one of the rest), each
    asked word for word as judge mode "group" asks, answered with the grader's verdicts in the
    order shown; every episode is in exactly one group."""
    import json
    import re

    from toolgym.rollouts.scoring.judge import group_question, parse_scores, transcript

    noisy, rows = tmp_path / "noisy.jsonl", tmp_path / "judge.jsonl"
    assert main(["record", "--env", "toolgym/Zorplex-v0", "--tasks", "20", "--out", str(noisy),
                 "--p-omit-tag", "0.3", "--p-stop-early", "0.3", "--no-progress"]) == 0  # fmt: skip
    criterion = "The final answer is correct."
    assert main(["judge-data", str(noisy), "--criterion", criterion, "--out", str(rows),
                 "--max-transcript-chars", "200", "--group-size", "8"]) == 0  # fmt: skip
    assert "3 judge examples" in capsys.readouterr().out
    _, trajectories = read_recording(noisy)
    unused = list(trajectories)
    sizes = []
    for line in rows.read_text().splitlines():
        *question, answer = json.loads(line)["messages"]
        texts = re.split(r"=== Attempt \d+ ===\n", question[1]["content"])[1:]
        scores = parse_scores(answer["content"], len(texts))
        shown = []
        for text, score in zip(texts, scores, strict=True):
            match = next(
                t for t in unused
                if transcript(t, 200, False) == text.removesuffix("\n\n") and t.metrics["env"]["success"] == score
            )  # fmt: skip
            unused.remove(match)
            shown.append(match)
        assert question == group_question(criterion, shown, 200, final_reply=False)
        sizes.append(len(shown))
    assert sizes == [8, 8, 4] and not unused
    assert main(["judge-data", str(noisy), "--criterion", criterion, "--out", str(rows), "--group-size", "-1"]) == 2
    assert capsys.readouterr().err == "toolgym judge-data: error: --group-size must be >= 0, got -1\n"


@pytest.mark.slow
def test_a_judge_trained_by_the_recipe_and_served_by_toolgym_serve_scores_a_run(tmp_path, capsys):
    """The recipe end to end, shortened: judge data from a fallible oracle, an SFT-only run of the
    `test` model on it, `toolgym serve` of the exported model as the run's judge. Every answer of
    the served judge parses into a verdict (no group fails), each is recorded and becomes the
    criterion's component, and a re-judge through the run's cache file asks nothing again."""
    from serve_testlib import toolgym_serve

    from toolgym.rollouts.scoring.judge import parse_scores

    noisy, rows, imported = tmp_path / "noisy.jsonl", tmp_path / "judge.jsonl", tmp_path / "judge_rec.jsonl"
    assert main(["record", "--env", "toolgym/Zorplex-v0", "--tasks", "32", "--out", str(noisy),
                 "--p-omit-tag", "0.3", "--p-stop-early", "0.3", "--no-progress"]) == 0  # fmt: skip
    criterion = "The final answer is correct."
    assert main(["judge-data", str(noisy), "--criterion", criterion, "--out", str(rows), "--max-transcript-chars", "200"]) == 0
    assert main(["import", str(rows), "--out", str(imported)]) == 0
    judge_run = tmp_path / "judge_run"
    sets = [f'run.run_dir="{judge_run}"', f'sft.recording="{imported}"', "sft.steps=40", "sft.batch_episodes=8",
            'model.name="test"', "model.overrides={vocab_size=1024}", "sft.log_every=40"]  # fmt: skip
    assert main(["train", "judge_zorplex_tiny", "--no-progress", *(a for s in sets for a in ("--set", s))]) == 0
    token_accuracy = float(capsys.readouterr().out.split("token acc ")[-1].split()[0])
    assert token_accuracy > 0.9  # the answer's form is learned: every verdict below parses
    run_dir, cache = tmp_path / "run", tmp_path / "judge_cache.jsonl"
    judge = {"criteria": [{"name": "correct", "prompt": criterion, "weight": 1.0}], "final_reply": False,
             "max_transcript_chars": 200, "max_tokens": 16, "cache_file": str(cache)}  # fmt: skip
    with toolgym_serve(judge_run / "final_model") as url:
        config = config_from_dict(short_run(run_dir, judge={"url": url, **judge}))
        check_environment(config)  # lists the served model
        assert train(config) == 0
        steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
        assert [r["step"] for r in steps] == [1, 2]
        for r in steps:
            assert r["batch/groups_scoring_failed"] == 0 and r["judge/calls"] == 4  # 2 groups x 2 episodes
            assert r["judge/completion_tokens"] > 0
        recording = run_dir / "trajectories" / "train_rank0.jsonl"
        trajectories = list(RecordingReader(recording))
        assert len(trajectories) == 8
        for trajectory in trajectories:
            entry = trajectory.transitions[-1].info[JUDGE_INFO]["correct"]
            assert parse_scores(entry["answer"], None) == [entry["score"]] and entry["score"] in (0.0, 1.0)
            assert trajectory.reward_components["judge_correct"] == entry["score"]
        assert main(["replay", str(recording), "--rejudge", url, "--judge-cache", str(cache)]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "4 groups, 0 failed; 0 requests, 8 cache hits" in out and "same verdict (>= 0.5) 1.000" in out


def test_the_documented_judged_env_is_a_valid_config(tmp_path):
    import tomllib

    doc = (Path(__file__).parents[2] / "docs" / "environments.md").read_text()
    section = doc[doc.index("### A judged env") :]
    block = section[section.index("```toml\n") + 8 : section.index("```\n", section.index("```toml"))]
    documented = tomllib.loads(block)
    config = config_from_dict(short_run(tmp_path / "run", **documented))
    assert config.env.id == "toolgym/Zorplex-v0" and config.judge.reward == "replace"
    assert [c.name for c in config.judge.criteria] == ["correct", "tagged"]
