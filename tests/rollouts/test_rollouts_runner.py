"""The rollout runner on a toy env: oracle play, groups, fault isolation, limits, concurrency."""

import asyncio
import math
import threading
import time

import gymnasium
import pytest
from rollouts_fakes import SETTLING_ENV_ID, TOY_ENV_ID, PerSeedPolicy, TextPolicy, ToyEnv

from toolgym.agents.types import Message
from toolgym.envs import Task, Tool, ToolEnv
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.episodes import trajectory_to_episode
from toolgym.rollouts.metrics import batch_metrics
from toolgym.rollouts.recording.replay import format_transcript, verify_trajectories
from toolgym.rollouts.scripted import OracleConfig, OraclePolicy
from toolgym.rollouts.types import CUT_TURN_STEPPED, StopReason


def config(**kw) -> EnvRolloutConfig:
    base = {"env_id": TOY_ENV_ID, "group_size": 1, "max_turns": 6, "episode_timeout_s": 10.0}
    return EnvRolloutConfig(**{**base, **kw})


def run(policy, renderer, seeds, **kw):
    return RolloutRunner(policy, renderer, config(**kw)).run(seeds)


def test_oracle_episode_is_token_exact(renderer):
    (t,) = run(OraclePolicy(renderer), renderer, [5])
    assert t.stop_reason == StopReason.ANSWERED and t.error is None
    assert t.total_reward == pytest.approx(1.2) and t.reward_components == {"correct": 1.0, "format": 0.2}
    answer = ToyEnv().reset(seed=5)[1]["answer"]
    assert [tr.action.text for tr in t.transitions] == ["LOOKUP[magic]", f"[ANSWER] {answer}"]
    assert t.transitions[0].observation_tokens == renderer.render_prompt(
        [Message("system", "Use LOOKUP[magic]."), Message("user", "What is the magic number?")]
    )
    first, second = t.transitions
    assert first.action.tokens == [*renderer.encode("LOOKUP[magic]"), renderer.im_end_id]
    expected_delta = renderer.render_observation(Message("tool", second.observation), first.action.tokens)
    assert second.observation_tokens == expected_delta
    assert second.observation.startswith("LOOKUP[magic] = ")
    assert t.final_observation == "graded" and t.system_prompt == "Use LOOKUP[magic]."
    assert (
        t.metrics["env"]["accuracy"]
        and t.metrics["env"]["tag_rate"]
        and t.metrics["env"]["tool_calls"] == 1
        and t.metrics["turns"] == 2
    )


def test_groups_have_distinct_sampling_seeds(renderer):
    policy = TextPolicy(renderer, text="[ANSWER] 1")
    trajectories = RolloutRunner(policy, renderer, config(group_size=3)).run([10, 11], group_ids=[7, 8])
    assert [(t.task_seed, t.group_id, t.sample_index) for t in trajectories] == [
        (10, 7, 0), (10, 7, 1), (10, 7, 2), (11, 8, 0), (11, 8, 1), (11, 8, 2),
    ]  # fmt: skip
    seeds = [params.seed for _, params in policy.requests]
    assert len(set(seeds)) == 6
    assert all(p.stop_token_ids == renderer.stop_token_ids for _, p in policy.requests)
    # reproducible: the same config gives the same seeds
    again = TextPolicy(renderer, text="[ANSWER] 1")
    RolloutRunner(again, renderer, config(group_size=3)).run([10, 11])
    assert sorted(p.seed for _, p in again.requests) == sorted(seeds)


def test_episodes_run_concurrently(renderer):
    policy = TextPolicy(renderer, delay=0.01)
    run(policy, renderer, list(range(8)), max_turns=2)
    assert policy.max_in_flight == 8  # all episodes' generate calls are in flight together
    limited = TextPolicy(renderer, delay=0.01)
    run(limited, renderer, list(range(8)), max_turns=2, max_concurrent_episodes=3)
    assert limited.max_in_flight == 3


