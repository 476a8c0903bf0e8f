"""On-policy distillation from a config: [distill] loads and is checked in one-line errors (its
numbers, the teacher's directory, its tokenizer), and a short `toolgym train` run with a teacher
checkpoint logs a finite reverse KL (about 0 on the first step, the teacher being the student's
own initial weights) and records the teacher."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
from short_run_testlib import other_tokenizer, short_run

from toolgym.agents.model.checkpoint import save_hf_checkpoint
from toolgym.agents.tokenizer import load_tokenizer, tokenizer_fingerprint
from toolgym.configs.assembly.parts import initial_model
from toolgym.configs.assembly.placement import check_async
from toolgym.configs.checks import check_environment
from toolgym.configs.cli.train import train
from toolgym.configs.cli.viewer.index import RecordingIndex
from toolgym.configs.load import ConfigError, config_from_dict, load_config, tokenizer_path
from toolgym.rollouts.recording.format import TEACHER, RecordingReader, recorded_scoring
from toolgym.rollouts.recording.replay import OfflineMode, episodes_from_trajectories
from toolgym.rollouts.scoring.distill import TEACHER_LOGPROBS
from toolgym.trainers.metrics_log import read_metrics


def raw_config(run_dir: Path, teacher: str = "") -> dict:
    return short_run(run_dir, distill={"teacher": teacher, "weight": 1.0, "reward_weight": 0.5})


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return str(info.value)


def test_distill_numbers_are_checked_at_load_time(tmp_path):
    raw = raw_config(tmp_path / "run", "somewhere")
    raw["distill"]["weight"] = -1.0
    assert error_of(raw) == "config error: distill.weight: must be a finite number >= 0, got -1.0"
    raw["distill"].update(weight=0.0, reward_weight=0.0)
    assert error_of(raw).startswith(
        "config error: distill: distill.weight and distill.reward_weight are both 0"
    )


def test_the_teacher_directory_and_tokenizer_are_checked_before_the_run(tmp_path):
    config = config_from_dict(raw_config(tmp_path / "run", str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match=r"distill\.teacher: .*missing is not a Hugging Face directory"):
        check_environment(config)
    other = load_tokenizer(other_tokenizer(tmp_path / "other.json"))
    teacher = save_hf_checkpoint(
        initial_model(config), initial_model(config).config, tmp_path / "t", tmp_path / "other.json"
    )
    config = config_from_dict(raw_config(tmp_path / "run", str(teacher)))
    with pytest.raises(ConfigError) as info:
        check_environment(config)
    ours = tokenizer_fingerprint(load_tokenizer(tokenizer_path(config)))
    message = str(info.value)
    assert message.startswith("config error: distill.teacher: its tokenizer ") and "\n" not in message
    assert ours[:16] in message and tokenizer_fingerprint(other)[:16] in message


def test_the_distill_preset_loads_with_a_teacher_given_by_set(tmp_path):
    config, _ = load_config("zorplex_recursive_distill_tiny", [f"distill.teacher={tmp_path}"])
    assert config.distill.teacher == str(tmp_path) and config.distill.reward_weight == 0.0
    default, _ = load_config("zorplex_recursive_distill_tiny")
    assert default.distill.teacher == ""


def test_generator_processes_are_refused_with_a_teacher(tmp_path):
    raw = raw_config(tmp_path / "run", str(tmp_path))
    raw["loop"] = {"mode": "async", "generator": "process"}
    with pytest.raises(
        ConfigError, match=r"distill\.teacher: the teacher scores groups in the trainer's process"
    ):
        check_async(config_from_dict(raw), 1, "process")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loop", "top_k"),
    [({}, 4), ({"mode": "async", "generator": "thread"}, 0)],
    ids=["sync-top-k", "async-thread"],
)
def test_a_distill_run_logs_a_finite_reverse_kl_and_records_the_teacher(
    tmp_path: Path, loop: dict, top_k: int
):
    run_dir = tmp_path / "run"
    student = config_from_dict(raw_config(run_dir))
    model = initial_model(student)  # the teacher: the student's own initial weights
    teacher = save_hf_checkpoint(model, model.config, tmp_path / "teacher", tokenizer_path(student))
    raw = raw_config(run_dir, str(teacher))
    raw["distill"]["top_k"] = top_k
    config = config_from_dict({**raw, "loop": loop})
    check_environment(config)
    assert train(config) == 0
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["distill/reverse_kl_mean"]) and math.isfinite(r["distill/reverse_kl_turn0"])
        assert r["distill/scored_tokens"] > 0 and r["distill/teacher_s"] > 0
        assert r["batch/groups_scoring_failed"] == 0
        # the top-k forward KL trains beside the reverse KL (distill.top_k), else it is off
        assert ("train/forward_kl_topk" in r) == bool(top_k)
        if top_k:
            assert math.isfinite(r["train/forward_kl_topk"]) and 0 < r["train/teacher_topk_mass"] <= 1
    # step 1 sampled with the teacher's own weights: the sampler's logprobs are the teacher's
    assert abs(steps[0]["distill/reverse_kl_mean"]) < 1e-3
    if top_k:  # and the trainer's distribution is the teacher's: each top-k term is about 0
        assert abs(steps[0]["train/forward_kl_topk"]) < 1e-3
    reader = RecordingReader(run_dir / "trajectories" / "train_rank0.jsonl")
    header, trajectories = reader.header, list(reader)
    entry = header.extra[TEACHER]
    assert entry == {"path": str(teacher), "tokenizer_fingerprint": header.tokenizer_fingerprint}
    scoring = recorded_scoring(header)
    assert scoring is not None and scoring.distill == config.distill
    assert trajectories and all(
        len(t.info[TEACHER_LOGPROBS]) == len(t.action.tokens) for tr in trajectories for t in tr.transitions
    )
    assert msgspec.to_builtins(config.distill)["teacher"] == str(teacher)
    # the viewer re-scores the per-token advantages and shades by the teacher's log-ratio
    index = RecordingIndex(run_dir / "trajectories" / "train_rank0.jsonl")
    assert index.problems == [] and index.summary()["scoring"]["known"]
    stream = index.episode(0, None)["stream"]
    t = trajectories[0]
    ratios = [
        x - s
        for tr in t.transitions
        for x, s in zip(tr.info[TEACHER_LOGPROBS], tr.action.logprobs, strict=True)
    ]
    assert [x for x in stream["teacher"] if x is not None] == pytest.approx(ratios)
    sampled = [a for a, m in zip(stream["adv"], stream["mask"], strict=True) if m]
    assert len(sampled) == len(ratios) and all(math.isfinite(a) for a in sampled)
    # replay's offline policy gradient scores them alike
    episodes, _ = episodes_from_trajectories(
        trajectories, OfflineMode.PG, scoring.advantage, distill=scoring.distill
    )
    assert episodes[0].advantages == pytest.approx(stream["adv"][: len(episodes[0].advantages)])


@pytest.mark.slow
def test_a_distill_run_with_an_endpoint_teacher_scores_through_toolgym_serve(tmp_path: Path):
    from serve_testlib import toolgym_serve

    run_dir = tmp_path / "run"
    student = config_from_dict(raw_config(run_dir))
    model = initial_model(student)  # the teacher: the student's own initial weights, served
    teacher = save_hf_checkpoint(model, model.config, tmp_path / "teacher", tokenizer_path(student))
    with toolgym_serve(teacher) as url:
        config = config_from_dict(raw_config(run_dir, url))
        assert config.distill.endpoint
        check_environment(config)  # reaches the endpoint: its model, tokenizer and prompt logprobs
        assert train(config) == 0
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["distill/reverse_kl_mean"]) and r["distill/scored_tokens"] > 0
        assert r["batch/groups_scoring_failed"] == 0
    # step 1 sampled with the served weights: the endpoint's logprobs are the sampler's
    assert abs(steps[0]["distill/reverse_kl_mean"]) < 1e-3
    reader = RecordingReader(run_dir / "trajectories" / "train_rank0.jsonl")
    header, trajectories = reader.header, list(reader)
    assert header.extra[TEACHER] == {"path": url, "tokenizer_fingerprint": header.tokenizer_fingerprint}
    assert trajectories and all(
        len(t.info[TEACHER_LOGPROBS]) == len(t.action.tokens) for tr in trajectories for t in tr.transitions
    )


def test_an_endpoint_teacher_that_cannot_be_reached_is_a_config_error(tmp_path):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    config = config_from_dict(raw_config(tmp_path / "run", url))
    with pytest.raises(ConfigError) as info:
        check_environment(config)
    message = str(info.value)
    assert message.startswith(f"config error: distill.teacher: distill.teacher {url}: cannot list its models")
    assert "\n" not in message
