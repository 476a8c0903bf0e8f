"""Replay: record -> verify round trip, tamper detection, transcripts, Episodes from a file."""

import asyncio

import msgspec
import pytest
from rollouts_fakes import TOY_ENV_ID, TextPolicy

from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.recorded import replay_episode
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.evaluation import EvalConfig, evaluate_sync, pick_examples
from toolgym.rollouts.recording.format import (
    SCORING,
    RecordingError,
    RecordingHeader,
    RecordingWriter,
    read_recording,
    recorded_scoring,
    scoring_entry,
)
from toolgym.rollouts.recording.replay import (
    OfflineMode,
    format_transcript,
    rich_transcript,
    summarize,
    verify_trajectories,
    verify_trajectory,
)
from toolgym.rollouts.scoring.advantages import AdvantageConfig, AdvantageEstimator, Credit
from toolgym.rollouts.scripted import OracleConfig, OraclePolicy
from toolgym.rollouts.types import StopReason

KNOBS = OracleConfig(p_omit_tag=0.3, p_skip_lookup=0.2, p_malformed_call=0.3)


def record(
    renderer,
    tmp_path,
    env_id="toolgym/Zorplex-v0",
    env_kwargs=None,
    policy=None,
    seeds=range(6),
    extra=None,
    **kw,
):
    env_kwargs = {"tier": "compositional"} if env_kwargs is None else env_kwargs
    config = EnvRolloutConfig(env_id=env_id, env_kwargs=env_kwargs, group_size=2, **{"max_turns": 8, **kw})
    policy = policy or OraclePolicy(renderer, KNOBS)
    trajectories = RolloutRunner(policy, renderer, config).run(list(seeds))
    path = tmp_path / f"rec{len(list(tmp_path.iterdir()))}.jsonl"
    header = RecordingHeader(tokenizer_fingerprint="fp", env_id=env_id, env_kwargs=env_kwargs, extra=extra or {})
    with RecordingWriter(path, header) as w:
        w.write_all(trajectories)
    return path, trajectories


def test_record_replay_verify_round_trip_is_exact(renderer, tmp_path):
    path, recorded = record(renderer, tmp_path)
    _, trajectories = read_recording(path, "fp")
    assert trajectories == recorded
    assert verify_trajectories(trajectories, renderer) == []
    modes = {t.transitions[-1].info.get("failure_mode") for t in trajectories}
    assert len(modes) >= 2  # the knobs made a mix of behaviours, all of which replay


def test_verify_reports_tampering(renderer, tmp_path):
    _, (t, *_) = record(renderer, tmp_path, seeds=[0])
    bad = msgspec.structs.replace(t, task_seed=t.task_seed + 1)
    assert any("observation differs" in p or "reward differs" in p for p in verify_trajectory(bad))
    t2 = msgspec.convert(msgspec.to_builtins(t), type(t))
    t2.transitions[-1].reward += 0.5
    assert [p for p in verify_trajectory(t2) if "reward differs" in p]
    t3 = msgspec.convert(msgspec.to_builtins(t), type(t))
    t3.final_observation = "something else"
    assert [p for p in verify_trajectory(t3) if "observation differs" in p]


def replace_field(t, **changes):
    copy = msgspec.convert(msgspec.to_builtins(t), type(t))
    for name, value in changes.items():
        setattr(copy, name, value)
    return copy


def test_verify_checks_the_fields_training_reads(renderer, tmp_path):
    _, (t, *_) = record(renderer, tmp_path, policy=OraclePolicy(renderer), seeds=[0])
    assert t.stop_reason == StopReason.ANSWERED and verify_trajectory(t) == []
    assert verify_trajectory(replace_field(t, total_reward=-5.0)) == [
        f"total_reward -5.0 != the sum of its step rewards {t.total_reward!r}",
        f"total_reward -5.0 != the re-run's {t.total_reward!r}",
    ]
    stepped = replace_field(t)  # the steps and the total agree with each other, not with the env
    stepped.transitions[-1].reward -= 1.0
    stepped.total_reward -= 1.0
    assert [p for p in verify_trajectory(stepped) if "the re-run's" in p]
    assert verify_trajectory(replace_field(t, stop_reason=StopReason.TIMEOUT)) == [
        "stop_reason timeout != answered, how the env ended the re-run"
    ]
    components = verify_trajectory(replace_field(t, reward_components={"correct": 0.0}))
    assert len(components) == 1 and components[0].startswith("reward_components differ: {'correct': 0.0}")