def test_failing_env_ends_only_its_episode(renderer):
    kwargs = {"fail_reset_seeds": [2], "fail_step_seeds": [3]}
    trajectories = run(OraclePolicy(renderer), renderer, [1, 2, 3, 4], env_kwargs=kwargs)
    by_seed = {t.task_seed: t for t in trajectories}
    assert by_seed[1].stop_reason == by_seed[4].stop_reason == StopReason.ANSWERED
    assert by_seed[2].stop_reason == StopReason.ENV_ERROR and by_seed[2].transitions == []
    assert by_seed[2].error == "RuntimeError: reset exploded"
    broken = by_seed[3]
    assert broken.stop_reason == StopReason.ENV_ERROR and broken.error == "ValueError: tool exploded"
    assert len(broken.transitions) == 2 and broken.transitions[-1].info == {
        "error": "ValueError: tool exploded"
    }
    metrics = batch_metrics(trajectories, elapsed_s=1.0)
    assert metrics["rollout/errors"] == 2.0
    assert metrics["rollout/errors/env_error:RuntimeError"] == 1.0
    assert metrics["rollout/errors/env_error:ValueError"] == 1.0
    assert metrics["rollout/stop_reason/answered"] == 0.5 and metrics["rollout/accuracy"] == 0.5


@pytest.mark.parametrize(
    ("turn", "field", "value", "error"),
    [
        (0, "observation", "size=\udcff7", "reset observation is not encodable text (surrogates not allowed"),
        (0, "observation", 7, "reset observation must be a str, got int 7"),
        (0, "system_prompt", b"x", "info['system_prompt'] must be a str, got bytes b'x'"),
        (0, "info", None, "reset info must be a dict, got NoneType None"),
        (1, "observation", "size=\udcff7", "observation is not encodable text"),
        (1, "observation", None, "observation must be a str, got NoneType None"),
        (2, "observation", ["graded"], "observation must be a str, got list"),  # a final one, too
        (2, "reward", None, "reward must be a finite number, got None"),
        (2, "reward", "1.2", "reward must be a finite number, got '1.2'"),
        (2, "reward", math.nan, "reward must be a finite number, got nan"),
        (2, "reward", -math.inf, "reward must be a finite number, got -inf"),
        (
            2,
            "reward",
            1e308,
            "reward must be within ±1e+30 (beyond, its group's advantages overflow), got 1e+308",
        ),
        (2, "reward", -1e308, "reward must be within ±1e+30"),
        (
            2,
            "reward_components",
            {"correct": 1e300},
            "info['reward_components']['correct'] must be within ±1e+30",
        ),
        (
            2,
            "reward_components",
            {"correct": math.inf},
            "info['reward_components']['correct'] must be a finite",
        ),
        (2, "terminated", None, "terminated must be a bool, got NoneType None"),
        (2, "info", [("turn", 2)], "info must be a dict, got list"),
        (
            2,
            "reward_components",
            {"correct": None},
            "info['reward_components']['correct'] must be a finite number",
        ),
        (2, "reward_components", [1.0], "info['reward_components'] must map names to numbers, got [1.0]"),
    ],
)
def test_an_unusable_env_output_ends_only_its_episode(renderer, turn, field, value, error):
    kwargs = {"bad_outputs": {2: (turn, field, value)}}
    trajectories = run(OraclePolicy(renderer), renderer, [1, 2, 3], env_kwargs=kwargs)
    by_seed = {t.task_seed: t for t in trajectories}
    assert by_seed[1].stop_reason == by_seed[3].stop_reason == StopReason.ANSWERED
    broken = by_seed[2]
    assert broken.stop_reason == StopReason.ENV_ERROR
    assert broken.error.startswith("EnvOutputError: " + error), broken.error
    assert len(broken.transitions) == turn and broken.total_reward == 0.0
    if turn:  # the bad step keeps none of its outputs
        assert broken.transitions[-1].info == {"error": broken.error} and broken.transitions[-1].reward == 0.0
        earlier = {"correct": 0.0, "format": 0.0} if turn == 2 else {}  # what the good steps said
        assert broken.final_observation == "" and broken.reward_components == earlier
    assert batch_metrics(trajectories)["rollout/errors/env_error:EnvOutputError"] == 1.0


