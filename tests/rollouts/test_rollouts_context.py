"""Context policies (rollouts/context.py): what each keeps, and the runner applying them: a rewrite
starts a new token-exact segment whose tokens are the renderer's full rendering of the kept
conversation, counted; keep-all stays append-only."""

import gymnasium
import msgspec
import numpy as np
import pytest
import torch
from chat_templates_testlib import QWEN25_LIKE, SHIPPED_TOKENIZER
from recording_testlib import shipped_renderer
from tokenizers import Tokenizer

from toolgym.agents.chat_template import TemplateRenderer
from toolgym.agents.engine.engine import TorchEngine
from toolgym.agents.model.config import NAMED_CONFIGS, ModelConfig
from toolgym.agents.model.transformer import Transformer
from toolgym.agents.types import Message, SamplingParams
from toolgym.rollouts.context import (
    ContextPolicySpec,
    Conversation,
    ElideToolResults,
    KeepAll,
    Notes,
    SlidingWindow,
    Turn,
    context_policy,
    policy_spec,
    register_context_policy,
)
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.context import turn_of
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.episodes import sequences
from toolgym.rollouts.metrics import batch_metrics
from toolgym.rollouts.scripted import OracleConfig, OraclePolicy, plan_actions
from toolgym.rollouts.types import CONTEXT_REWRITE, SEQUENCE_START, RolloutSettings, StopReason

CHAIN = {"tier": "recursive", "redirects": 4, "max_turns": 12, "max_tool_calls": 6}
NOTES = {**CHAIN, "notes": True}
HEAD = [Message("system", "sys"), Message("user", "task")]


def turn(action, reply, **info):
    """The turn as the runner builds it from the step's info (its `note` read into Turn.note)."""
    return turn_of(action, [Message("tool", reply)], info)


def conversation(*turns):
    return Conversation(HEAD, list(turns))


# ---- the policies on their own ---------------------------------------------------------------


def test_keep_all_never_rewrites():
    assert KeepAll().rewrite(conversation(*[turn(f"a{i}", f"r{i}") for i in range(9)])) is None


def test_sliding_window_keeps_the_head_and_the_last_turns_once_over_the_window():
    turns = [turn(f"a{i}", f"r{i}") for i in range(4)]
    window = SlidingWindow(turns=2)
    assert window.rewrite(conversation(*turns[:2])) is None
    kept = window.rewrite(conversation(*turns[:3]))
    assert kept is not None and list(kept.head) == HEAD and list(kept.turns) == turns[1:3]
    assert [m.content for m in kept.messages] == ["sys", "task", "a1", "r1", "a2", "r2"]
    slack = SlidingWindow(turns=2, slack=1)  # cut back every second turn
    assert slack.rewrite(conversation(*turns[:3])) is None
    assert list(slack.rewrite(conversation(*turns)).turns) == turns[2:]


def test_elide_replaces_older_replies_with_the_marker_and_keeps_every_action():
    turns = [turn(f"a{i}", f"r{i}") for i in range(3)]
    elide = ElideToolResults(keep_last=1, marker="[gone]")
    assert elide.rewrite(conversation(*turns[:1])) is None
    out = elide.rewrite(conversation(*turns))
    assert [m.content for m in out.messages] == ["sys", "task", "a0", "[gone]", "a1", "[gone]", "a2", "r2"]
    assert elide.rewrite(out) is None  # already elided: nothing changes, no rewrite
    out.turns.append(turn("a3", "r3"))
    again = elide.rewrite(out)
    assert [m.content for m in again.messages][-4:] == ["a2", "[gone]", "a3", "r3"]


def test_notes_keep_the_head_and_the_note_turns_after_a_note():
    t0, n1, t1, n2 = (
        turn("LOOKUP[a]", "SEE: b"),
        turn("NOTE[b]", "noted", note="b"),
        turn("x", "y"),
        turn("NOTE[c]", "noted", note="c"),
    )
    assert n1 == Turn(n1.messages, {"note": "b"}, "b") and t0.note is None
    assert turn("NOTE[]", "noted", note=3).note is None  # a note is text
    notes = Notes()
    assert notes.rewrite(conversation(t0)) is None  # not a note: keep appending
    assert list(notes.rewrite(conversation(t0, n1)).turns) == [n1]
    assert list(notes.rewrite(conversation(n1, t1, n2)).turns) == [n1, n2]
    assert list(Notes(keep_last=1).rewrite(conversation(n1, t1, n2)).turns) == [n2]