def test_verify_checks_the_stop_reason_of_episodes_the_runner_ended(renderer, tmp_path):
    kwargs = {"incorrect_reward": -1.0}
    policy = TextPolicy(renderer, "hmm " * 40)
    _, (cut, _) = record(
        renderer, tmp_path, "toolgym/SumDigits-v0", kwargs, policy, [0], max_tokens_per_turn=16
    )
    assert cut.stop_reason == StopReason.MAX_TOKENS and cut.total_reward == -1.0
    assert verify_trajectory(cut) == []
    # (the runner would not have settled an episode with these reasons, so the totals differ too)
    answered = verify_trajectory(replace_field(cut, stop_reason=StopReason.ANSWERED))
    assert "stop_reason answered, but the env did not end the re-run" in answered
    timeout = verify_trajectory(replace_field(cut, stop_reason=StopReason.TIMEOUT))
    assert "stop_reason timeout, but the last turn was cut (length)" in timeout
    ended = replace_field(cut)  # a cut turn never reached the env, so the env never ended there
    ended.transitions[-1].terminated = True
    flags = "turn 0: (terminated, truncated) differs: (False, False) != (True, False)"
    assert flags in verify_trajectory(ended)
    unsettled = replace_field(cut, total_reward=0.0, reward_components={})  # as recorded before abandon()
    unsettled.transitions[-1].reward = 0.0
    problems = verify_trajectory(unsettled)
    assert problems[:2] == ["turn 0: reward differs: -1.0 != 0.0", "total_reward 0.0 != the re-run's -1.0"]
    assert len(problems) == 3 and problems[2].startswith("reward_components differ: {} != the re-run's")


ENDINGS = [
    {},
    {"max_tokens_per_turn": 6},
    {"max_tokens_per_episode": 15},
    {"context_length": 150},
    {"max_turns": 2},
]


@pytest.mark.parametrize("limits", ENDINGS)
@pytest.mark.parametrize(
    ("env_id", "env_kwargs"),
    [
        ("toolgym/Zorplex-v0", {"tier": "compositional", "incorrect_reward": -1.0}),
        ("toolgym/Zorplex-v0", {"tier": "recursive"}),
        ("toolgym/SumDigits-v0", {"max_turns": 3, "incorrect_reward": -1.0}),
    ],
)
def test_verify_accepts_every_way_the_runner_ends_an_episode(renderer, tmp_path, env_id, env_kwargs, limits):
    _, trajectories = record(renderer, tmp_path, env_id, env_kwargs, seeds=range(4), **limits)
    assert verify_trajectories(trajectories, renderer) == []


@pytest.mark.parametrize("limits", [{}, {"max_tokens_per_turn": 6}, {"max_turns": 2}])
def test_replay_runs_the_recorded_actions_through_the_runners_episode_loop(renderer, tmp_path, limits):
    """The re-run is the episode loop's own: the same steps, rewards (a settlement included), end
    flags, infos, stop reason and final observation as the recording."""
    env_kwargs = {"tier": "compositional", "incorrect_reward": -1.0}
    _, trajectories = record(renderer, tmp_path, "toolgym/Zorplex-v0", env_kwargs, seeds=range(3), **limits)
    settled = []
    for t in trajectories:
        rerun, actor = replay_episode(t)
        assert actor.reset == (t.transitions[0].observation, t.system_prompt)
        turns = [
            (tr.observation, tr.action, tr.reward, tr.terminated, tr.truncated, tr.info)
            for tr in t.transitions
        ]
        again = [
            (tr.observation, tr.action, tr.reward, tr.terminated, tr.truncated, tr.info)
            for tr in rerun.transitions
        ]
        assert again == turns
        assert (rerun.stop_reason, rerun.final_observation) == (t.stop_reason, t.final_observation)
        assert rerun.reward_components == t.reward_components
        settled.append(rerun.settled)
    assert any(settled) == bool(limits)  # the runner's limits cut some episodes, which the env settled


class Stalls(TextPolicy):
    """Turn 0 at once; then `how`: hang past the wall clock, or come back aborted."""

    def __init__(self, renderer, how):
        super().__init__(renderer)
        self.how = how

    async def generate(self, prompts, params):
        out = await super().generate(prompts, params)
        if len(self.requests) > 1 and self.how == "hang":
            await asyncio.sleep(30)
        if len(self.requests) > 1 and self.how == "abort":
            out[0].finish_reason = "abort"
        return out


