"""Episode metrics read the env's metrics (info["metrics"]) from the last transition that reports them."""

import pytest
from rollouts_fakes import TOY_ENV_ID, TextPolicy

from toolgym.agents.types import Completion
from toolgym.rollouts.env_io import EnvOutputError, step_env
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.metrics import RewardComponentSeries, batch_metrics, env_metric_names, episode_metrics
from toolgym.rollouts.recording.replay import summarize
from toolgym.rollouts.types import StopReason, Trajectory, Transition


class Script(TextPolicy):
    """Says texts[turn] on each turn (the last one again after that)."""

    def __init__(self, renderer, texts):
        super().__init__(renderer)
        self.texts = texts

    async def generate(self, prompts, params):
        self.text = self.texts[min(len(self.requests), len(self.texts) - 1)]
        return await super().generate(prompts, params)


def toy_run(renderer, texts, **kw):
    config = EnvRolloutConfig(env_id=TOY_ENV_ID, group_size=1, max_turns=6, episode_timeout_s=10.0, **kw)
    (t,) = RolloutRunner(Script(renderer, texts), renderer, config).run([2])
    return t


def test_a_turn_cut_by_a_token_limit_keeps_the_earlier_turns_counts(renderer):
    # ToyEnv has no abandon(): the cut turn's info stays {}
    t = toy_run(renderer, ["LOOKUP[magic]", "hmm", "hmm " * 50], max_tokens_per_turn=24)
    assert t.stop_reason == StopReason.MAX_TOKENS and len(t.transitions) == 3
    assert t.transitions[-1].info == {}
    assert (t.metrics["env"]["tool_calls"], t.metrics["env"]["env_errors"]) == (1, 1)
    summary = summarize([t])
    assert (summary["tool_calls"], summary["env_errors"]) == (1.0, 1.0)


def test_an_env_error_keeps_the_earlier_turns_counts(renderer):
    t = toy_run(renderer, ["LOOKUP[magic]", "LOOKUP[magic]"], env_kwargs={"fail_step_seeds": [2]})
    assert t.stop_reason == StopReason.ENV_ERROR and t.transitions[-1].info == {"error": t.error}
    assert (t.metrics["env"]["tool_calls"], t.metrics["env"]["env_errors"], t.metrics["failure_mode"]) == (1, 0, None)


def test_each_count_comes_from_the_last_transition_that_reports_it():
    def transition(info):
        return Transition("obs", [1], Completion([2], [0.0], "stop", "x"), info=info)

    infos = [
        {"metrics": {"tool_calls": 1, "env_errors": 0}},
        {"metrics": {"tool_calls": 2, "env_errors": 1}, "failure_mode": "no_answer"},
        {"metrics": {"tool_calls": "many", "env_errors": None}, "failure_mode": 3},  # unusable values are skipped
        {"metrics": {"tool_calls": 3}},
        {},
    ]
    t = Trajectory("e", {}, 0, 0, [transition(i) for i in infos], StopReason.MAX_TOKENS)
    metrics = episode_metrics(t, 1.0, 0.5)
    env = metrics["env"]
    assert (env["tool_calls"], env["env_errors"], metrics["failure_mode"]) == (3, 1, "no_answer")
    empty = episode_metrics(Trajectory("e", {}, 0, 0, [], StopReason.CONTEXT_OVERFLOW), 1.0, 0.5)
    env = empty["env"]
    assert (env.get("tool_calls", 0), env.get("env_errors", 0), empty["failure_mode"]) == (0, 0, None)


def test_batch_metrics_average_whatever_the_env_reports():
    def episode(env_metrics):
        t = Trajectory("e", {}, 0, 0, [], StopReason.ANSWERED)
        t.metrics = {"turns": 1, "env": env_metrics}
        return t

    metrics = summarize([episode({"solved": 1.0, "steps_left": 4.0}), episode({"solved": 0.0}), episode({})])
    assert metrics["solved"] == pytest.approx(1 / 3) and metrics["steps_left"] == pytest.approx(4 / 3)
    assert "tag_rate" not in metrics and "accuracy" not in metrics
    assert env_metric_names(batch_metrics([episode({"solved": 1.0})]), "rollout/") == ["solved"]


@pytest.mark.parametrize(
    ("reported", "message"),
    [
        ({"episodes": 1.0}, "one the runner reports itself"),
        ({"a/b": 1.0}, "without '/'"),
        ({"x": float("nan")}, "finite number"),
        ([1.0], "must map names to numbers"),
    ],
)
def test_unusable_env_metrics_are_an_env_error(reported, message):
    class Env:
        def step(self, action):
            return "obs", 0.0, False, False, {"metrics": reported}

    with pytest.raises(EnvOutputError, match=message):
        step_env(Env(), "x")  # type: ignore[arg-type]


def _scored(total: float, components: dict[str, float]) -> Trajectory:
    return Trajectory(
        env_id="toolgym/Zorplex-v0", env_kwargs={}, task_seed=0, group_id=0, transitions=[],
        stop_reason=StopReason.ANSWERED, total_reward=total, reward_components=components,
        metrics={"turns": 1, "sampled_tokens": 3, "env": {}},
    )  # fmt: skip


def test_a_component_no_episode_earned_is_zero_in_every_later_record_of_its_series():
    earned = [_scored(1.1, {"correct": 1.0, "chain": 0.1}), _scored(0.0, {"correct": 0.0})]
    unearned = [_scored(1.0, {"correct": 1.0}), _scored(0.0, {"correct": 0.0})]
    train, evals = RewardComponentSeries(), RewardComponentSeries()
    first = train.fill(batch_metrics(earned))
    assert first["rollout/reward/chain"] == 0.05
    alone = batch_metrics(unearned)
    assert "rollout/reward/chain" not in alone  # what a batch's own metrics hold
    second = train.fill(alone)
    # 0.0: the mean when every episode counts it as 0; nothing else in the record changes
    assert second == {**alone, "rollout/reward/chain": 0.0}
    with_zero = batch_metrics([_scored(1.0, {"correct": 1.0, "chain": 0.0}), unearned[1]])
    assert second["rollout/reward/chain"] == with_zero["rollout/reward/chain"]
    assert train.fill(batch_metrics(earned)) == first
    # another source has its own series; a batch without episodes has no means to fill
    assert "eval/reward/chain" not in evals.fill(batch_metrics(unearned, prefix="eval/"))
    assert train.fill(batch_metrics([])) == batch_metrics([])
    assert train.fill({"train/loss": 1.0}) == {"train/loss": 1.0}
