"""verifiers environments as agent programs (rollouts/endpoint/verifiers_program.py): a verifiers
taskset written for the tests, and verifiers' own `best-of-n` env over it, run their episodes
against the endpoint with verifiers' subprocess runtime and interception server (which calls the
endpoint with stream=true); their rewards and named parts come back into groups, the captured
tokens are the sampled ones, and `toolgym train` trains through it. Skipped without verifiers
(the README's test command installs it with --no-deps beside the dev extra: pyproject.toml)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("verifiers.v1", reason="the verifiers extra (pip install 'toolgym[verifiers]')")

from endpoint_testlib import ScriptedPolicy, renderer

from toolgym.rollouts.endpoint import AgentProgram, AgentRunner
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.types import StopReason

AGENT = AgentProgram(module="vf_digits_agent", task="task")


def rollout(**kwargs) -> EnvRolloutConfig:
    settings = dict(env_id="vf", group_size=2, max_tokens_per_turn=32, max_tokens_per_episode=64)
    return EnvRolloutConfig(**{**settings, **kwargs})


def test_a_verifiers_taskset_runs_against_the_endpoint_and_its_rewards_come_back():
    chat = renderer()
    right, wrong = "The digit sum is 3.", "I am not sure, perhaps it is nine or so, hard to say."
    policy = ScriptedPolicy(chat, [right, wrong])
    runner = AgentRunner(policy, chat, AGENT, rollout(group_size=2))
    trajectories = asyncio.run(runner.run_groups([2]))  # seed 2: the taskset's row 102
    assert runner.last_server is not None and runner.last_server.captures.finished == 2
    by_reply = {}
    for t in trajectories:
        assert t.stop_reason == StopReason.ANSWERED, t.error
        (turn,) = t.transitions
        by_reply[turn.action.text] = t
        # The trained tokens are the sampled ones, verbatim (the reply's tokens and <|im_end|>).
        assert list(turn.action.tokens) == [*chat.encode(turn.action.text), chat.im_end_id]
        # The prompt is the task's row, rendered once by the endpoint.
        assert "What is the digit sum of 102?" in chat.tokenizer.decode(list(turn.observation_tokens))
    good, bad = by_reply[right], by_reply[wrong]
    assert good.reward_components == {"correct": 1.0, "short": 0.5} and good.total_reward == 1.5
    assert bad.reward_components == {"correct": 0.0, "short": 0.0} and bad.total_reward == 0.0
    assert good.metrics["env"]["reply_chars"] == float(len(right))


def test_verifiers_own_best_of_n_env_plays_each_attempt_through_the_endpoint():
    """verifiers' `best-of-n` env (shipped with verifiers, no Docker, no network) over the test
    taskset: each episode's n attempts are n conversations' worth of turns in one capture, and
    the rewards of every attempt come back."""
    chat = renderer()
    policy = ScriptedPolicy(chat, ["It is 4.", "4"])
    program = AgentProgram(module="vf_digits_agent", function="run_best_of_n", task="best_of_n_task")
    runner = AgentRunner(policy, chat, program, rollout(group_size=1))
    (t,) = asyncio.run(runner.run_groups([3]))  # row 103
    assert t.stop_reason == StopReason.ANSWERED, t.error
    assert len(policy.prompts) == 2
    # The second attempt does not extend the first: the capture starts a new segment (the
    # restart path), and both attempts' sampled tokens are trained.
    assert len(t.transitions) == 2 and t.metrics["sequence_restarts"] == 1
    assert t.reward_components == {"correct": 1.0, "short": 0.5} and t.total_reward == 1.5
    assert t.metrics["env"]["pass_at_n"] == 1.0


@pytest.mark.slow
def test_toolgym_train_trains_a_verifiers_env_through_the_agent_program_path(tmp_path):
    from toolgym.configs.cli.main import main

    overrides = [
        'agent_program.module="vf_digits_agent"',
        'agent_program.task="task"',
        "run.steps=2",
        f'run.root="{tmp_path}"',
        "run.plot=false",
        "run.export_hf=false",
        "sft.enabled=false",
        "rollout.group_size=2",
        "rollout.max_tokens_per_turn=8",
        "rollout.max_tokens_per_episode=16",
        "batch.groups_per_batch=2",
        "batch.dynamic_sampling=false",
        "policy.max_batch_size=8",
        "eval.num_tasks=2",
        "eval.every_steps=0",
        "run.max_steps_without_learning=0",
        "logging.progress_bar=false",
    ]
    args = ["train", "shop_agent", "--no-progress"]
    for override in overrides:
        args += ["--set", override]
    assert main(args) == 0
    (run,) = tmp_path.iterdir()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["rollout/episodes"] == 4.0 for r in train)
    assert all("rollout/short" in r for r in train)