@pytest.mark.parametrize("how", ["hang", "abort"])
def test_verify_accepts_timeouts(renderer, tmp_path, how):
    env_kwargs = {"incorrect_reward": -1.0}
    policy = Stalls(renderer, how)
    _, trajectories = record(
        renderer, tmp_path, "toolgym/Zorplex-v0", env_kwargs, policy, [0], episode_timeout_s=0.5
    )
    assert {t.stop_reason for t in trajectories} == {StopReason.TIMEOUT}
    assert trajectories[0].total_reward == 0.0  # a timeout is not settled
    assert verify_trajectories(trajectories, renderer) == []


def test_verify_handles_cut_turns_and_env_errors(renderer, tmp_path):
    _, cut = record(
        renderer, tmp_path, TOY_ENV_ID, {}, TextPolicy(renderer), seeds=[1], max_tokens_per_turn=3
    )
    assert cut[0].stop_reason == StopReason.MAX_TOKENS and verify_trajectories(cut, renderer) == []
    kwargs = {"fail_step_seeds": [2], "fail_reset_seeds": [3]}
    _, failed = record(renderer, tmp_path, TOY_ENV_ID, kwargs, OraclePolicy(renderer), seeds=[2, 3])
    assert {t.stop_reason for t in failed} == {StopReason.ENV_ERROR}
    assert verify_trajectories(failed, renderer) == []
    kwargs = {"bad_outputs": {4: (2, "reward", None), 5: (0, "observation", None)}}
    _, unusable = record(renderer, tmp_path, TOY_ENV_ID, kwargs, OraclePolicy(renderer), seeds=[4, 5])
    assert {t.stop_reason for t in unusable} == {StopReason.ENV_ERROR}
    assert verify_trajectories(unusable, renderer) == []


def test_transcript_marks_sampled_spans(renderer, tmp_path):
    _, (t, *_) = record(renderer, tmp_path, policy=OraclePolicy(renderer), seeds=[0])
    text = format_transcript(t, renderer)
    first_call = t.transitions[0].action.text
    assert f"⟦{first_call}<|im_end|>⟧" in text
    assert "<|im_start|>user\n" + t.transitions[0].observation in text
    assert "stop: answered" in text and "failure mode: success" in text and "[turn 0: reward" in text
    rich = rich_transcript(t, renderer)
    assert rich.plain == text.replace("⟦", "").replace("⟧", "")
    assert any(span.style == "bold green" for span in rich.spans)


def test_summary(renderer, tmp_path):
    _, trajectories = record(renderer, tmp_path, policy=OraclePolicy(renderer, OracleConfig(p_omit_tag=1.0)))
    summary = summarize(trajectories)
    assert summary["accuracy"] == 1.0 and summary["tag_rate"] == 0.0 and summary["episodes"] == 12
    assert summary["failure_mode/wrong_format"] == 1.0 and summary["stop_reason/answered"] == 1.0
    assert summary["tool_calls"] >= 2


def test_episodes_from_recording(renderer, tmp_path):
    from toolgym.rollouts.recording.replay import episodes_from_trajectories

    run_config = AdvantageConfig(estimator=AdvantageEstimator.DR_GRPO)
    extra = {SCORING: scoring_entry(run_config, {"name": "grpo"}, train_on_infra_failures=False)}
    policy = OraclePolicy(renderer, OracleConfig(p_skip_lookup=0.5))
    path, _ = record(renderer, tmp_path, policy=policy, extra=extra)
    header, trajectories = read_recording(path, "fp")
    sft, stats = episodes_from_trajectories(trajectories, OfflineMode.SFT, only_successful=True)
    successes = [t for t in trajectories if t.metrics["failure_mode"] == "success"]
    assert 0 < len(sft) == len(successes) == stats.built < len(trajectories)
    assert all(a == 1.0 for e in sft for a, m in zip(e.advantages, e.loss_mask, strict=True) if m)
    with pytest.raises(ValueError, match="needs the advantage config"):  # no silent default
        episodes_from_trajectories(trajectories, OfflineMode.PG)
    scoring = recorded_scoring(header)
    assert scoring is not None and scoring.advantage == run_config and scoring.loss == {"name": "grpo"}
    pg, _ = episodes_from_trajectories(trajectories, OfflineMode.PG, scoring.advantage)
    assert len(pg) == len(trajectories)
    by_group = {}
    for e in pg:
        by_group.setdefault(e.group_id, []).append(e.advantages[-1])
    for advs in by_group.values():
        assert sum(advs) == pytest.approx(0.0, abs=1e-9)  # mean-centred per recorded group