def test_specs_round_trip_and_bad_ones_are_refused():
    for policy in (
        KeepAll(),
        SlidingWindow(turns=3, slack=1),
        ElideToolResults(keep_last=2),
        Notes(keep_last=1),
    ):
        assert context_policy(policy_spec(policy)) == policy
        assert msgspec.convert(policy_spec(policy), ContextPolicySpec) == policy
    assert context_policy(None) == KeepAll()
    with pytest.raises(ValueError, match="unknown context policy 'nope'"):
        context_policy({"policy": "nope"})
    with pytest.raises(ValueError, match=r"SlidingWindow\.turns must be an int >= 1"):
        SlidingWindow(turns=0)
    with pytest.raises(ValueError, match="turnz"):
        context_policy({"policy": "window", "turnz": 2})

    class LastTurnOnly(msgspec.Struct, frozen=True, tag="last_turn_test", tag_field="policy"):
        def rewrite(self, c):
            return Conversation(c.head, c.turns[-1:]) if len(c.turns) > 1 else None

    register_context_policy("last_turn_test", LastTurnOnly)
    assert policy_spec(LastTurnOnly()) == {"policy": "last_turn_test"}
    assert context_policy({"policy": "last_turn_test"}) == LastTurnOnly()


def test_a_run_configs_rollout_context_is_a_typed_policy():
    settings = msgspec.convert({"context": {"policy": "window", "turns": 4}}, RolloutSettings)
    assert settings.context == SlidingWindow(turns=4)
    assert msgspec.convert({}, RolloutSettings).context is None
    with pytest.raises(msgspec.ValidationError, match="unknown field `turn`"):
        msgspec.convert({"context": {"policy": "window", "turn": 4}}, RolloutSettings)


# ---- the runner ------------------------------------------------------------------------------


def run(env_kwargs, context=None, renderer=None, seeds=(0, 1), oracle=None, **settings):
    renderer = renderer or shipped_renderer()
    settings = {"group_size": 1, "max_turns": 12, "max_tokens_per_episode": 4096, **settings}
    config = EnvRolloutConfig(env_id="toolgym/Zorplex-v0", env_kwargs=env_kwargs, context=context, **settings)
    return RolloutRunner(OraclePolicy(renderer, oracle), renderer, config).run(list(seeds))


def rendered_segments(trajectory, renderer):
    """Per transition: the tokens the model saw before its action (the whole prompt)."""
    prompts, history = [], []
    for t in trajectory.transitions:
        history = list(t.observation_tokens) if t.info.get(SEQUENCE_START) else history + t.observation_tokens
        prompts.append(list(history))
        history += t.action.tokens
    return prompts


def test_keep_all_stays_append_only_and_reports_nothing_new():
    for trajectory in run(CHAIN):
        assert trajectory.stop_reason == StopReason.ANSWERED
        assert len(sequences(trajectory)) == 1 and trajectory.context_policy == {}
        assert "context_rewrites" not in trajectory.metrics and "sequence_restarts" not in trajectory.metrics
        assert not any(t.info.get(SEQUENCE_START) for t in trajectory.transitions)


def test_a_sliding_window_restarts_each_turn_past_it_with_the_rendering_of_the_window():
    renderer = shipped_renderer()
    trajectories = run(CHAIN, SlidingWindow(turns=2), renderer)
    for trajectory in trajectories:
        assert trajectory.stop_reason == StopReason.ANSWERED and trajectory.total_reward > 1
        n = len(trajectory.transitions)
        marks = [bool(t.info.get(SEQUENCE_START)) for t in trajectory.transitions]
        assert marks == [False] * 3 + [True] * (n - 3)  # turns 0-2 fit; each later one drops one
        assert all(t.info.get(CONTEXT_REWRITE) is True for t in trajectory.transitions[3:])
        assert trajectory.metrics["context_rewrites"] == n - 3 == trajectory.metrics["sequence_restarts"]
        assert trajectory.context_policy == {"policy": "window", "turns": 2, "slack": 0}
        assert len(sequences(trajectory)) == n - 2
        env = gymnasium.make("toolgym/Zorplex-v0", **CHAIN)
        question, info = env.reset(seed=trajectory.task_seed)
        head = [Message("system", info["system_prompt"]), Message("user", question)]
        replies = [Message("tool", t.observation) for t in trajectory.transitions[1:]]
        actions = [Message("assistant", t.action.text) for t in trajectory.transitions]
        for i, prompt in enumerate(rendered_segments(trajectory, renderer)):
            if i >= 3:  # the window's canonical rendering: head + the last two turns
                window = [m for k in (i - 2, i - 1) for m in (actions[k], replies[k])]
                assert prompt == renderer.render_prompt(head + window)
    assert batch_metrics(trajectories)["rollout/context_rewrites"] == sum(
        t.metrics["context_rewrites"] for t in trajectories
    )


