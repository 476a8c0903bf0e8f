"""Self-play from a config: [selfplay] loads and is checked in one-line errors (an env that is no
game, an unknown bot, async mode; the shipped preset: tests/configs/test_configs_schema.py), and a short `toolgym
train` run in mirror self-play trains both seats' episodes in per-seat groups and records them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
from short_run_testlib import other_tokenizer, short_run

from toolgym.agents.model.checkpoint import save_hf_checkpoint
from toolgym.agents.model.transformer import Transformer
from toolgym.configs.assembly.parts import initial_model
from toolgym.configs.assembly.placement import check_async
from toolgym.configs.checks import check_environment
from toolgym.configs.cli.main import main
from toolgym.configs.cli.train import train
from toolgym.configs.load import ConfigError, config_from_dict, tokenizer_path
from toolgym.rollouts.recording.format import RecordingReader
from toolgym.trainers.metrics_log import read_metrics


def raw_config(run_dir: Path, **selfplay) -> dict:
    return short_run(
        run_dir,
        env={"id": "toolgym/Nim-v0", "kwargs": {"opponent": "expert"}},
        rollout={"group_size": 2, "max_turns": 8, "max_tokens_per_turn": 4, "max_tokens_per_episode": 32},
        batch={"groups_per_batch": 4},
        eval={"at_end": True, "num_tasks": 4},
        logging={"headline_metrics": ["vs_random/success"]},
        selfplay={"enabled": True, "eval_opponents": ["random"], **selfplay},
    )


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        check_environment(config_from_dict(raw))
    return str(info.value)


def test_the_selfplay_section_is_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"config error: selfplay\.learn: must be one of"):
        config_from_dict(raw_config(tmp_path, learn="both"))
    raw = raw_config(tmp_path)
    raw["env"] = {"id": "toolgym/Zorplex-v0"}
    assert (
        error_of(raw)
        == "config error: selfplay.enabled: env 'toolgym/Zorplex-v0' is not a game of seats (envs/core/seats.py SeatedGame)"
    )
    assert "'grandmaster' is not one of the game's bots ['random', 'expert']" in error_of(
        raw_config(tmp_path, learn="one", opponent="grandmaster")
    )
    assert error_of(raw_config(tmp_path, eval_opponents=["random", "nobody"])).startswith(
        "config error: selfplay.eval_opponents: 'nobody' is not one of the game's bots"
    )
    config = config_from_dict({**raw_config(tmp_path), "loop": {"mode": "async", "generator": "thread"}})
    with pytest.raises(
        ConfigError, match=r'selfplay\.enabled: self-play matches are played in loop\.mode = "sync"'
    ):
        check_async(config, 1, "thread")


@pytest.mark.slow
def test_a_mirror_selfplay_run_trains_both_seats_in_per_seat_groups(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(config_from_dict(raw_config(run_dir))) == 0
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals and "eval/success" in evals[-1] and "eval/loss" in evals[-1]  # against the expert bot
    assert 0.0 <= evals[-1]["eval/vs_random/success"] <= 1.0  # and against the random one
    summary = json.loads((run_dir / "summary.json").read_text())  # a headline metric with a "/"
    assert summary["after"]["vs_random/success"] == evals[-1]["eval/vs_random/success"]
    trajectories = list(RecordingReader(run_dir / "trajectories" / "train_rank0.jsonl"))
    # 4 groups a step: 2 tasks x 2 seats, each of group_size 2
    assert len(trajectories) == 2 * 4 * 2
    groups: dict[int, list[str]] = {}  # group ids are unique over the run's task stream
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t.seat)
    assert len(groups) == 8 and all(len(seats) == 2 and len(set(seats)) == 1 for seats in groups.values())
    assert {t.seat for t in trajectories} == {"first", "second"}
    # replay --verify plays each match's two seats again together
    capsys.readouterr()
    code = main(["replay", str(run_dir / "trajectories" / "train_rank0.jsonl"), "--verify", "--summary-only"])
    out = capsys.readouterr().out
    # the untrained model's seats that never moved (the game ended first) count as errored, not differing
    exact, errored = re.search(r"verify: (\d+)/16 episodes replay exactly(?:, (\d+) errored)?", out).groups()
    assert int(exact) + int(errored or 0) == 16 and "differ" not in out and int(exact) > 0
    assert code == (1 if errored else 0)


def test_the_pool_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"selfplay: .*set learn = 'one'"):
        config_from_dict(raw_config(tmp_path, opponent="pool"))
    assert error_of(raw_config(tmp_path, learn="one", opponent="pool", pool_bots=["nobody"])).startswith(
        "config error: selfplay.pool_bots: 'nobody' is not one of the game's bots"
    )


def opponent_checkpoint(tmp_path: Path, name: str, tokenizer: Path | None = None, **overrides) -> Path:
    """A HF directory of the short run's model (its initial weights, `overrides` to its shape)."""
    config = config_from_dict(raw_config(tmp_path / "any"))
    model = initial_model(config)
    if overrides:
        model = Transformer(msgspec.structs.replace(model.config, **overrides))
    return save_hf_checkpoint(model, model.config, tmp_path / name, tokenizer or tokenizer_path(config))