def test_an_info_with_numpy_values_is_kept_as_json_and_records(renderer, tmp_path):
    from toolgym.rollouts.recording.format import RecordingHeader, RecordingWriter, read_recording

    kwargs = {"numpy_info": True}
    (t,) = run(OraclePolicy(renderer), renderer, [1], env_kwargs=kwargs)
    assert (
        t.stop_reason == StopReason.ANSWERED
        and t.metrics["env"]["tool_calls"] == 1
        and t.metrics["env"]["accuracy"]
    )
    info = t.transitions[-1].info
    assert info["scores"] == [0.0, 0.5, 1.0] and info["flag"] is True and info["handle"] == "Handle()"
    assert type(info["tool_calls"]) is int and info["at"] == [1, 2]
    assert t.reward_components == {"correct": 1.0, "format": pytest.approx(0.2)}  # float32 0.2, as a float
    path = tmp_path / "r.jsonl"
    header = RecordingHeader(tokenizer_fingerprint="fp", env_id=TOY_ENV_ID, env_kwargs=kwargs)
    with RecordingWriter(path, header) as writer:
        writer.write(t)
    assert read_recording(path, "fp")[1] == [t]
    assert verify_trajectories([t], renderer) == []
    # what JSON cannot hold even so is the env's error, in its own episode
    looped = {}
    looped["self"] = looped
    bad = {"bad_outputs": {2: (1, "info", looped)}}
    by_seed = {t.task_seed: t for t in run(OraclePolicy(renderer), renderer, [1, 2], env_kwargs=bad)}
    assert by_seed[1].stop_reason == StopReason.ANSWERED and by_seed[2].stop_reason == StopReason.ENV_ERROR
    assert by_seed[2].error.startswith("EnvOutputError: info cannot be recorded as JSON (")


def test_a_text_the_renderer_cannot_encode_ends_only_its_episode(renderer, monkeypatch):
    render = renderer.render_observation

    def picky(message, previous):
        if "=" in message.content:
            raise RuntimeError("no room for this")
        return render(message, previous)

    monkeypatch.setattr(renderer, "render_observation", picky)
    (t,) = run(OraclePolicy(renderer), renderer, [1])
    assert t.stop_reason == StopReason.ENV_ERROR and len(t.transitions) == 1
    assert (
        t.error
        == "EnvOutputError: the renderer cannot encode the env's text (RuntimeError: no room for this)"
    )


def test_generation_error_and_timeout_end_only_their_episode(renderer):
    ok = TextPolicy(renderer, text="[ANSWER] 1")
    policy = PerSeedPolicy(ok, {2: TextPolicy(renderer, fail=True), 3: TextPolicy(renderer, delay=30.0)})
    trajectories = run(policy, renderer, [1, 2, 3, 4], episode_timeout_s=0.5)
    reasons = {t.task_seed: t.stop_reason for t in trajectories}
    assert reasons == {1: "answered", 2: "timeout", 3: "timeout", 4: "answered"}
    assert trajectories[1].error == "RuntimeError: CUDA fell over"
    assert "wall-clock" in trajectories[2].error


def test_oracle_knobs_go_through_the_env(renderer):
    untagged = OraclePolicy(renderer, OracleConfig(p_omit_tag=1.0))
    (t,) = run(untagged, renderer, [5])
    assert (
        t.transitions[-1].action.text.startswith("The answer is ")
        and t.transitions[-1].info["failure_mode"] == "wrong_format"
    )
    assert t.metrics["env"]["accuracy"] and not t.metrics["env"]["tag_rate"]
    (t,) = run(OraclePolicy(renderer, OracleConfig(p_skip_lookup=1.0)), renderer, [5])
    assert len(t.transitions) == 1 and t.transitions[0].info["failure_mode"] == "wrong_answer"
    (t,) = run(OraclePolicy(renderer, OracleConfig(p_malformed_call=1.0)), renderer, [5])
    assert [tr.action.text for tr in t.transitions][:2] == ["LOOKUP(magic)", "LOOKUP[magic]"]
    assert t.metrics["env"]["env_errors"] == 1 and t.stop_reason == StopReason.ANSWERED


@pytest.mark.parametrize(
    ("kw", "text", "reason", "turns"),
    [
        ({"max_turns": 3}, "hmm", StopReason.MAX_TURNS, 3),  # the runner's limit
        ({"env_kwargs": {"max_turns": 2}}, "hmm", StopReason.MAX_TURNS, 2),  # the env's own limit
        ({"max_tokens_per_turn": 3}, "LOOKUP[magic]", StopReason.MAX_TOKENS, 1),
    ],
)
def test_limits(renderer, kw, text, reason, turns):
    (t,) = run(TextPolicy(renderer, text=text), renderer, [1], **kw)
    assert t.stop_reason == reason and len(t.transitions) == turns and t.error is None


ZORPLEX = {"env_id": "toolgym/Zorplex-v0", "group_size": 1, "episode_timeout_s": 10.0}


