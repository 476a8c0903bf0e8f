"""Rewards from a judge (rollouts/scoring/judge.py), against a real judge server on 127.0.0.1
(judge_testlib.py, whose score is a rule on the transcript): every criterion becomes a named
reward component summed into the episode's reward and the group's advantages; group mode asks
once per group with a recorded order; re-judging is a cache hit; a judge that answers garbage,
hangs or fails after its retries drops the group as an infrastructure failure (never reward 0),
and enough of them in a row stop the run; the API key comes from the named variable."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest
from judge_testlib import MODEL, judge_server

from toolgym.agents.types import Completion
from toolgym.rollouts.batches import BatchAssembler, BatchConfig, ScoredGroup, roll_group
from toolgym.rollouts.scoring.judge import (
    JUDGE_INFO,
    Judge,
    JudgeConfig,
    JudgeCriterion,
    JudgeError,
    parse_scores,
    transcript,
)
from toolgym.rollouts.types import StopReason, Trajectory, Transition

MENTIONS_42 = JudgeCriterion(name="mentions_42", prompt="The answer contains '42'.", weight=2.0)
POLITE = JudgeCriterion(name="polite", prompt="The answer contains 'please'.", weight=0.5)


def episode(answer: str, index: int, group_id: int = 7) -> Trajectory:
    return Trajectory(
        env_id="toy",
        env_kwargs={},
        task_seed=1,
        group_id=group_id,
        transitions=[
            Transition(
                observation="What is 6 x 7?",
                observation_tokens=[1, 2, 3],
                action=Completion(tokens=[4, 5], logprobs=[-0.1, -0.2], finish_reason="stop", text=answer),
                reward=0.0,
                terminated=True,
            )
        ],
        stop_reason=StopReason.ANSWERED,
        system_prompt="You are a calculator.",
        final_observation="Graded.",
        reward_components={"correct": 0.0},
        sample_index=index,
    )


def group(*answers: str, group_id: int = 7) -> list[Trajectory]:
    return [episode(a, i, group_id) for i, a in enumerate(answers)]


class StaticRunner:
    """A GroupRunner whose groups are given (one list per call)."""

    def __init__(self, make: Callable[[], list[Trajectory]]) -> None:
        self.make = make

    async def run_groups(
        self, task_seeds: Sequence[int], group_ids: Sequence[int] | None = None, on_episode=None
    ) -> list[Trajectory]:
        return self.make()


def config(url: str, **kw) -> JudgeConfig:
    return JudgeConfig(**{"url": url, "criteria": [MENTIONS_42, POLITE], "retries": 0, **kw})


def roll(judge: Judge, trajectories: list[Trajectory]) -> ScoredGroup:
    batch = BatchConfig(groups_per_batch=1)
    return asyncio.run(roll_group(StaticRunner(lambda: trajectories), 1, 7, batch, judge=judge))


def test_each_criterion_is_a_named_component_summed_into_the_reward_and_advantages():
    with judge_server() as server:
        judge = Judge(config(server.url))
        assert judge.model == MODEL  # the endpoint's only model
        trajectories = group("It is 42, please.", "It is 41.", "42")
        scored = roll(judge, trajectories)
    assert scored.failure == ""
    expected = [(2.0, 0.5), (0.0, 0.0), (2.0, 0.0)]
    for trajectory, (forty_two, polite) in zip(trajectories, expected, strict=True):
        assert trajectory.reward_components["judge_mentions_42"] == forty_two
        assert trajectory.reward_components["judge_polite"] == polite
        assert trajectory.total_reward == forty_two + polite
        assert trajectory.transitions[-1].reward == forty_two + polite  # the turns still sum to it
        seen = trajectory.transitions[-1].info[JUDGE_INFO]
        assert set(seen) == {"mentions_42", "polite"}
        assert seen["mentions_42"]["score"] == forty_two / 2.0
        assert trajectory.transitions[0].action.text in seen["mentions_42"]["prompt"]
        assert seen["mentions_42"]["answer"].startswith('{"score"')
    # the group's advantages come from the judged rewards: best first, the unjudged-looking last
    assert scored.advantages[0] > scored.advantages[2] > scored.advantages[1]
    assert len(server.requests) == 6  # episode mode: one call per episode per criterion
    stats = scored.judge_stats
    assert stats is not None and stats.calls == 6 and stats.cache_hits == 0
    assert stats.prompt_tokens > 0 and stats.completion_tokens == 12 and stats.latency_s > 0


def test_replace_makes_the_judge_the_whole_reward_and_the_hacking_rate_is_counted():
    """reward = "replace": the judge's components are the reward (on the last turn), the env's
    are kept aside; pass and hacking rates against the env's own `success`."""
    trajectories = group("It is 42.", "It is 42, please.", "It is 41.", "42 42")
    for t, success in zip(trajectories, (1.0, 0.0, 0.0, 1.0), strict=True):
        t.reward_components["correct"] = success  # the env's grader
        t.total_reward = t.transitions[-1].reward = success
        t.metrics["env"] = {"success": success}
    with judge_server() as server:
        scored = roll(Judge(config(server.url, criteria=[MENTIONS_42], reward="replace")), trajectories)
    assert scored.failure == ""
    for t, (judged, env) in zip(trajectories, ((2.0, 1.0), (2.0, 0.0), (0.0, 0.0), (2.0, 1.0)), strict=True):
        assert t.reward_components == {"judge_mentions_42": judged} and t.total_reward == judged
        assert [tr.reward for tr in t.transitions] == [judged]
        assert t.metrics["replaced_reward"] == {"correct": env}
    metrics = scored.judge_stats.metrics()
    # 3 of 4 pass the judge (they mention 42); of those, the env failed "It is 42, please."
    assert metrics["judge/pass_rate"] == 0.75 and metrics["judge/hacking_rate"] == 1 / 3


