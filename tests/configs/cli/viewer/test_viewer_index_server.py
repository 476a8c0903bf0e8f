"""The viewer without a browser: the index (rows, filters, sorting, pages, damaged and foreign
files, the per-token view, advantages as the recorded run scored them or said to be unknown), the
comparison by task seed, the JSON API, and `toolgym view`'s sources and errors."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
from recording_testlib import play, shipped_renderer, write

from toolgym.agents.tokenizer import tokenizer_fingerprint
from toolgym.configs.cli.main import main
from toolgym.configs.cli.viewer.index import RecordingIndex, compare, token_texts
from toolgym.configs.cli.viewer.server import ViewerData, ViewerServer
from toolgym.rollouts.batches import BatchConfig, RolloutBatch, TaskSeedStream, collect_batch
from toolgym.rollouts.episodes import trajectory_to_episodes
from toolgym.rollouts.recording.format import (
    SCORING,
    RecordingHeader,
    RecordingWriter,
    read_recording,
    scoring_entry,
)
from toolgym.rollouts.scoring.advantages import AdvantageConfig, AdvantageEstimator, Credit, OverlongShaping
from toolgym.rollouts.scripted import OracleConfig
from toolgym.rollouts.types import StopReason, Trajectory

ZORPLEX = "toolgym/Zorplex-v0"


@pytest.fixture(scope="module")
def zorplex(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("viewer") / "zorplex.jsonl"
    return write(path, play(ZORPLEX, list(range(6)), env_kwargs={"tier": "simple"}), ZORPLEX, {"tier": "simple"})


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
    # no scoring in the header (an oracle recording): the advantages are unknown, and said to be
    assert all(r["adv"] is None and r["turn_adv"] is None for r in index.rows)
    scoring = index.summary()["scoring"]
    assert not scoring["known"] and scoring["note"].startswith("advantages unknown")


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
        (built,) = trajectory_to_episodes(trajectories[i], 0.0)
        s = ep["stream"]
        assert s["id"] == built.tokens and s["mask"] == built.loss_mask
        assert s["adv"] is None and not ep["scoring"]["known"]  # unknown, not another config's numbers
        assert "advantages unknown" in ep["scoring"]["note"]
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
    headless.write_bytes(lines[0].replace(b"toolgym.trajectories", b"toolgym.trajectorieX") + b"".join(lines[1:]))
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
    b_trajectories = play(ZORPLEX, [2, 3, 4], group_size=1, oracle=OracleConfig(p_omit_tag=1.0), policy_version=5)
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
        assert status == 200 and [r["label"] for r in body["recordings"]] == ["zorplex.jsonl", "missing.jsonl"]
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



# ---- toolgym view ------------------------------------------------------------------------------


def test_view_of_a_missing_path_is_a_one_line_error(tmp_path, capsys):
    assert main(["view", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such recording" in capsys.readouterr().err


def test_view_sources_of_a_run_directory(tmp_path, zorplex):
    from toolgym.configs.cli.view import view_sources

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
    recordings, metrics, tokenizer = view_sources([str(run)])
    assert [p.name for p in recordings] == ["eval_step_00000000.jsonl", "eval_step_00000010.jsonl", "train_rank0.jsonl"]
    assert metrics is not None and len(metrics) == 2 and tokenizer is None
    charts = ViewerData(recordings, None, metrics).recordings()["charts"]
    assert charts["reward"] == [{"name": "train", "points": [[1, 0.5]]}, {"name": "eval", "points": [[0, 0.25]]}]
    assert charts["accuracy"] == [{"name": "eval", "points": [[0, 1.0]]}]
    with pytest.raises(ValueError, match="no recordings"):
        view_sources([str(tmp_path)])
    assert msgspec.json.decode(msgspec.json.encode(charts))  # JSON-safe


# ---- the edges new users met --------------------------------------------------------------------


def test_reward_bounds_hold_up_to_float_rounding(zorplex):
    index = RecordingIndex(zorplex)
    index.rows[0]["reward"] = 0.1 + 1.0  # 1.0999999999999999, shown as 1.100
    index.rows[1]["reward"] = 1.1
    index.rows[2]["reward"] = 1.1 + 1e-6  # a real difference stays one
    kept = {r["i"] for r in index.query({"rmin": "1.1", "rmax": "1.1"})["rows"]}
    assert kept == {0, 1}
    assert 2 in {r["i"] for r in index.query({"rmin": "1.1"})["rows"]}
    assert 2 not in {r["i"] for r in index.query({"rmax": "1.1"})["rows"]}


def test_a_chat_jsonl_file_is_named_with_the_command_that_imports_it(zorplex, tmp_path):
    from toolgym.rollouts.recording.chat_jsonl import export_chat_jsonl

    chat = tmp_path / "chat.jsonl"
    with chat.open("w") as out:
        export_chat_jsonl(zorplex, out)
    index = RecordingIndex(chat)
    assert index.rows == [] and len(index.problems) == 1
    assert "chat-messages JSONL" in index.problems[0] and f"toolgym import {chat}" in index.problems[0]


def test_comparing_different_envs_warns(zorplex, tmp_path):
    other = write(tmp_path / "default_tier.jsonl", play(ZORPLEX, [0, 1], group_size=1), ZORPLEX)
    same = write(tmp_path / "same.jsonl", play(ZORPLEX, [0, 1], group_size=1, env_kwargs={"tier": "simple"}), ZORPLEX)
    warning = compare(RecordingIndex(zorplex), RecordingIndex(other), {})["warning"]
    assert "hold different envs" in warning and '"tier": "simple"' in warning
    assert compare(RecordingIndex(zorplex), RecordingIndex(same), {})["warning"] is None


def test_every_logged_metric_can_be_charted(zorplex, tmp_path):
    records = [
        {"kind": "train", "step": 1, "time": 5.0, "rollout/reward_mean": 0.5, "train/loss": 0.25, "note": "x"},
        {"kind": "train", "step": 2, "time": 6.0, "rollout/reward_mean": 0.75, "train/loss": float("nan")},
        {"kind": "eval", "step": 2, "time": 7.0, "eval/accuracy": 1.0, "train/loss": 0.5},
    ]
    data = ViewerData([zorplex], None, records)
    assert data.recordings()["metric_names"] == ["eval/accuracy", "rollout/reward_mean", "train/loss"]
    assert data.answer("series", {"name": "train/loss"})["series"] == [
        {"name": "train", "points": [[1, 0.25], [2, None]]},
        {"name": "eval", "points": [[2, 0.5]]},
    ]
    with pytest.raises(LookupError, match="no metric 'time'"):
        data.answer("series", {"name": "time"})
    with pytest.raises(ValueError, match="missing parameter 'name'"):
        data.answer("series", {})

    plain = ViewerData([zorplex])  # no run: the episodes' env metrics and reward components
    names = plain.recordings()["metric_names"]
    assert "metrics/accuracy" in names and any(n.startswith("components/") for n in names)
    (line,) = plain.answer("series", {"name": "metrics/accuracy"})["series"]
    rows = RecordingIndex(zorplex).rows
    assert line["points"] == [[0, pytest.approx(sum(r["metrics"]["accuracy"] for r in rows) / len(rows))]]


def test_a_port_in_use_is_refused_before_anything_is_read(zorplex, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["view", str(zorplex), "--port", str(port)]) == 2
    captured = capsys.readouterr()
    assert f"port {port} on 127.0.0.1 is in use" in captured.err and "--port 0" in captured.err
    assert "episodes" not in captured.out  # refused before the recording was indexed


# ---- advantages: the recorded run's own ---------------------------------------------------------


class Replaying:
    """A GroupRunner that hands back recorded groups: the trainer's batch of these episodes."""

    def __init__(self, groups: dict[int, list[Trajectory]]) -> None:
        self.groups = groups

    async def run_groups(self, task_seeds, group_ids=None, on_episode=None) -> list[Trajectory]:
        return [t for g in group_ids or [] for t in self.groups[g]]