def test_notes_declared_by_the_env_cut_the_context_to_the_task_and_the_notes():
    renderer = shipped_renderer()
    for trajectory in run(NOTES, renderer=renderer):
        assert trajectory.stop_reason == StopReason.ANSWERED and trajectory.total_reward > 1
        assert trajectory.context_policy == {"policy": "notes", "keep_last": None}
        notes = [i for i, t in enumerate(trajectory.transitions) if t.info.get("note")]
        assert len(notes) == 4 and trajectory.metrics["context_rewrites"] == 4
        starts = [i for i, t in enumerate(trajectory.transitions) if t.info.get(SEQUENCE_START)]
        assert starts == [i + 1 for i in notes]  # the turn after each note starts a segment
        first = trajectory.transitions[0]
        system_and_task = first.observation_tokens[: -len(renderer.generation_prompt)]
        for k, i in enumerate(starts):
            prompt = trajectory.transitions[i].observation_tokens
            assert prompt[: len(system_and_task)] == system_and_task
            text = renderer.decode(prompt[len(system_and_task) :])
            assert text.count("assistant\nNOTE[") == k + 1 and "LOOKUP" not in text  # the notes alone


def test_notes_fit_a_chain_that_overflows_keep_all():
    long_chain = {**NOTES, "redirects": 6, "max_turns": 16, "max_tool_calls": 8}
    kept = run(long_chain, KeepAll(), context_length=300, max_turns=16)
    noted = run(long_chain, Notes(keep_last=1), context_length=300, max_turns=16)
    assert all(t.stop_reason == StopReason.CONTEXT_OVERFLOW for t in kept)
    assert all(t.stop_reason == StopReason.ANSWERED and t.total_reward > 1 for t in noted)


def test_elided_results_are_replaced_in_the_rendering():
    renderer = shipped_renderer()
    for trajectory in run(CHAIN, ElideToolResults(keep_last=1, marker="[elided]"), renderer):
        assert trajectory.stop_reason == StopReason.ANSWERED
        last = rendered_segments(trajectory, renderer)[-1]
        text = renderer.decode(last).split("<|im_start|>assistant", 1)[1]  # after the head
        assert text.count("SEE:") == 0 and text.count("[elided]") == len(trajectory.transitions) - 2
        assert text.count("LOOKUP[") >= len(trajectory.transitions) - 1  # every action kept


def test_a_rewrite_under_a_chat_template_is_the_templates_rendering():
    renderer = TemplateRenderer(Tokenizer.from_file(str(SHIPPED_TOKENIZER)), QWEN25_LIKE)
    json_chain = {**CHAIN, "tool_format": "json"}
    for trajectory in run(json_chain, SlidingWindow(turns=1), renderer):
        assert trajectory.stop_reason == StopReason.ANSWERED
        env = gymnasium.make("toolgym/Zorplex-v0", **json_chain)
        question, info = env.reset(seed=trajectory.task_seed)
        head = [Message("system", info["instructions"]), Message("user", question)]
        for i in range(2, len(trajectory.transitions)):
            before = trajectory.transitions[i - 1]
            window = [
                Message("assistant", before.action.text),
                *(Message("tool", r) for r in before.info["tool_results"]),
            ]
            assert trajectory.transitions[i].info[SEQUENCE_START] is True
            expected = renderer.render_prompt(head + window, tools=info["tools"])
            assert trajectory.transitions[i].observation_tokens == expected
        assert trajectory.metrics["sequence_restarts"] == trajectory.metrics["context_rewrites"]


def test_a_failing_policy_ends_only_its_episode_as_an_env_error():
    class Broken:
        def rewrite(self, conversation):
            raise RuntimeError("policy exploded")

    trajectory = run(CHAIN, Broken(), seeds=(0,))[0]
    assert trajectory.stop_reason == StopReason.ENV_ERROR
    assert "the context policy failed: RuntimeError: policy exploded" in trajectory.error


def test_the_fallible_note_taker_follows_its_wrong_note_to_a_wrong_answer():
    env = gymnasium.make("toolgym/Zorplex-v0", **NOTES)
    env.reset(seed=5)
    script = plan_actions(env.unwrapped, OracleConfig(p_wrong_note=1.0), np.random.default_rng(0))
    oracle = env.unwrapped.oracle_actions()
    assert script != oracle and script[0] == oracle[0] and script[-1].startswith("[ANSWER]")
    trajectories = run(NOTES, oracle=OracleConfig(p_wrong_note=1.0), seeds=range(4))
    assert all(
        t.stop_reason == StopReason.ANSWERED and t.metrics["env"]["accuracy"] == 0 for t in trajectories
    )
    assert all(t.metrics["context_rewrites"] >= 1 for t in trajectories)