def zorplex_run(renderer, text, env_kwargs, **kw):
    cfg = EnvRolloutConfig(**{**ZORPLEX, "env_kwargs": {"incorrect_reward": -1.0, **env_kwargs}, **kw})
    (t,) = RolloutRunner(TextPolicy(renderer, text=text), renderer, cfg).run([0])
    assert t.total_reward == sum(tr.reward for tr in t.transitions)
    assert t.total_reward == pytest.approx(sum(t.reward_components.values()))
    assert verify_trajectories([t], renderer) == []
    return t


def test_an_unanswered_episode_scores_the_same_whichever_limit_ends_it(renderer):
    call = "LOOKUP[apple]"  # one call is needed, each of the 3 more costs 0.1
    k = len(renderer.encode(call)) + 1
    own = zorplex_run(renderer, call, {"max_turns": 4}, max_turns=8)  # the env's turn limit
    assert own.stop_reason == StopReason.MAX_TURNS and own.transitions[-1].truncated
    runner_turns = zorplex_run(renderer, call, {"max_turns": 6}, max_turns=4)
    episode_budget = zorplex_run(renderer, call, {"max_turns": 6}, max_tokens_per_episode=4 * k)
    assert runner_turns.stop_reason == StopReason.MAX_TURNS
    assert episode_budget.stop_reason == StopReason.MAX_TOKENS
    for t in (own, runner_turns, episode_budget):
        assert len(t.transitions) == 4 and t.total_reward == pytest.approx(-1.3)
        assert t.reward_components == own.reward_components and t.reward_components["correct"] == -1.0
        assert [tr.reward for tr in t.transitions] == [tr.reward for tr in own.transitions]
        assert t.transitions[-1].info["failure_mode"] == "no_answer" and t.metrics["env"]["tool_calls"] == 4
    assert "end_reason" not in runner_turns.transitions[-1].info  # the runner's reason is its own


def test_a_turn_cut_by_a_token_or_context_limit_is_settled(renderer):
    ramble = "let me think " * 40
    cut = zorplex_run(renderer, ramble, {}, max_tokens_per_turn=16)
    assert cut.stop_reason == StopReason.MAX_TOKENS and cut.transitions[-1].action.finish_reason == "length"
    assert cut.total_reward == -1.0 and cut.reward_components["correct"] == -1.0
    assert (
        cut.transitions[-1].info["failure_mode"] == "no_answer" and cut.metrics["failure_mode"] == "no_answer"
    )
    prompt = len(cut.transitions[0].observation_tokens)
    overflow = zorplex_run(renderer, ramble, {}, context_length=prompt + 2)
    assert overflow.stop_reason == StopReason.CONTEXT_OVERFLOW and overflow.total_reward == -1.0
    nothing = zorplex_run(renderer, ramble, {}, context_length=prompt)  # no turn to carry a reward
    assert nothing.stop_reason == StopReason.CONTEXT_OVERFLOW and nothing.transitions == []
    assert nothing.total_reward == 0.0 and nothing.reward_components == {}


class SlowSecondTurn(TextPolicy):
    """Answers turn 0 at once, then hangs (a stuck generation the wall clock cuts)."""

    async def generate(self, prompts, params):
        if self.requests:
            await asyncio.sleep(30)
        return await super().generate(prompts, params)


def test_infrastructure_failures_are_not_settled(renderer):
    kwargs = {"fail_step_seeds": [2]}
    trajectories = run(OraclePolicy(renderer), renderer, [1, 2], env_id=SETTLING_ENV_ID, env_kwargs=kwargs)
    assert [t.stop_reason for t in trajectories] == [StopReason.ANSWERED, StopReason.ENV_ERROR]
    assert trajectories[1].total_reward == 0.0 and "failure_mode" not in trajectories[1].transitions[-1].info
    (t,) = run(SlowSecondTurn(renderer), renderer, [1], env_id=SETTLING_ENV_ID, episode_timeout_s=0.5)
    assert t.stop_reason == StopReason.TIMEOUT and len(t.transitions) == 1 and t.total_reward == 0.0
    assert t.reward_components == {"correct": 0.0, "format": 0.0}
    cut = run(TextPolicy(renderer, text="hmm"), renderer, [1], env_id=SETTLING_ENV_ID, max_turns=3)[0]
    assert cut.stop_reason == StopReason.MAX_TURNS and cut.total_reward == -1.0  # the same env, cut


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"abandon_fails": True}, "RuntimeError: abandon exploded"),
        (
            {"abandon_output": (math.nan, {})},
            "EnvOutputError: abandon() reward must be a finite number, got nan",
        ),
        (
            {"abandon_output": (-1.0, None)},
            "EnvOutputError: abandon() info must be a dict, got NoneType None",
        ),
    ],
)
def test_a_failing_abandon_is_an_env_error_of_its_episode(renderer, kwargs, error):
    policy = PerSeedPolicy(TextPolicy(renderer, text="[ANSWER] 1"), {2: TextPolicy(renderer, text="hmm")})
    trajectories = run(policy, renderer, [1, 2, 3], env_id=SETTLING_ENV_ID, env_kwargs=kwargs, max_turns=3)
    assert [t.stop_reason for t in trajectories] == ["answered", "env_error", "answered"]
    broken = trajectories[1]
    assert broken.error == error and broken.transitions[-1].info["abandon_error"] == error
    assert broken.total_reward == 0.0 and len(broken.transitions) == 3
    assert verify_trajectories(trajectories, renderer) == []


