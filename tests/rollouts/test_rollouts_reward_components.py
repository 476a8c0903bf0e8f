"""Every named reward component an env reports reaches the batch summaries as
`<prefix>reward/<name>`: the mean over the batch's episodes, 0 for an episode that never reported
the name; unusable names end the episode as an env error, non-finite values count 0."""

import math

import gymnasium
import pytest

from toolgym.envs import Task, Tool, ToolEnv
from toolgym.rollouts.env_io import EnvOutputError, step_env
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.evaluation import EvalConfig, evaluate_sync
from toolgym.rollouts.metrics import (
    BatchMetrics,
    batch_metrics,
    component_variation,
    env_metric_names,
    reward_component_names,
)
from toolgym.rollouts.scripted import OraclePolicy
from toolgym.rollouts.types import StopReason, Trajectory

BONUS_ENV_ID = "rolloutstest/Bonus-v0"
FOUND = 0.5


class BonusEnv(ToolEnv):
    """Look up a value, answer it. On even task seeds the first tool call earns a per-step reward
    component `found` (reported from then on); odd seeds never report it."""

    def __init__(self, **knobs):
        value = Tool("VALUE", "the value of a word", self.value, arg="word")
        super().__init__(tools=[value], instructions="Answer with the word's value.", **knobs)

    def value(self, word: str) -> str:
        return str(self.secret) if word == "magic" else "UNKNOWN_WORD"

    def new_task(self) -> Task:
        self.secret = int(self.np_random.integers(0, 100))
        return Task("What is the value of magic?", self.secret, ("VALUE[magic]",))

    def reset(self, *, seed=None, options=None):
        self.rewarded, self.found = seed is not None and seed % 2 == 0, None
        return super().reset(seed=seed, options=options)

    def step(self, action):
        observation, reward, terminated, truncated, info = super().step(action)
        if self.rewarded and self.found is None and "VALUE[" in action:
            self.found = FOUND
            reward += FOUND  # the step rewards still sum to the components
        if self.found is not None:
            info["reward_components"] = {**info.get("reward_components", {}), "found": self.found}
        return observation, reward, terminated, truncated, info


gymnasium.register(BONUS_ENV_ID, entry_point=BonusEnv)


def test_a_per_step_component_reaches_the_batch_metrics(renderer):
    config = EnvRolloutConfig(env_id=BONUS_ENV_ID, group_size=2, max_turns=4)
    trajectories = RolloutRunner(OraclePolicy(renderer), renderer, config).run([0, 1, 2, 3, 4])
    for t in trajectories:
        assert t.stop_reason == StopReason.ANSWERED and t.error is None
        assert t.reward_components.get("found", 0.0) == (FOUND if t.task_seed % 2 == 0 else 0.0)
        assert t.total_reward == pytest.approx(sum(t.reward_components.values()))
    metrics = batch_metrics(trajectories)
    # 3 of 5 seeds (6 of 10 episodes) report `found`; the other 4 count 0
    assert metrics["rollout/reward/found"] == pytest.approx(FOUND * 6 / 10)
    assert metrics["rollout/reward/correct"] == 1.0  # ToolEnv's own components are there too
    assert reward_component_names(metrics, "rollout/")[-1] == "found"
    assert "reward/found" not in env_metric_names(metrics, "rollout/")  # not an env metric


def test_a_component_reaches_the_eval_metrics_streamed_or_kept(renderer):
    config = EnvRolloutConfig(env_id=BONUS_ENV_ID, max_turns=4)
    eval_config = EvalConfig(num_tasks=6, num_examples=1)
    kept = evaluate_sync(OraclePolicy(renderer), renderer, config, eval_config)
    expected = sum(t.reward_components.get("found", 0.0) for t in kept.trajectories) / len(kept.trajectories)
    assert 0.0 < expected < FOUND
    streamed = evaluate_sync(OraclePolicy(renderer), renderer, config, eval_config, keep_trajectories=False)
    for report in (kept, streamed):
        assert report.metrics["eval/reward/found"] == pytest.approx(expected)


def episode(components: dict) -> Trajectory:
    t = Trajectory("e", {}, 0, 0, [], StopReason.ANSWERED, reward_components=components)
    t.metrics = {"turns": 1, "env": {}}
    return t


def test_non_finite_or_unusable_components_do_not_poison_the_mean():
    # as a recording read back may hold them: a non-finite value counts 0, an unusable name is left out
    batch = [episode({"a": 1.0, "b": math.nan}), episode({"a": math.inf, "b": 2.0}), episode({"x/y": 1.0})]
    metrics = batch_metrics(batch)
    assert metrics["rollout/reward/a"] == pytest.approx(1 / 3) and metrics["rollout/reward/b"] == pytest.approx(2 / 3)
    assert reward_component_names(metrics, "rollout/") == ["a", "b"]
    assert batch_metrics([episode({})]).keys().isdisjoint({"rollout/reward/a"})


def test_the_streamed_summary_keeps_one_sum_per_name():
    summary = BatchMetrics()
    for i in range(1000):
        summary.add(episode({"a": 1.0, "b": float(i % 2)}))
    assert summary.component_sums == {"a": 1000.0, "b": 500.0}
    assert summary.result(prefix="eval/")["eval/reward/b"] == 0.5


@pytest.mark.parametrize("name", ["", "a/b", "line\nbreak", "tab\there"])
def test_an_unusable_component_name_is_an_env_error(name):
    class Env:
        def step(self, action):
            return "obs", 1.0, True, False, {"reward_components": {name: 1.0}}

    with pytest.raises(EnvOutputError, match=r"reward component names are non-empty printable strings without '/'"):
        step_env(Env(), "x")  # type: ignore[arg-type]


def _scored(**components: float) -> Trajectory:
    total = sum(components.values())
    return Trajectory("env", {}, 0, 0, [], StopReason.ANSWERED, total_reward=total, reward_components=components)


def test_component_variation_says_which_component_a_group_signal_comes_from():
    groups = [
        [_scored(score=1.0, invalid=-0.05), _scored(score=1.0, invalid=-0.10)],  # only the cost varies
        [_scored(score=2.0, invalid=0.0), _scored(score=0.0, invalid=-0.05)],  # both vary
        [_scored(score=1.0), _scored(score=0.0, invalid=0.0)],  # score only (a missing name is 0)
        [_scored(score=1.0, invalid=-0.05), _scored(score=1.0, invalid=-0.05)],  # nothing varies
    ]
    assert component_variation(groups) == {
        "batch/varies/score": 0.5,
        "batch/varies_only/score": 0.25,
        "batch/varies/invalid": 0.5,
        "batch/varies_only/invalid": 0.25,
    }
    assert component_variation([]) == {}
    # a name that is not a usable component name, or a value that is not a number, is left out / 0
    odd = [_scored(**{"bad/name": 1.0}), _scored(score=math.nan)]
    assert component_variation([odd]) == {"batch/varies/score": 0.0, "batch/varies_only/score": 0.0}
