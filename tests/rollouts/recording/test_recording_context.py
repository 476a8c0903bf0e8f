"""Episodes whose context a policy rewrote (rollouts/context.py), as training data and records: each
rewrite starts a token-exact segment with its own tokens, mask and logprobs; the segments share
the episode's credit (outcome or per turn); recordings round-trip, `replay --verify` applies the
recorded policy again, and transcripts, export and the viewer show where segments start."""

import io
import json

import msgspec
import pytest
from chat_templates_testlib import SHIPPED_TOKENIZER
from recording_testlib import shipped_renderer, write

from toolgym.configs.cli.main import main
from toolgym.configs.cli.viewer.index import RecordingIndex
from toolgym.rollouts.context import ElideToolResults, SlidingWindow
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.episodes import build_episodes, sequences, trajectory_to_episodes, turn_spans
from toolgym.rollouts.recording.chat_jsonl import export_chat_jsonl
from toolgym.rollouts.recording.format import read_recording
from toolgym.rollouts.recording.replay import format_transcript, replay_problems
from toolgym.rollouts.scoring.advantages import AdvantageConfig, AdvantageEstimator, Credit
from toolgym.rollouts.scoring.credit import group_turn_advantages
from toolgym.rollouts.scripted import OracleConfig, OraclePolicy
from toolgym.rollouts.types import CONTEXT_REWRITE, SEQUENCE_START, StopReason
from toolgym.trainers.batching import make_micro_batches

ENV = "toolgym/Zorplex-v0"
NOTES = {"tier": "recursive", "redirects": 3, "notes": True, "max_turns": 10, "max_tool_calls": 6}
CHAIN = {k: v for k, v in NOTES.items() if k != "notes"}


def play(env_kwargs, context=None, seeds=(0, 1), group_size=2, oracle=None):
    renderer = shipped_renderer()
    config = EnvRolloutConfig(
        env_id=ENV, env_kwargs=env_kwargs, group_size=group_size, max_turns=10, context=context
    )
    policy = OraclePolicy(renderer, oracle or OracleConfig(p_wrong_note=0.5))
    trajectories = RolloutRunner(policy, renderer, config).run(list(seeds))
    for t in trajectories:  # made-up sampler logprobs, so a mix-up of segments would show
        for k, tr in enumerate(t.transitions):
            tr.action.logprobs = [-0.01 * (k + 1) * (j + 1) for j in range(len(tr.action.tokens))]
    return trajectories


@pytest.fixture(scope="module")
def noted():
    return play(NOTES)


def test_each_rewrite_starts_a_token_exact_segment_with_its_own_mask_and_logprobs(noted):
    for trajectory in noted:
        parts = sequences(trajectory)
        assert len(parts) == trajectory.metrics["context_rewrites"] + 1 >= 2
        episodes = trajectory_to_episodes(trajectory, 0.5)
        assert len(episodes) == len(parts)
        for episode, part in zip(episodes, parts, strict=True):
            assert episode.tokens == [i for t in part for i in (*t.observation_tokens, *t.action.tokens)]
            expected_mask = [
                m for t in part for m in [0] * len(t.observation_tokens) + [1] * len(t.action.tokens)
            ]
            assert episode.loss_mask == expected_mask
            assert [lp for lp, m in zip(episode.sampler_logprobs, expected_mask, strict=True) if m] == [
                lp for t in part for lp in t.action.logprobs
            ]
            # the segment's actions (notes among them) are trained, with the episode's advantage
            assert {a for a, m in zip(episode.advantages, episode.loss_mask, strict=True) if m} == {0.5}
        renderer = shipped_renderer()
        notes = [renderer.decode(t.action.tokens) for t in trajectory.transitions if t.info.get("note")]
        trained = [
            renderer.decode([i for i, m in zip(e.tokens, e.loss_mask, strict=True) if m]) for e in episodes
        ]
        assert all(any(note in text for text in trained) for note in notes)


def test_turn_level_credit_lands_on_each_turn_across_segments(noted):
    config = AdvantageConfig(estimator=AdvantageEstimator.DR_GRPO, credit=Credit.TURN_LOO)
    group = [t for t in noted if t.group_id == noted[0].group_id]
    per_turn = group_turn_advantages(group, config)
    for trajectory, advantages in zip(group, per_turn, strict=True):
        episodes = trajectory_to_episodes(trajectory, advantages)
        for k, span in enumerate(turn_spans(trajectory)):
            assert span is not None
            e, start, end = span
            assert episodes[e].tokens[start:end] == trajectory.transitions[k].action.tokens
            assert episodes[e].advantages[start:end] == [advantages[k]] * (end - start)
    built, stats = build_episodes(group, per_turn)
    assert stats.built == len(built) == sum(len(sequences(t)) for t in group)