def test_token_budget_limits(renderer):
    k = len(renderer.encode("LOOKUP[magic]")) + 1
    # episode budget of exactly two turns: the third turn has no budget left
    (t,) = run(TextPolicy(renderer), renderer, [1], max_tokens_per_episode=2 * k)
    assert t.stop_reason == StopReason.MAX_TOKENS and len(t.transitions) == 2
    assert t.final_observation.startswith("LOOKUP[magic] = ")
    # a budget that runs out inside turn 2: that turn is cut (finish "length") and not stepped
    (t,) = run(TextPolicy(renderer), renderer, [1], max_tokens_per_episode=2 * k - 2)
    assert t.stop_reason == StopReason.MAX_TOKENS and t.transitions[-1].action.finish_reason == "length"
    assert t.transitions[-1].info == {} and t.metrics["sampled_tokens"] == 2 * k - 2


def test_cut_turn_step_gives_a_cut_turn_to_the_env_and_closes_it_unsampled(renderer):
    k = len(renderer.encode("LOOKUP[magic]")) + 1  # the text, then <|im_end|>, which the cut drops
    (t,) = run(TextPolicy(renderer), renderer, [1], max_tokens_per_turn=k - 1, max_turns=3, cut_turn="step")
    assert t.stop_reason == StopReason.MAX_TURNS and len(t.transitions) == 3
    assert all(tr.action.finish_reason == "length" and tr.info[CUT_TURN_STEPPED] for tr in t.transitions)
    assert t.transitions[1].observation.startswith("LOOKUP[magic] = ")  # the env answered the cut call
    assert t.transitions[1].observation_tokens[0] == renderer.im_end_id  # the renderer closed the turn
    assert verify_trajectories([t], renderer) == []
    episode = trajectory_to_episode(t, 1.0)
    assert episode is not None
    closes = [i for i, tok in enumerate(episode.tokens) if tok == renderer.im_end_id and i > 0]
    assert closes and all(episode.loss_mask[i] == 0 for i in closes)  # never sampled, never trained
    assert sum(episode.loss_mask) == 3 * (k - 1)
    # the episode budget still ends the episode, after stepping its last cut turn
    budget = {"max_tokens_per_turn": k - 1, "max_tokens_per_episode": 2 * (k - 1), "cut_turn": "step"}
    (t,) = run(TextPolicy(renderer), renderer, [1], **budget)
    assert t.stop_reason == StopReason.MAX_TOKENS and len(t.transitions) == 2
    assert t.final_observation.startswith("LOOKUP[magic] = ") and verify_trajectories([t], renderer) == []
    assert "not given to the env" not in format_transcript(t, renderer)
    # a turn the context room cut ends the episode: the env's reply would not fit
    prompt = len(t.transitions[0].observation_tokens)
    (t,) = run(TextPolicy(renderer), renderer, [1], context_length=prompt + 2, cut_turn="step")
    assert t.stop_reason == StopReason.CONTEXT_OVERFLOW and CUT_TURN_STEPPED not in t.transitions[0].info


