"""`evaluate` keeps no growing list: the summary is summed as episodes finish, at most a window
of episodes is in flight, and the example transcripts are the ones the whole list would give."""

import gc
import random

from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.evaluation import EvalConfig, ExampleCandidates, evaluate_sync, pick_examples
from toolgym.rollouts.metrics import BatchMetrics, batch_metrics
from toolgym.rollouts.scripted import OracleConfig, OraclePolicy
from toolgym.rollouts.types import StopReason, Trajectory

TIMING = ("eval/time_s", "eval/episodes_per_s", "eval/tokens_per_s")


def untimed(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k not in TIMING}


def test_streamed_eval_matches_the_kept_one_and_holds_a_bounded_number_of_episodes(renderer):
    policy = OraclePolicy(renderer, OracleConfig(p_omit_tag=0.3, p_skip_lookup=0.3))
    rollout = EnvRolloutConfig(
        env_id="toolgym/Zorplex-v0", env_kwargs={"tier": "simple"}, max_concurrent_episodes=8
    )
    config = EvalConfig(num_tasks=300, num_examples=3)
    kept = evaluate_sync(policy, renderer, rollout, config)
    assert [t.task_seed for t in kept.trajectories] == list(range(300))  # group-major, as before
    expected_keys = list(untimed(batch_metrics(kept.trajectories, prefix="eval/")))
    kept_metrics, kept_examples = kept.metrics, kept.examples
    del kept

    def trajectories_alive() -> int:
        gc.collect()
        return sum(type(o) is Trajectory for o in gc.get_objects())

    before = trajectories_alive()
    seen, most_alive = 0, 0

    def watch(trajectory: Trajectory) -> None:
        nonlocal seen, most_alive
        seen += 1
        if seen % 50 == 0:  # Trajectory objects anywhere in the process (msgspec Structs are gc-tracked)
            most_alive = max(most_alive, trajectories_alive() - before)

    streamed = evaluate_sync(policy, renderer, rollout, config, keep_trajectories=False, on_episode=watch)
    assert streamed.trajectories == [] and seen == 300
    assert 0 < most_alive <= 8 + 3 * 3  # the window in flight, the example candidates (was: all)
    assert list(untimed(streamed.metrics)) == expected_keys
    for key, value in untimed(kept_metrics).items():
        assert abs(streamed.metrics[key] - value) < 1e-12, key
    assert streamed.examples == kept_examples and len(kept_examples) == 3


def fake(seed: int, mode: str) -> Trajectory:
    return Trajectory("e", {}, seed, seed, [], StopReason.ANSWERED, metrics={"failure_mode": mode})


def test_example_candidates_pick_what_the_whole_list_picks_in_any_order():
    rng = random.Random(0)
    for _ in range(200):
        modes = rng.sample(["a", "b", "c", "d", "e", "f"], rng.randint(1, 6))
        trajectories = [fake(i, rng.choice(modes)) for i in range(rng.randint(0, 40))]
        n = rng.randint(0, 5)
        candidates = ExampleCandidates(n)
        order = list(range(len(trajectories)))
        rng.shuffle(order)
        for i in order:
            candidates.add(i, trajectories[i])
        assert len(candidates.first_of_mode) + len(candidates.first) <= 3 * n
        assert candidates.pick() == pick_examples(trajectories, n)


def test_batch_metrics_streamed_equals_batch_metrics(renderer):
    policy = OraclePolicy(renderer, OracleConfig(p_omit_tag=0.5))
    rollout = EnvRolloutConfig(env_id="toolgym/SumDigits-v0")
    trajectories = evaluate_sync(policy, renderer, rollout, EvalConfig(num_tasks=20)).trajectories
    summary = BatchMetrics()
    for t in trajectories:
        summary.add(t)
    assert list(summary.result(2.0).items()) == list(batch_metrics(trajectories, 2.0).items())
