"""Agent rollouts through the endpoint: the README's agent program (verbatim), 64 concurrent agent
runs on the torch engine built into groups and Episodes, an agent's exception, timeout or bad
reward ending only its own episode, the held-out eval, and `toolgym train` on the shipped
preset for two RL steps."""

from __future__ import annotations

import asyncio
import json
import re
import textwrap

import pytest
from endpoint_testlib import ROOT, engine, renderer

from toolgym.rollouts.batches import BatchConfig, TaskSeedStream, collect_batch
from toolgym.rollouts.endpoint import AgentProgram, AgentRunner, evaluate_agent
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.types import StopReason

SHOP = AgentProgram(module="toolgym.examples.shop_agent", function="run_agent", task="task")


def _between_markers(text: str) -> str:
    return (
        text.split("# --- README agent: begin ---\n", 1)[1].split("# --- README agent: end ---", 1)[0].strip()
    )


def test_the_readme_shows_the_shipped_agent_program_verbatim():
    agent = _between_markers((ROOT / "examples" / "shop_agent.py").read_text())
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Train your own agent\n.*?```python\n(.*?)```", readme, re.DOTALL)
    assert block is not None, "README.md has no 'Train your own agent' section with a python block"
    shown = block.group(1)
    body = agent.replace("import json  # noqa: E402\nimport re  # noqa: E402", "import json\nimport re")
    assert body in shown
    assert len(body.splitlines()) <= 26


@pytest.fixture(scope="module")
def shop_engine():
    with engine(max_batch_size=64, max_seq_len=512) as e:
        yield e


def rollout(**kwargs) -> EnvRolloutConfig:
    settings = dict(env_id="toolgym/Shop-v0", group_size=4, max_tokens_per_turn=8, max_tokens_per_episode=24)
    return EnvRolloutConfig(**{**settings, **kwargs})


@pytest.mark.slow
def test_64_concurrent_agent_runs_become_groups_and_token_exact_episodes(shop_engine):
    runner = AgentRunner(shop_engine, renderer(), SHOP, rollout(group_size=4))
    stream = TaskSeedStream(stream=0)
    batch = asyncio.run(collect_batch(runner, stream, BatchConfig(groups_per_batch=16)))
    trajectories = batch.trajectories
    assert len(trajectories) == 64 and runner.last_server is not None
    assert runner.last_server.captures.finished == 64 and not runner.last_server.captures.open
    assert len({t.env_kwargs["conversation_id"] for t in trajectories}) == 64
    for t in trajectories:
        assert t.stop_reason in (StopReason.ANSWERED, StopReason.MAX_TOKENS), t.error
        assert t.env_id == "toolgym.examples.shop_agent:run_agent" and t.transitions
        assert t.total_reward == pytest.approx(sum(t.reward_components.values()))
    # Each group is one task seed's 4 samples (different samples: seeded per sample and turn).
    groups = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    assert sorted(len(g) for g in groups.values()) == [4] * 16
    assert all(len({t.task_seed for t in g}) == 1 for g in groups.values())
    first = next(iter(groups.values()))
    assert len({tuple(t.transitions[0].action.tokens) for t in first}) > 1
    # The Episodes hold exactly the sampled tokens, loss mask 1 on them only.
    trainable = [t for t, keep in zip(trajectories, batch.kept, strict=True) if keep]
    sampled = sum(len(tr.action.tokens) for t in trainable for tr in t.transitions)
    assert sum(sum(e.loss_mask) for e in batch.episodes) == sampled
    assert batch.metrics["rollout/episodes"] == 64.0 and "rollout/correct" in batch.metrics


FAULTY = textwrap.dedent(
    """
    import asyncio, math

    async def run_agent(client, task):
        if task == 5:  # no request: done at once, whatever the machine's load
            return {"correct": 1.0}
        reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        if task == 1:
            raise RuntimeError("the agent's own bug")
        if task == 2:
            await asyncio.Event().wait()  # never set: only the wall-clock limit ends it
        if task == 3:
            return math.nan
        if task == 4:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x " * 600}])
        return {"correct": 1.0, "style": 0.5}
    """
)