def test_context_limits(renderer):
    prompt = len(
        renderer.render_prompt(
            [Message("system", "Use LOOKUP[magic]."), Message("user", "What is the magic number?")]
        )
    )
    k = len(renderer.encode("LOOKUP[magic]")) + 1
    # room for turn 0 but not for the delta after it
    (t,) = run(TextPolicy(renderer), renderer, [1], context_length=prompt + k + 3)
    assert t.stop_reason == StopReason.CONTEXT_OVERFLOW and len(t.transitions) == 1
    # the context room, not a token budget, cuts turn 0
    (t,) = run(TextPolicy(renderer), renderer, [1], context_length=prompt + 2)
    assert t.stop_reason == StopReason.CONTEXT_OVERFLOW and t.transitions[0].action.tokens.__len__() == 2
    # the prompt itself does not fit
    (t,) = run(TextPolicy(renderer), renderer, [1], context_length=prompt)
    assert t.stop_reason == StopReason.CONTEXT_OVERFLOW and t.transitions == []


def test_context_length_from_policy(renderer):
    policy = TextPolicy(renderer)
    policy.max_seq_len = 5
    (t,) = run(policy, renderer, [1])
    assert t.stop_reason == StopReason.CONTEXT_OVERFLOW


def test_run_groups_calls_back_per_episode(renderer):
    seen = []
    runner = RolloutRunner(TextPolicy(renderer, text="[ANSWER] 1"), renderer, config(group_size=2))
    out = asyncio.run(runner.run_groups([1, 2], on_episode=seen.append))
    assert sorted(id(t) for t in seen) == sorted(id(t) for t in out)


def test_config_validation():
    with pytest.raises(ValueError, match="group_size"):
        EnvRolloutConfig(env_id="x", group_size=0)
    with pytest.raises(ValueError, match="episode_timeout_s"):
        EnvRolloutConfig(env_id="x", episode_timeout_s=0)


# ---- envs whose step waits on something outside the process (a sandbox, a server) -----------

_MEETING: dict[str, object] = {}  # the barrier / event the current test's tools wait on
_CLOSED: list[int] = []  # task seeds of the WaitingEnv episodes closed so far


class WaitingEnv(ToolEnv):
    """One tool, MEET, whose call waits (`waits=True`) on a threading barrier or event."""

    def __init__(self, **knobs):
        self._seed = None
        meet = Tool("MEET", "wait for the others", self.meet, arg="who", waits=True)
        super().__init__(tools=[meet], instructions="Meet, then answer.", **knobs)

    def meet(self, who: str) -> str:
        waiting = _MEETING["on"]
        if isinstance(waiting, threading.Barrier):
            waiting.wait(timeout=5)  # BrokenBarrierError unless every episode's step is in flight
        else:
            assert isinstance(waiting, threading.Event) and waiting.wait(timeout=5)
        return "met"

    def new_task(self) -> Task:
        return Task("Meet everyone.", 1, ("MEET[x]",))

    def close(self):
        if self._seed is not None:
            _CLOSED.append(self._seed)
        super().close()

    def reset(self, *, seed=None, options=None):
        self._seed = seed
        return super().reset(seed=seed, options=options)


gymnasium.register(id="toolgym-test/Waiting-v0", entry_point=WaitingEnv, disable_env_checker=True)


def test_a_waiting_tool_call_does_not_hold_up_the_other_episodes(renderer):
    assert gymnasium.make("toolgym-test/Waiting-v0").unwrapped.step_waits
    _MEETING["on"] = threading.Barrier(4)  # met only if all four steps wait at once
    trajectories = run(
        TextPolicy(renderer, text="MEET[x]"), renderer, [1, 2, 3, 4], env_id="toolgym-test/Waiting-v0"
    )
    observations = [t.transitions[0].info.get("tool_results") or t.final_observation for t in trajectories]
    assert all("met" in str(o) and "rror" not in str(o) for o in observations), observations


def test_a_timeout_mid_step_keeps_the_episode_and_closes_the_env_after_the_step(renderer):
    _CLOSED.clear()
    _MEETING["on"] = event = threading.Event()
    (t,) = run(
        TextPolicy(renderer, text="MEET[x]"),
        renderer,
        [7],
        env_id="toolgym-test/Waiting-v0",
        episode_timeout_s=0.3,
    )
    assert t.stop_reason == StopReason.TIMEOUT and len(t.transitions) == 1 and t.transitions[0].reward == 0.0
    assert _CLOSED == []  # the step is still waiting: the env is not closed under it
    event.set()
    for _ in range(100):
        if _CLOSED:
            break
        time.sleep(0.02)
    assert _CLOSED == [7]