def test_pool_checkpoints_of_another_model_or_tokenizer_are_refused(tmp_path):
    pool = {"learn": "one", "opponent": "pool", "pool_size": 0}
    wider = opponent_checkpoint(tmp_path, "wider", hidden_size=128)
    message = error_of(raw_config(tmp_path, **pool, pool_checkpoints=[str(wider)]))
    assert message.startswith(f"config error: selfplay.pool_checkpoints: {wider}: another model than the policy's")
    assert "hidden_size" in message and "\n" not in message
    other_tokenizer(tmp_path / "other.json")
    foreign = opponent_checkpoint(tmp_path, "foreign", tokenizer=tmp_path / "other.json")
    assert f"{foreign}: its tokenizer " in error_of(raw_config(tmp_path, **pool, pool_checkpoints=[str(foreign)]))
    assert "is not a Hugging Face directory" in error_of(
        raw_config(tmp_path, **pool, pool_checkpoints=[str(tmp_path / "nowhere")])
    )
    same = opponent_checkpoint(tmp_path, "same")
    check_environment(config_from_dict(raw_config(tmp_path, **pool, pool_checkpoints=[str(same)])))
    with_lora = raw_config(tmp_path, **pool, pool_checkpoints=[str(same)])
    with_lora["policy"] = {**with_lora["policy"], "lora": {"rank": 4, "alpha": 8}}
    assert "not with policy.lora" in error_of(with_lora)


@pytest.mark.slow
def test_a_one_seat_run_records_the_opponents_seat_beside_the_learners(tmp_path, capsys):
    """learn "one" against the policy itself: only the learning seat trains, yet the recording
    holds every match whole (the other seat `trained=False`), and replay --verify plays the
    matches again with both seats."""
    run_dir = tmp_path / "run"
    assert train(config_from_dict(raw_config(run_dir, learn="one", opponent="self"))) == 0
    trajectories = list(RecordingReader(run_dir / "trajectories" / "train_rank0.jsonl"))
    trained = [t for t in trajectories if t.trained]
    opponents = [t for t in trajectories if not t.trained]
    # 2 steps x 2 tasks x 2 matches (group_size): one seat of each trained, the other beside it
    assert len(trained) == 2 * 2 * 2 and len(opponents) == len(trained)
    matches: dict[tuple[int, int], dict[str, bool]] = {}
    for t in trajectories:
        matches.setdefault((t.task_seed, t.sample_index), {})[t.seat] = t.trained
    assert len(matches) == len(trained)
    assert all(sorted(seats.values()) == [False, True] for seats in matches.values())  # one each
    capsys.readouterr()
    code = main(["replay", str(run_dir / "trajectories" / "train_rank0.jsonl"), "--verify", "--summary-only"])
    out = capsys.readouterr().out
    exact, errored = re.search(r"verify: (\d+)/16 episodes replay exactly(?:, (\d+) errored)?", out).groups()
    assert int(exact) + int(errored or 0) == 16 and "differ" not in out and "not verified" not in out
    assert code == (1 if errored else 0)


def test_a_pool_run_rates_its_snapshots_and_resumes_with_them(tmp_path, capsys):
    """learn "one" against a pool of the random bot and snapshots every step (2 kept): the ratings
    logged each step, the snapshots on disk and in the checkpoint, a resume that rebuilds them,
    and one without a snapshot's file refused in one line."""
    run_dir = tmp_path / "run"
    pool = {"learn": "one", "opponent": "pool", "pool_every": 1, "pool_size": 2, "pool_bots": ["random"]}
    pool["pool_checkpoints"] = [str(opponent_checkpoint(tmp_path, "rival"))]

    def config(steps: int):
        raw = raw_config(run_dir, **pool)
        raw["run"]["steps"] = steps
        raw["checkpoint"] = {"every_steps": 1, "at_end": True}
        return config_from_dict(raw)

    assert train(config(2)) == 0
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["selfplay/snapshots"] == 1 and steps[1]["selfplay/snapshots"] == 2  # step_0, step_1
    for r in steps:  # every game of the step against a member rated (a seat the game ended
        # before it moved is an env error, no game of its own)
        games = sum(v for k, v in r.items() if k.startswith("selfplay/games/"))
        assert r["rollout/episodes"] == 4 and games == 4 - r.get("rollout/errors", 0) > 0
        assert "selfplay/elo" in r and "selfplay/elo/random" in r and "selfplay/elo/ckpt_rival" in r
    assert sorted(p.name for p in (run_dir / "selfplay_pool").iterdir()) == [
        "step_0.safetensors",
        "step_1.safetensors",
    ]
    meta = json.loads((run_dir / "checkpoints" / "rl" / "step_00000002" / "meta.json").read_text())
    members = meta["data_position"]["selfplay_pool"]["members"]
    assert [m["name"] for m in members] == ["random", "ckpt_rival", "step_0", "step_1"]
    assert meta["data_position"]["selfplay_pool"]["learner_rating"] == steps[1]["selfplay/elo"]

    assert train(config(3), resume=run_dir) == 0  # step 3 snapshots step_2; step_0 leaves
    last = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"][-1]
    assert last["step"] == 3 and "selfplay/elo/step_2" in last and "selfplay/elo/step_0" not in last
    assert last["selfplay/elo/step_1"] != 1000 or last["selfplay/games/step_1"] == 0

    capsys.readouterr()
    (run_dir / "selfplay_pool" / "step_1.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"selfplay: self-play pool member 'step_1': its weights file .* is missing"):
        train(config(4), resume=run_dir)