def test_segments_of_an_episode_share_their_prefix_in_the_trainers_layout(noted):
    trajectory = noted[0]
    episodes = trajectory_to_episodes(trajectory, 1.0)
    prompt = trajectory.transitions[0].observation_tokens
    [batch] = make_micro_batches(episodes, token_budget=1 << 20, share_prefix=True)
    # every segment starts with the system prompt and the task: computed once, not per segment
    assert batch.prefix_len >= len(prompt) - 4
    assert batch.num_real_tokens < sum(len(e.tokens) - 1 for e in episodes)


def test_recordings_round_trip_and_verify_with_the_recorded_policy(tmp_path, noted):
    renderer = shipped_renderer()
    for kwargs, context in [
        (NOTES, None),
        (CHAIN, SlidingWindow(turns=1)),
        (CHAIN, ElideToolResults(keep_last=1)),
    ]:
        trajectories = noted if context is None else play(kwargs, context)
        path = write(tmp_path / f"{len(list(tmp_path.iterdir()))}.jsonl", trajectories, ENV, kwargs)
        _, back = read_recording(path)
        assert [msgspec.json.encode(t) for t in back] == [msgspec.json.encode(t) for t in trajectories]
        assert all(t.context_policy and t.metrics["context_rewrites"] for t in back)
        assert all(replay_problems(t, renderer) == [] for t in back)
        text = format_transcript(back[0], renderer)
        assert (
            text.count("[a new segment: the context policy rewrote the history]")
            == back[0].metrics["context_rewrites"]
        )


def test_verify_reports_a_rewrite_the_policy_would_not_make(noted):
    renderer = shipped_renderer()
    trajectory = msgspec.json.decode(msgspec.json.encode(noted[0]), type=type(noted[0]))
    trajectory.context_policy = {"policy": "window", "turns": 8, "slack": 0}  # would never cut
    first = next(k for k, t in enumerate(trajectory.transitions) if t.info.get(CONTEXT_REWRITE))
    assert replay_problems(trajectory, renderer) == [
        f"turn {first}: observation tokens are not the rendered env reply"
    ]
    trajectory.context_policy = {"policy": "nope"}
    assert "cannot rebuild the recorded context policy" in replay_problems(trajectory, renderer)[0]
    unmarked = msgspec.json.decode(msgspec.json.encode(noted[0]), type=type(noted[0]))
    first = next(t for t in unmarked.transitions if t.info.get(CONTEXT_REWRITE))
    del first.info[CONTEXT_REWRITE]
    assert any(
        "context_rewrite is False, but the context policy rewrites there" in p
        for p in replay_problems(unmarked, renderer)
    )


def test_replay_verify_cli_passes_on_episodes_with_rewrites(tmp_path, capsys, noted):
    path = write(tmp_path / "notes.jsonl", noted, ENV, NOTES)
    capsys.readouterr()
    code = main(["replay", str(path), "--verify", "--summary-only", "--tokenizer", str(SHIPPED_TOKENIZER)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"verify: {len(noted)}/{len(noted)} episodes replay exactly" in out


def test_export_and_the_viewer_mark_where_segments_start(tmp_path, noted):
    path = write(tmp_path / "notes.jsonl", noted, ENV, NOTES)
    out = io.StringIO()
    export_chat_jsonl(path, out)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    for record, trajectory in zip(records, noted, strict=True):
        starts = [k for k, t in enumerate(trajectory.transitions) if k and t.info.get(SEQUENCE_START)]
        assert record["metadata"]["segment_starts"] == starts and starts
        assert record["metadata"]["context_policy"] == {"policy": "notes", "keep_last": None}
    episode = RecordingIndex(path).episode(0, shipped_renderer())
    flags = [turn["context_rewrite"] for turn in episode["turn_list"]]
    assert flags == [bool(t.info.get(CONTEXT_REWRITE)) for t in noted[0].transitions] and any(flags)


def test_a_wrong_note_demonstrator_fails_and_a_right_one_succeeds():
    trajectories = play(NOTES, oracle=OracleConfig(p_wrong_note=0.5), seeds=range(6), group_size=1)
    outcomes = {t.stop_reason == StopReason.ANSWERED and t.metrics["env"]["accuracy"] for t in trajectories}
    assert outcomes == {0.0, 1.0}