def test_a_programmatic_criterion_is_scored_by_its_function_without_a_request():
    polite = JudgeCriterion(name="polite", function="judge_testlib:says_please", weight=0.5)
    trajectories = group("It is 42, please.", "It is 41.")
    with judge_server() as server:
        scored = roll(Judge(config(server.url, criteria=[MENTIONS_42, polite])), trajectories)
        assert len(server.requests) == 2  # the prompt criterion only, once per episode
    assert scored.failure == ""
    assert [t.reward_components["judge_polite"] for t in trajectories] == [0.5, 0.0]
    assert [t.reward_components["judge_mentions_42"] for t in trajectories] == [2.0, 0.0]
    entry = trajectories[0].transitions[-1].info[JUDGE_INFO]["polite"]
    assert entry == {"function": "judge_testlib:says_please", "score": 1.0, "weight": 0.5}
    # a rubric of checks alone asks nothing, not even which model the endpoint serves
    with judge_server() as server:
        checks_only = Judge(config(server.url, criteria=[polite]))
        assert roll(checks_only, group("please")).failure == "" and server.requests == []
    # a check that does not load is refused when the judge is built; one that answers no score
    # fails its group, as a judge's unparseable answer does
    with pytest.raises(JudgeError, match="judge criterion function 'judge_testlib:nowhere' does not load"):
        Judge(config("http://127.0.0.1:9/v1", criteria=[JudgeCriterion(name="x", function="judge_testlib:nowhere")]))
    broken = JudgeCriterion(name="broken", function="judge_testlib:not_a_score")
    with judge_server() as server:
        scored = roll(Judge(config(server.url, criteria=[broken])), group("a", "b"))
    assert "is not a number" in scored.failure
    with pytest.raises(ValueError, match=r"needs a prompt .* or a function"):
        config("http://x/v1", criteria=[JudgeCriterion(name="both", prompt="x", function="a:b")])