def test_the_engine_reuses_the_system_prompt_across_segments():
    """A rewritten prompt is new after the task, but the engine's prefix store still holds the
    system prompt the segments share: only the task and the notes are computed again."""
    renderer = shipped_renderer()
    trajectories = run(NOTES, seeds=(0, 1, 2))
    turns = []  # per turn index: the prompts the episodes saw, and whether they restart
    for trajectory in trajectories:
        for k, prompt in enumerate(rendered_segments(trajectory, renderer)):
            restart = bool(trajectory.transitions[k].info.get(SEQUENCE_START))
            turns += [[]] * (k + 1 - len(turns))
            turns[k] = [*turns[k], (prompt, restart)]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**NAMED_CONFIGS["test"], "vocab_size": renderer.vocab_size})).eval()
    system = len(renderer.render_message(Message("system", trajectories[0].system_prompt)))
    params = SamplingParams(max_tokens=1, stop_token_ids=renderer.stop_token_ids)
    restarts = 0
    with TorchEngine(model, tokenizer=renderer.tokenizer, max_seq_len=512) as engine:
        for k, batch in enumerate(turns):
            before = msgspec.structs.replace(engine.stats)
            engine.generate_sync([prompt for prompt, _ in batch], params)
            stats = engine.stats
            computed = (
                (stats.prompt_tokens - before.prompt_tokens)
                - (stats.shared_prefix_tokens - before.shared_prefix_tokens)
                - (stats.history_tokens - before.history_tokens)
            )
            if k and all(restart for _, restart in batch):  # every episode starts a segment here
                restarts += 1
                assert stats.shared_prefix_tokens - before.shared_prefix_tokens >= system * len(batch)
                longest = max(len(prompt) for prompt, _ in batch)
                assert computed <= len(batch) * (longest - system)
    assert restarts == 4  # one per note (four redirects)


def test_the_notes_preset_overflows_keep_all_and_fits_with_notes():
    from toolgym.configs.load import load_config

    config = load_config("zorplex_notes_tiny")[0]
    assert config.rollout.context == Notes(keep_last=1)
    renderer = shipped_renderer()
    rollout = msgspec.structs.replace(config.rollout_config(), group_size=1)
    for context, stop in ((None, StopReason.ANSWERED), (KeepAll(), StopReason.CONTEXT_OVERFLOW)):
        runner_config = msgspec.structs.replace(rollout, context=context or rollout.context)
        trajectories = RolloutRunner(OraclePolicy(renderer), renderer, runner_config).run(list(range(4)))
        assert all(t.stop_reason == stop for t in trajectories)


def test_the_values_preset_leaves_the_first_value_to_the_notes_alone():
    # zorplex_notes_values_tiny: keep-all overflows; the oracle's notes answer; a two-turn window
    # without notes has lost the first value from the prompt of its answer
    from toolgym.configs.load import load_config

    config = load_config("zorplex_notes_values_tiny")[0]
    renderer = shipped_renderer()
    rollout = msgspec.structs.replace(config.rollout_config(), group_size=1)
    no_notes = {**rollout.env_kwargs, "notes": False}
    cases = (
        (rollout, StopReason.ANSWERED),
        (msgspec.structs.replace(rollout, context=KeepAll()), StopReason.CONTEXT_OVERFLOW),
        (
            msgspec.structs.replace(rollout, context=SlidingWindow(turns=2), env_kwargs=no_notes),
            StopReason.ANSWERED,
        ),
    )
    for runner_config, stop in cases:
        trajectories = RolloutRunner(OraclePolicy(renderer), renderer, runner_config).run(list(range(3)))
        for t in trajectories:
            assert t.stop_reason == stop
            env = gymnasium.make("toolgym/Zorplex-v0", **runner_config.env_kwargs)
            env.reset(seed=t.task_seed)
            first = f"= {env.unwrapped.table[env.unwrapped.chain[0]]} SEE:"
            answer_prompt = renderer.decode(rendered_segments(t, renderer)[-1])
            if runner_config.context == SlidingWindow(turns=2):
                assert first not in answer_prompt and t.metrics["env"]["accuracy"] == 1  # the oracle knows
            elif stop == StopReason.ANSWERED:
                note = f"NOTE[{env.unwrapped.table[env.unwrapped.chain[0]]} "
                assert first not in answer_prompt and note in answer_prompt  # carried by the last note