def test_exceptions_timeouts_and_bad_rewards_end_only_their_own_episode(shop_engine, tmp_path, monkeypatch):
    """Two runs: the agents that fail or finish under the default wall-clock limit (300 s, which
    load cannot exhaust), and the one that never finishes under a 3 s limit beside one that needs
    no request (the limit ends only the hung episode, and nothing else there can run out of it)."""
    (tmp_path / "faulty_agent.py").write_text(FAULTY)
    monkeypatch.syspath_prepend(str(tmp_path))
    program = AgentProgram(module="faulty_agent")
    runner = AgentRunner(shop_engine, renderer(), program, rollout(group_size=2))
    trajectories = asyncio.run(runner.run_groups([0, 1, 3, 4]))
    assert not runner.last_server.captures.open  # type: ignore[union-attr]
    hung = AgentRunner(shop_engine, renderer(), program, rollout(group_size=2, episode_timeout_s=3.0))
    trajectories += asyncio.run(hung.run_groups([2, 5]))
    assert not hung.last_server.captures.open  # type: ignore[union-attr]
    by_task = {}
    for t in trajectories:
        by_task.setdefault(t.task_seed, []).append(t)
    assert sorted(by_task) == [0, 1, 2, 3, 4, 5] and all(len(g) == 2 for g in by_task.values())
    for t in by_task[0]:
        assert t.stop_reason == StopReason.ANSWERED and t.total_reward == 1.5
        assert t.reward_components == {"correct": 1.0, "style": 0.5}
    for t in by_task[1]:
        assert t.stop_reason == StopReason.ENV_ERROR and "the agent's own bug" in (t.error or "")
    for t in by_task[2]:
        assert t.stop_reason == StopReason.TIMEOUT and "wall-clock" in (t.error or "")
    for t in by_task[3]:
        assert t.stop_reason == StopReason.ENV_ERROR and "finite" in (t.error or "")
    for t in by_task[4]:  # the endpoint refused the over-long prompt: a limit, reward 0, trained on
        assert t.stop_reason == StopReason.CONTEXT_OVERFLOW and t.total_reward == 0.0
    for t in by_task[5]:
        assert t.stop_reason == StopReason.ANSWERED and t.total_reward == 1.0


def test_the_held_out_eval_runs_the_agent_greedily(shop_engine):
    from toolgym.rollouts.evaluation import EvalConfig

    runner = AgentRunner(shop_engine, renderer(), SHOP, rollout(group_size=4))
    report = asyncio.run(evaluate_agent(runner, EvalConfig(num_tasks=3, num_examples=1)))
    assert report.metrics["eval/episodes"] == 3.0
    assert [t.task_seed for t in report.trajectories] == [0, 1, 2]
    again = asyncio.run(evaluate_agent(runner, EvalConfig(num_tasks=3, num_examples=1)))
    tokens = [[tr.action.tokens for tr in t.transitions] for t in report.trajectories]
    assert tokens == [[tr.action.tokens for tr in t.transitions] for t in again.trajectories]  # greedy
    assert len(report.examples) == 1


def test_a_missing_agent_function_is_refused_in_one_line(tmp_path, monkeypatch):
    from toolgym.configs.checks import check_environment
    from toolgym.configs.load import ConfigError, load_config

    (tmp_path / "sync_agent.py").write_text("def run_agent(client, task):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config, _ = load_config("shop_agent", ['agent_program.module = "sync_agent"', 'agent_program.task = ""'])
    with pytest.raises(ConfigError, match="no async function 'run_agent'"):
        check_environment(config)


@pytest.mark.slow
def test_toolgym_train_runs_the_shop_agent_through_the_endpoint_for_two_rl_steps(tmp_path):
    """The shipped preset, shrunk: two RL steps of the README's agent program through the
    endpoint, the evals before and after, exit code 0."""
    from toolgym.configs.cli.main import main

    overrides = [
        "run.steps=2",
        f'run.root="{tmp_path}"',
        "run.plot=false",
        "run.export_hf=false",
        "sft.enabled=false",
        "rollout.group_size=2",
        "rollout.max_tokens_per_turn=8",
        "rollout.max_tokens_per_episode=24",
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
    assert len([r for r in records if r.get("kind") == "eval"]) == 2


def test_through_the_endpoint_the_agent_sees_the_tokens_the_env_runner_would_show(tmp_path):
    """With the model's chat template, the README's agent on Shop-v0 gets the same prompts, token
    for token, as the env runner rolling out Shop-v0 with the same replies: what SFT on the env's
    demonstrations teaches carries over to the agent program."""
    import gymnasium
    from endpoint_testlib import ScriptedPolicy

    from toolgym.agents.chat_template import TemplateRenderer, load_chat_template
    from toolgym.configs.load import chat_template_path
    from toolgym.rollouts.episode.runner import RolloutRunner

    chat = renderer()
    template = TemplateRenderer(chat.tokenizer, load_chat_template(chat_template_path("qwen2.5-style")))
    env = gymnasium.make("toolgym/Shop-v0").unwrapped
    env.reset(seed=5)
    replies = env.oracle_actions()  # a price call, then the tagged answer
    by_env, by_agent = ScriptedPolicy(template, replies), ScriptedPolicy(template, replies)
    config = rollout(group_size=1, max_tokens_per_turn=64, max_tokens_per_episode=256)
    (env_run,) = asyncio.run(RolloutRunner(by_env, template, config).run_groups([5]))
    (agent_run,) = asyncio.run(AgentRunner(by_agent, template, SHOP, config).run_groups([5]))
    assert len(by_env.prompts) == len(by_agent.prompts) == 2
    assert by_agent.prompts == by_env.prompts
    assert agent_run.reward_components == {"correct": 1.0, "used_tool": 0.2}
    assert env_run.metrics["env"]["success"] == 1.0
    assert agent_run.metrics["sequence_restarts"] == 0


def test_an_agent_reward_too_large_for_the_advantages_is_refused():
    from toolgym.rollouts.endpoint.program import AgentResult, as_result

    assert as_result(1e30).reward == 1e30
    for value in (1e308, -1e300, {"a": 1e308}, AgentResult(reward=1.0, components={"a": -1e31})):
        with pytest.raises(ValueError, match=r"within ±1e\+30"):
            as_result(value)