def test_group_mode_asks_once_per_group_and_records_the_order():
    answers = ("A: 42", "B: nothing", "C: 42 please", "D: 7")
    with judge_server() as server:
        judge = Judge(config(server.url, mode="group", seed=3))
        trajectories = group(*answers)
        assert roll(judge, trajectories).failure == ""
    assert len(server.requests) == 2  # one per criterion
    order = judge.order(7, "mentions_42", 4)
    assert sorted(order) == [0, 1, 2, 3]
    # the two criteria are asked concurrently: take mentions_42's request, whichever came first
    (shown,) = [
        m for r in server.requests if MENTIONS_42.prompt in (m := "\n".join(x["content"] for x in r["messages"]))
    ]
    places = [shown.index(f"{a}\n") for a in (answers[i] for i in order)]
    assert places == sorted(places)  # the attempts were shown in the recorded order
    for i, trajectory in enumerate(trajectories):
        entry = trajectory.transitions[-1].info[JUDGE_INFO]["mentions_42"]
        assert entry["order"] == order and order[entry["position"]] == i
        assert entry["score"] == (1.0 if "42" in answers[i] else 0.0)
    assert [t.reward_components["judge_polite"] for t in trajectories] == [0.0, 0.0, 0.5, 0.0]


def test_rejudging_the_same_prompt_is_a_cache_hit():
    with judge_server() as server:
        judge = Judge(config(server.url))
        first = roll(judge, group("42", "no"))
        again = group("42", "no")
        second = roll(judge, again)
    assert len(server.requests) == 4
    assert first.judge_stats is not None and first.judge_stats.calls == 4
    assert second.judge_stats is not None
    assert second.judge_stats.calls == 0 and second.judge_stats.cache_hits == 4
    assert second.judge_stats.prompt_tokens == 0
    assert again[0].reward_components["judge_mentions_42"] == 2.0


def test_a_cache_file_carries_the_answers_to_a_later_judge(tmp_path):
    cache = tmp_path / "cache" / "judge.jsonl"
    with judge_server() as server:
        first = roll(Judge(config(server.url, cache_file=str(cache))), group("42", "no"))
        with cache.open("a") as f:
            f.write('{"key": "torn')  # a crash mid-append: the line is skipped, the rest read
        later = Judge(config(server.url, cache_file=str(cache)))  # another process, say
        again = group("42", "no")
        second = roll(later, again)
        assert len(server.requests) == 4  # the later judge asked nothing
    assert first.judge_stats is not None and first.judge_stats.calls == 4
    assert second.judge_stats is not None and (second.judge_stats.calls, second.judge_stats.cache_hits) == (0, 4)
    assert again[0].reward_components["judge_mentions_42"] == 2.0
    assert len(cache.read_text().splitlines()) == 5  # 4 answers and the torn line


def dropped(scored: ScoredGroup, trajectories: list[Trajectory]) -> None:
    """The group is an infrastructure failure of scoring: nothing written, never reward 0."""
    assembler = BatchAssembler(BatchConfig(groups_per_batch=1), judge=True)
    assembler.offer(
        trajectories,
        scored.advantages,
        scored.informative,
        failure=scored.failure,
        judge_stats=scored.judge_stats,
    )
    batch = assembler.result(1)
    assert batch.metrics["batch/groups_scoring_failed"] == 1.0 and batch.episodes == []
    assert not any(batch.kept)
    for trajectory in trajectories:
        assert not any(name.startswith("judge_") for name in trajectory.reward_components)
        assert JUDGE_INFO not in trajectory.transitions[-1].info


def test_an_unparseable_answer_drops_the_group_as_an_infrastructure_failure():
    with judge_server("garbage") as server:
        judge = Judge(config(server.url))
        trajectories = group("42", "no")
        scored = roll(judge, trajectories)
    assert scored.failure.startswith("judge: ValueError: the answer holds no")
    dropped(scored, trajectories)