def run_recording(
    path: Path, trajectories: list[Trajectory], config: AdvantageConfig, order: list[int] | None = None
) -> tuple[Path, RolloutBatch]:
    """Record `trajectories` (in `order`, default as given) as a run that scores with `config`
    would (its header's scoring entry), and the batch the trainer gets from the same groups
    (collect_batch: the scorer and the assembler)."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    header = RecordingHeader(
        tokenizer_fingerprint=tokenizer_fingerprint(shipped_renderer().tokenizer),
        env_id=ZORPLEX,
        env_kwargs=dict(trajectories[0].env_kwargs),
        policy_id="a run",
        extra={SCORING: scoring_entry(config, {"name": "grpo"}, train_on_infra_failures=False)},
    )
    with RecordingWriter(path, header) as writer:
        writer.write_all([trajectories[i] for i in order] if order else trajectories)
    assert sorted(groups) == list(range(len(groups)))  # the stream's first group ids
    batch_config = BatchConfig(groups_per_batch=len(groups), advantage=config)
    return path, asyncio.run(collect_batch(Replaying(groups), TaskSeedStream(), batch_config))


def _by_episode(batch: RolloutBatch) -> dict[tuple[int, int], object]:
    return {(t.group_id, t.sample_index): a for t, a in zip(batch.trajectories, batch.advantages, strict=True)}


def test_turn_state_advantages_are_the_trainer_batch_s(tmp_path):
    # multi-turn episodes whose groups differ turn by turn; one infra failure, left out by both
    oracle = OracleConfig(p_omit_tag=0.5, p_malformed_call=0.3)  # turns of different values
    played = play(ZORPLEX, list(range(4)), group_size=3, env_kwargs={"tier": "recursive"}, oracle=oracle)
    played[4] = msgspec.structs.replace(played[4], stop_reason=StopReason.ENV_ERROR, error="env_error: boom")
    config = AdvantageConfig(estimator=AdvantageEstimator.DR_GRPO, credit=Credit.TURN_STATE)
    # written with one group's records apart (group 1 around group 2): still scored whole
    order = [0, 1, 2, 3, 4, 6, 7, 8, 5, 9, 10, 11]
    path, batch = run_recording(tmp_path / "run.jsonl", played, config, order)
    expected = _by_episode(batch)
    index = RecordingIndex(path)
    summary = index.summary()["scoring"]
    assert summary["known"] and summary["turn_level"] and "credit turn_state" in summary["note"]
    nonzero = 0
    for row in index.rows:
        advantage = expected[(row["group"], row["sample"])]
        if row["stop"] == StopReason.ENV_ERROR:
            assert advantage == 0.0 and row["adv"] == 0.0 and row["turn_adv"] == [0.0] * row["turns"]
            continue
        assert isinstance(advantage, list) and row["turn_adv"] == advantage  # exactly, per turn
        nonzero += len(set(advantage)) > 1
    assert nonzero > 0  # some episodes' turns got different advantages
    # the per-token stream is the trainer's Episode for that episode (one each: no restarts here)
    trained_on = [t for t, k in zip(batch.trajectories, batch.kept, strict=True) if k and not t.error]
    episodes = {(t.group_id, t.sample_index): e for t, e in zip(trained_on, batch.episodes, strict=True)}
    renderer = shipped_renderer()
    for i, row in enumerate(index.rows):
        if row["stop"] == StopReason.ENV_ERROR or row["turns"] < 2:
            continue
        ep = index.episode(i, renderer)
        trained = episodes[(row["group"], row["sample"])]
        assert ep["stream"]["adv"] == trained.advantages and ep["stream"]["id"] == trained.tokens
        assert [t["turn_adv"] for t in ep["turn_list"]] == row["turn_adv"] and ep["scoring"]["known"]


def test_outcome_advantages_with_overlong_shaping_are_the_trainer_batch_s(tmp_path):
    played = play(ZORPLEX, list(range(4)), group_size=3, env_kwargs={"tier": "compositional"})
    config = AdvantageConfig(eps=0.1, overlong=OverlongShaping(max_length=22, cache_length=6))
    path, batch = run_recording(tmp_path / "outcome.jsonl", played, config)
    expected = _by_episode(batch)
    index = RecordingIndex(path)
    assert not index.summary()["scoring"]["turn_level"]
    assert any(r["adv"] for r in index.rows)
    for row in index.rows:
        assert row["adv"] == expected[(row["group"], row["sample"])]  # exactly
        assert row["turn_adv"] == [row["adv"]] * row["turns"]
    (trained, *_) = batch.episodes
    assert index.episode(0, shipped_renderer())["stream"]["adv"] == trained.advantages


def test_a_judged_episode_shows_what_the_judge_said_per_criterion(tmp_path):
    from judge_testlib import judge_server

    from toolgym.rollouts.scoring.judge import Judge, JudgeConfig, JudgeCriterion

    played = play("toolgym/Zorplex-v0", [0, 1], group_size=2)
    criteria = [JudgeCriterion(name="polite", prompt="The transcript contains 'zorplex'.", weight=0.5)]
    with judge_server() as server:
        judge = Judge(JudgeConfig(url=server.url, mode="group", criteria=criteria))
        for group in (played[:2], played[2:]):
            assert judge.annotate(group)[0] is None
    path = write(tmp_path / "judged.jsonl", played, "toolgym/Zorplex-v0")
    (entry,) = RecordingIndex(path).episode(1, None)["judge"]
    recorded = played[1].transitions[-1].info["judge"]["polite"]
    assert entry["criterion"] == "polite" and entry["score"] == recorded["score"] and entry["weight"] == 0.5
    assert entry["answer"] == recorded["answer"] and entry["position"] == recorded["position"]
    assert "=== Attempt" in entry["prompt"]  # group mode: the judge saw the whole group
    assert RecordingIndex(write(tmp_path / "plain.jsonl", play("toolgym/Zorplex-v0", [0]), "toolgym/Zorplex-v0")).episode(0, None)["judge"] == []