def test_evaluate_uses_heldout_seeds_greedily(renderer):
    policy = TextPolicy(renderer, text="[ANSWER] 3")
    rollout = EnvRolloutConfig(env_id="toolgym/Zorplex-v0", env_kwargs={"tier": "simple"}, group_size=4)
    report = evaluate_sync(policy, renderer, rollout, EvalConfig(num_tasks=5, num_examples=2))
    assert sorted(t.task_seed for t in report.trajectories) == [0, 1, 2, 3, 4]
    assert all(p.temperature == 0.0 for _, p in policy.requests) and len(policy.requests) == 5
    assert report.metrics["eval/episodes"] == 5.0 and len(report.examples) == 2
    oracle = evaluate_sync(OraclePolicy(renderer), renderer, rollout, EvalConfig(num_tasks=4))
    assert oracle.metrics["eval/accuracy"] == 1.0 and oracle.metrics["eval/tag_rate"] == 1.0


def test_pick_examples_prefers_distinct_failure_modes(renderer, tmp_path):
    _, trajectories = record(renderer, tmp_path, seeds=range(10))
    picked = pick_examples(trajectories, 3)
    modes = [t.metrics["failure_mode"] for t in picked]
    assert len(picked) == 3 and len(set(modes)) == min(
        3, len({t.metrics["failure_mode"] for t in trajectories})
    )


def test_verify_with_a_renderer_checks_tokens_against_text(renderer, tmp_path):
    from toolgym.rollouts.recording.replay import verify_tokens

    _, trajectories = record(renderer, tmp_path, policy=OraclePolicy(renderer), seeds=[0])
    assert len(trajectories) == 2 and all(len(t.transitions) >= 2 for t in trajectories)
    assert [verify_tokens(t, renderer) for t in trajectories] == [[], []]
    # the user role: the same episode rendered with rollout.observation_role = "user" checks too
    _, (as_user, *_) = record(
        renderer, tmp_path, policy=OraclePolicy(renderer), seeds=[0], observation_role="user"
    )
    assert verify_tokens(as_user, renderer) == []
    t = trajectories[0]
    trained = replace_field(t)  # the tokens training reads say something the env never graded
    trained.transitions[0].action.tokens = [*renderer.encode("[ANSWER] 7"), renderer.im_end_id]
    trained.transitions[0].action.logprobs = [0.0] * len(trained.transitions[0].action.tokens)
    assert verify_trajectory(trained) == []  # the env side alone cannot see it
    assert verify_tokens(trained, renderer) == [
        f"turn 0: action tokens decode to '[ANSWER] 7', not the recorded {t.transitions[0].action.text!r}"
    ]
    shown = replace_field(t)  # the model was shown another prompt than the recorded observation
    shown.transitions[0].observation_tokens = shown.transitions[0].observation_tokens[:-3]
    assert verify_tokens(shown, renderer) == ["turn 0: observation tokens are not the rendered prompt"]
    # an id the tokenizer lacks decodes to "" (the model's embedding may be larger: Qwen pads it)
    broken = replace_field(t)
    broken.transitions[-1].action.tokens = [10**9]
    broken.transitions[-1].action.logprobs = [0.0]
    last = len(t.transitions) - 1
    assert verify_tokens(broken, renderer) == [
        f"turn {last}: action tokens decode to '', not the recorded {t.transitions[last].action.text!r}"
    ]
    assert [i for i, _, _ in verify_trajectories([t, trained, shown], renderer)] == [1, 2]


def test_the_header_records_the_run_scoring_and_an_old_one_says_nothing(renderer, tmp_path):
    config = AdvantageConfig(estimator=AdvantageEstimator.DR_GRPO, credit=Credit.TURN_STATE)
    entry = scoring_entry(config, {"name": "cispo", "tis_cap": 2.0}, train_on_infra_failures=True)
    path, _ = record(renderer, tmp_path, seeds=[0], extra={SCORING: entry})
    scoring = recorded_scoring(read_recording(path, "fp")[0])  # through the JSON file and back
    assert scoring is not None and scoring.advantage == config and scoring.train_on_infra_failures
    assert scoring.loss == {"name": "cispo", "tis_cap": 2.0}
    old, _ = record(renderer, tmp_path, seeds=[0])
    assert recorded_scoring(read_recording(old, "fp")[0]) is None
    bad = RecordingHeader("fp", "toolgym/Zorplex-v0", extra={SCORING: {"advantage": {"gamma": 2.0}}})
    with pytest.raises(RecordingError, match="not a scoring entry"):
        recorded_scoring(bad, "x.jsonl")