def test_a_judge_that_hangs_times_out_and_drops_the_group():
    with judge_server("hang") as server:
        judge = Judge(config(server.url, timeout_s=0.3, criteria=[MENTIONS_42]))
        trajectories = group("42")
        scored = roll(judge, trajectories)
    assert "timed out" in scored.failure
    dropped(scored, trajectories)


def test_failures_are_retried_with_backoff_then_succeed_or_drop():
    with judge_server("fail", fail_first=2) as server:
        judge = Judge(config(server.url, retries=2, backoff_s=0.01, criteria=[MENTIONS_42]))
        trajectories = group("42")
        scored = roll(judge, trajectories)
    assert scored.failure == "" and trajectories[0].total_reward == 2.0
    assert len(server.requests) == 3 and scored.judge_stats is not None and scored.judge_stats.calls == 3
    with judge_server("fail", fail_first=5) as server:
        judge = Judge(config(server.url, retries=1, backoff_s=0.01, criteria=[MENTIONS_42]))
        trajectories = group("42")
        scored = roll(judge, trajectories)
    assert "HTTP 503" in scored.failure and len(server.requests) == 2
    assert scored.judge_stats is not None and scored.judge_stats.calls == 2  # failed calls count too
    dropped(scored, trajectories)


def test_consecutive_failures_stop_with_the_cause():
    with judge_server("garbage") as server:
        judge = Judge(config(server.url, max_consecutive_failures=2))
        assert roll(judge, group("42")).failure
        with pytest.raises(
            JudgeError, match=r"failed 2 groups in a row .*last cause: ValueError: the answer"
        ):
            roll(judge, group("42"))


def test_the_api_key_is_read_from_the_named_variable(monkeypatch):
    with judge_server(api_key="sekrit") as server:
        monkeypatch.delenv("TOOLGYM_TEST_JUDGE_KEY", raising=False)
        with pytest.raises(JudgeError, match=r"\$TOOLGYM_TEST_JUDGE_KEY, which is not set"):
            Judge(config(server.url, api_key_env="TOOLGYM_TEST_JUDGE_KEY"))
        monkeypatch.setenv("TOOLGYM_TEST_JUDGE_KEY", "wrong")
        with pytest.raises(JudgeError, match="HTTP 401: invalid API key"):
            Judge(config(server.url, api_key_env="TOOLGYM_TEST_JUDGE_KEY"))
        monkeypatch.setenv("TOOLGYM_TEST_JUDGE_KEY", "sekrit")
        judge = Judge(config(server.url, api_key_env="TOOLGYM_TEST_JUDGE_KEY"))
        assert roll(judge, group("42")).failure == ""
    assert server.authorizations[-1] == "Bearer sekrit"
    with pytest.raises(ValueError, match="must name an environment variable"):
        config(server.url, api_key_env="sk-abc123-the-key-itself")


def test_scores_parse_from_json_or_tags_and_are_range_checked():
    assert parse_scores('```json\n{"score": 0.7}\n```', None) == [0.7]
    assert parse_scores("Reasoning... <score>0.25</score>", None) == [0.25]
    assert parse_scores('{"scores": [1, 0, 0.5]}', 3) == [1.0, 0.0, 0.5]
    with pytest.raises(ValueError, match="outside"):
        parse_scores('{"score": 1.5}', None)
    with pytest.raises(ValueError, match="2 scores for 3"):
        parse_scores("<score>1</score><score>0</score>", 3)
    with pytest.raises(ValueError, match="not a number"):
        parse_scores('{"score": true}', None)
    text = transcript(episode("42", 0))
    assert text.index("[system]") < text.index("[user]\nWhat is 6 x 7?") < text.index("[assistant]\n42")


def test_the_shipped_tag_check_passes_zorplex_answers_only():
    from toolgym.examples.judge_checks import answer_tagged

    assert [answer_tagged(episode(text, 0)) for text in ("[ANSWER] 42", "[yellow] 42", "[ANSWER[tree1", "42")] == [
        1.0,
        0.0,
        0.0,
        0.0,
    ]
