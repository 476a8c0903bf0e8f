"""Zorplex: every tier and difficulty passes check_env, its oracle earns the max reward, it is
deterministic under a seed, and its tools answer in the documented formats."""

import json
import re
import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from toolgym.envs import ZorplexEnv
from toolgym.envs.tasks.zorplex import DIFFICULTIES, WORDS, fixed_table

TIER_CONFIGS = [(tier, difficulty) for tier, levels in DIFFICULTIES.items() for difficulty in levels]
MAX_REWARD = 1.2  # correct 1.0 + format 0.2, no penalties


def make(tier="simple", difficulty=None, **kwargs):
    return gymnasium.make("toolgym/Zorplex-v0", tier=tier, difficulty=difficulty, **kwargs)


def run(env, actions):
    """Step through `actions`; returns [(obs, reward, terminated, truncated, info)]."""
    return [env.step(action) for action in actions]


@pytest.mark.parametrize(("tier", "difficulty"), TIER_CONFIGS)
def test_check_env_without_warnings(tier, difficulty):
    env = make(tier, difficulty)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any Gymnasium checker warning fails the test
        check_env(env.unwrapped)


@pytest.mark.parametrize(("tier", "difficulty"), TIER_CONFIGS)
def test_oracle_reaches_max_reward(tier, difficulty):
    env = make(tier, difficulty)
    for seed in range(30):
        question, info = env.reset(seed=seed)
        assert info["question"] == question == env.unwrapped.question
        assert info["answer"] == env.unwrapped.answer
        assert isinstance(info["answer"], str if tier == "list" else int)
        assert info["system_prompt"] == env.unwrapped.system_prompt
        oracle = env.unwrapped.oracle_actions()
        assert oracle[-1] == f"[ANSWER] {info['answer']}"
        steps = run(env, oracle)
        rewards = [step[1] for step in steps]
        obs, _, terminated, truncated, final = steps[-1]
        assert (obs, terminated, truncated) == ("CORRECT", True, False)
        assert sum(rewards) == pytest.approx(MAX_REWARD)
        assert final["reward_components"] == pytest.approx(
            {"correct": 1.0, "format": 0.2, "tool_penalty": 0.0, "error_penalty": 0.0}
        )
        assert final["failure_mode"] == "success" and final["end_reason"] == "answered"
        assert final["tool_calls"] == len(oracle) - 1 == info["needed_tool_calls"]
        assert final["turn"] == len(oracle) <= info["max_turns"] == 5
        assert all(not step[2] and not step[3] for step in steps[:-1])


@pytest.mark.parametrize(("tier", "difficulty"), TIER_CONFIGS)
def test_same_seed_same_actions_same_everything(tier, difficulty):
    actions = ["LOOKUP[apple]", "GETKEY[cat]", "junk", "FETCH[ZK_000000]", "[ANSWER] 7"]
    transcripts = []
    for _ in range(2):
        env = make(tier, difficulty)
        transcript = [env.reset(seed=11)]
        for action in actions:
            transcript.append(env.step(action))
            if transcript[-1][2] or transcript[-1][3]:
                break
        transcript.append(env.unwrapped.oracle_actions())
        transcripts.append(json.dumps(transcript))  # infos are JSON-serialisable, too
    assert transcripts[0] == transcripts[1]


@pytest.mark.parametrize(("tier", "difficulty"), TIER_CONFIGS)
def test_different_seeds_give_different_tables_and_tasks(tier, difficulty):
    env = make(tier, difficulty).unwrapped
    tables, questions = set(), set()
    for seed in range(20):
        question, _ = env.reset(seed=seed)
        questions.add(question)
        tables.add(tuple(env.table[w] for w in WORDS))
    assert len(tables) == 20
    assert len(questions) >= 10


def test_reset_without_seed_continues_the_seeded_stream():
    env_a, env_b = make().unwrapped, make().unwrapped
    env_a.reset(seed=5)
    env_b.reset(seed=5)
    assert [env_a.reset()[0] for _ in range(5)] == [env_b.reset()[0] for _ in range(5)]


def test_no_global_random_state_is_used():
    np.random.seed(0)
    before = np.random.get_state()[1].copy()
    env = make("compositional", "hard")
    env.reset(seed=1)
    run(env, env.unwrapped.oracle_actions())
    assert np.array_equal(np.random.get_state()[1], before)


def test_table_seed_42_is_the_documented_table():
    expected = np.random.default_rng(42).integers(1, 101, size=26).tolist()
    env = make(table_seed=42).unwrapped
    for seed in (0, 1, 2):
        env.reset(seed=seed)
        assert [env.table[w] for w in WORDS] == expected
    assert fixed_table(42)[0] == dict(zip(WORDS, expected, strict=True))
    assert all(1 <= v <= 100 for v in expected)


def test_per_episode_values_cover_1_to_100():
    env = make().unwrapped
    values = []
    for seed in range(100):
        env.reset(seed=seed)
        values += env.table.values()
    assert min(values) == 1 and max(values) == 100


def test_lookup_results_and_unknowns():
    env = make().unwrapped
    env.reset(seed=0)
    obs, reward, *_ = env.step("LOOKUP[Apple] lookup['banana'] LOOKUP[ \"cat\" ] LOOKUP[kiwi]")
    assert obs.splitlines() == [
        f"LOOKUP[Apple] = {env.table['apple']}",
        f"LOOKUP[banana] = {env.table['banana']}",
        f"LOOKUP[cat] = {env.table['cat']}",
        "LOOKUP[kiwi] = UNKNOWN",
    ]
    assert reward == pytest.approx(-0.3)  # 4 calls, 1 needed; UNKNOWN is a result, not an error
    obs, *_, info = env.step("SEARCH[apple]")
    assert obs == "SEARCH[apple] = UNKNOWN_TOOL" and info["step_errors"] == ["unknown_tool"]


def test_multi_step_keys_and_errors():
    env = make("multi_step").unwrapped
    env.reset(seed=3)
    assert len(set(env.keys.values())) == 26
    assert all(re.fullmatch(r"ZK_[0-9A-F]{6}", key) for key in env.keys.values())
    key = env.keys["dog"]
    obs, *_ = env.step(f"GETKEY[dog] FETCH[{key.lower()}] GETKEY[kiwi] FETCH[ZK_XYZ] LOOKUP[dog]")
    assert obs.splitlines() == [
        f"GETKEY[dog] = {key}",
        f"FETCH[{key.lower()}] = {env.table['dog']}",
        "GETKEY[kiwi] = UNKNOWN_WORD",
        "FETCH[ZK_XYZ] = INVALID_KEY",
        "LOOKUP[dog] = UNKNOWN_TOOL",
    ]
    fixed = make("multi_step", table_seed=42).unwrapped
    fixed.reset(seed=0)
    keys = dict(fixed.keys)
    fixed.reset(seed=1)
    assert fixed.keys == keys  # keys follow the table seed


@pytest.mark.parametrize(
    ("difficulty", "depths"), [("easy", {1}), ("medium", {2}), ("hard", {3}), (None, {1, 2, 3})]
)
def test_recursive_chains(difficulty, depths):
    env = make("recursive", difficulty).unwrapped
    seen = set()
    for seed in range(40):
        question, _ = env.reset(seed=seed)
        word = re.search(r"'(\w+)'", question).group(1)
        depth = 0
        while word in env.redirects:
            obs, *_ = env.step(f"LOOKUP[{word}]")
            assert obs == f"LOOKUP[{word}] = SEE: {env.redirects[word]}"
            word, depth = env.redirects[word], depth + 1
        obs, *_ = env.step(f"LOOKUP[{word}]")
        assert obs == f"LOOKUP[{word}] = {env.answer}"
        seen.add(depth)
    assert seen == depths


def test_compositional_ops_and_left_to_right():
    env = make("compositional", "hard").unwrapped
    ops = set()
    for seed in range(60):
        question, _ = env.reset(seed=seed)
        words = re.findall(r"zorplex\('(\w+)'\)", question)
        found = re.findall(r"\) ([-+*]) zorplex", question)
        assert len(words) == 3 == len(found) + 1 and len(set(words)) == 3
        a, b, c = (env.table[w] for w in words)
        step1 = eval(f"{a} {found[0]} {b}")
        assert env.answer == eval(f"{step1} {found[1]} {c}")
        ops.update(found)
    assert ops == {"+", "-", "*"}
    easy = make("compositional", "easy").unwrapped
    easy.reset(seed=0)
    assert re.fullmatch(r"What is zorplex\('\w+'\) \+ zorplex\('\w+'\)\?", easy.question)


def test_system_prompt_describes_tools_rules_and_example():
    prompt = make("multi_step").unwrapped.system_prompt
    assert "GETKEY[word]: the key of a word" in prompt
    assert "FETCH[key]: the zorplex value stored under a key" in prompt
    assert "one tool per turn" in prompt and "[ANSWER] <number>" in prompt and "Example:" in prompt


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tier": "nope"}, "tier must be one of"),
        ({"tier": "simple", "difficulty": "hard"}, "takes difficulty in"),
        ({"tier": "compositional", "difficulty": "extreme"}, "takes difficulty in"),
        ({"table_seed": -1}, "table_seed"),
        ({"tier": "recursive", "max_turns": 4}, "max_turns >= 5"),
        ({"tier": "list", "items": 6}, "max_turns >= 7 and max_tool_calls >= 6"),
        ({"tier": "list", "items": 1}, "items is the list tier's number of words, an int in 2..13"),
        ({"tier": "recursive", "items": 3}, "items is the list tier's"),
        ({"tier": "compositional", "difficulty": "hard", "max_tool_calls": 2}, "max_tool_calls >= 3"),
        ({"max_turns": 0}, "max_turns must be an int >= 1"),
        ({"error_penalty": -0.1}, "error_penalty is a magnitude"),
        ({"render_mode": "human"}, "no render modes"),
    ],
)
def test_bad_configuration_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ZorplexEnv(**kwargs)


def test_chain_reward_pays_each_link_followed_once_and_changes_no_text():
    plain, dense = make("recursive", "hard"), make("recursive", "hard", chain_reward=0.1)
    for seed in range(5):
        first, _ = plain.reset(seed=seed)
        assert dense.reset(seed=seed)[0] == first
        chain = dense.unwrapped.chain
        assert len(chain) == 4 and chain[0] in first
        # the asked word twice (pays once), a word off the chain, then the rest of the chain
        actions = [f"LOOKUP[{chain[0]}]", f"LOOKUP[{chain[0]}]", f"LOOKUP[{chain[2]}]"]
        actions += [f"LOOKUP[{w}]" for w in chain[1:]]
        actions = actions[:4]  # max_turns 5: four calls, then the answer
        actions += [f"[ANSWER] {dense.unwrapped.answer}"]
        a, b = run(plain, actions), run(dense, actions)
        assert [s[0] for s in a] == [s[0] for s in b]  # the same observations
        extra = [rb - ra for (_, ra, *_), (_, rb, *_) in zip(a, b, strict=True)]
        # pays: the asked word, then chain[1]; the repeat and chain[2] before chain[1] pay nothing
        assert extra == pytest.approx([0.1, 0.0, 0.0, 0.1, 0.0])
        assert b[-1][4]["reward_components"]["chain"] == pytest.approx(0.2)
        assert "chain" not in a[-1][4]["reward_components"]


def test_the_oracle_collects_the_whole_chain_reward():
    env = make("recursive", "medium", chain_reward=0.25)
    env.reset(seed=3)
    steps = run(env, env.unwrapped.oracle_actions())
    assert sum(s[1] for s in steps) == pytest.approx(MAX_REWARD + 3 * 0.25)  # 3 words in the chain
    assert steps[-1][4]["reward_components"]["chain"] == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tier": "simple", "chain_reward": 0.1}, "recursive and list tiers"),
        ({"tier": "recursive", "chain_reward": float("nan")}, "finite"),
        ({"tier": "recursive", "chain_reward": True}, "finite"),
    ],
)
def test_chain_reward_is_refused_where_it_means_nothing(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZorplexEnv(**kwargs)


@pytest.mark.parametrize(
    ("difficulty", "lengths"), [("easy", {2}), ("medium", {3}), ("hard", {4}), (None, {2, 3, 4})]
)
def test_list_asks_distinct_words_and_wants_their_values_in_order(difficulty, lengths):
    env = make("list", difficulty).unwrapped
    seen = set()
    for seed in range(40):
        question, _ = env.reset(seed=seed)
        words = re.findall(r"'(\w+)'", question)
        assert words == env.chain and len(set(words)) == len(words)
        assert env.answer == " ".join(str(env.table[w]) for w in words)
        seen.add(len(words))
    assert seen == lengths
    env = make("list", "medium", max_turns=6)
    env.reset(seed=5)
    words = env.unwrapped.chain
    values = [env.unwrapped.table[w] for w in words]
    steps = run(env, [f"LOOKUP[{w}]" for w in words])
    assert [s[0] for s in steps] == [f"LOOKUP[{w}] = {v}" for w, v in zip(words, values, strict=True)]
    obs, reward, *_ = env.step(f"[ANSWER] {values[1]} {values[0]} {values[2]}")
    assert obs != "CORRECT" and reward < 1.0  # the values, but out of order
    fixed = make("list", items=7, max_turns=8, max_tool_calls=7).unwrapped
    fixed.reset(seed=0)
    assert len(fixed.chain) == 7 and len(fixed.oracle_actions()) == 8


def test_list_chain_reward_pays_each_asked_words_first_lookup_in_any_order():
    plain, dense = make("list", "hard", max_turns=7), make("list", "hard", chain_reward=0.2, max_turns=7)
    for seed in range(5):
        first, _ = plain.reset(seed=seed)
        assert dense.reset(seed=seed)[0] == first
        words = dense.unwrapped.chain
        off_list = next(w for w in WORDS if w not in words)
        # the last word first, a word not asked, the last word again, then the rest in order
        actions = [f"LOOKUP[{words[3]}]", f"LOOKUP[{off_list}]", f"LOOKUP[{words[3]}]"]
        actions += [f"LOOKUP[{w}]" for w in words[:3]] + [f"[ANSWER] {dense.unwrapped.answer}"]
        a, b = run(plain, actions), run(dense, actions)
        assert [s[0] for s in a] == [s[0] for s in b]  # the same observations
        extra = [rb - ra for (_, ra, *_), (_, rb, *_) in zip(a, b, strict=True)]
        # a wrong lookup does not stop later ones paying; the repeat pays nothing
        assert extra == pytest.approx([0.2, 0.0, 0.0, 0.2, 0.2, 0.2, 0.0])
        assert b[-1][4]["reward_components"]["chain"] == pytest.approx(0.8)
        assert b[-1][0] == "CORRECT"


def test_the_wrong_lookup_demonstrator_errs_per_lookup_and_answers_what_it_looked_up():
    from toolgym.rollouts.scripted import OracleConfig, plan_actions

    env = make("list", "hard").unwrapped
    wrong_lookups, wrong_episodes, episodes = 0, 0, 400
    for seed in range(episodes):
        env.reset(seed=seed)
        script = plan_actions(env, OracleConfig(p_wrong_lookup=0.25), np.random.default_rng(seed))
        looked_up = [re.fullmatch(r"LOOKUP\[(\w+)\]", a).group(1) for a in script[:-1]]
        assert len(looked_up) == 4
        misses = [got != want for got, want in zip(looked_up, env.chain, strict=True)]
        assert all(got not in env.chain for got, miss in zip(looked_up, misses, strict=True) if miss)
        assert script[-1] == "[ANSWER] " + " ".join(str(env.table[w]) for w in looked_up)
        wrong_lookups += sum(misses)
        wrong_episodes += any(misses)
        if not any(misses):
            assert script == env.oracle_actions()
    # each of the 4 lookups goes wrong with p = 0.25 on its own: 1 - 0.75^4 = 0.68 of episodes
    assert wrong_lookups / (4 * episodes) == pytest.approx(0.25, abs=0.04)
    assert wrong_episodes / episodes == pytest.approx(1 - 0.75**4, abs=0.06)
    assert make("recursive", "hard").unwrapped.wrong_lookup_actions(np.random.default_rng(0), 1.0) is None


def test_a_collecting_chain_shows_every_value_and_wants_them_all_in_order():
    env = make("recursive", "hard", collect=True)
    check_env(env.unwrapped, skip_render_check=True)
    for seed in range(10):
        question, _ = env.reset(seed=seed)
        u = env.unwrapped
        assert question == f"What are the zorplex values along the chain from '{u.chain[0]}'?"
        for word, nxt in zip(u.chain, u.chain[1:], strict=False):
            assert env.step(f"LOOKUP[{word}]")[0] == f"LOOKUP[{word}] = {u.table[word]} SEE: {nxt}"
        assert env.step(f"LOOKUP[{u.chain[-1]}]")[0] == f"LOOKUP[{u.chain[-1]}] = {u.table[u.chain[-1]]}"
        values = [str(u.table[w]) for w in u.chain]
        assert u.answer == " ".join(values) and len(values) == 4
        assert env.step(f"[ANSWER] {' '.join(values[1:])}")[0].startswith("INCORRECT")  # all, in order
    assert "answer every value on it, in chain order" in u.system_prompt
    assert "LOOKUP[cat] = 17 SEE: sun" in u.system_prompt
    with pytest.raises(ValueError, match="collect is a recursive tier's variant"):
        ZorplexEnv(tier="list", collect=True)


def test_a_collecting_note_taker_carries_the_values_so_far_and_errs_two_ways():
    from toolgym.rollouts.scripted import OracleConfig, plan_actions

    env = make("recursive", collect=True, notes=True, redirects=4, max_turns=14, max_tool_calls=8)
    env.reset(seed=3)
    u = env.unwrapped
    values = [str(u.table[w]) for w in u.chain]
    notes = [a for a in u.oracle_actions() if a.startswith("NOTE[")]
    assert notes == [f"NOTE[{' '.join([*values[:k], u.chain[k]])}]" for k in range(1, 5)]
    assert run(env, u.oracle_actions())[-1][1] == pytest.approx(MAX_REWARD)
    kinds = set()
    for seed in range(40):
        env.reset(seed=seed)
        values = [str(u.table[w]) for w in u.chain]
        script = plan_actions(u, OracleConfig(p_wrong_note=1.0), np.random.default_rng(seed))
        steps = run(env, script)
        assert steps[-1][0].startswith("INCORRECT") and steps[-1][2]
        looked_up = [re.fullmatch(r"LOOKUP\[(\w+)\]", a).group(1) for a in script if a.startswith("LOOKUP")]
        answered = script[-1].removeprefix("[ANSWER] ").split()
        if looked_up == u.chain:  # a miscopied value, carried to the answer
            assert sum(a != v for a, v in zip(answered, values, strict=True)) == 1
            kinds.add("miscopy")
        else:  # a wrong word followed: the values it read, in order
            assert looked_up[-1] not in u.chain and answered == [str(u.table[w]) for w in looked_up]
            kinds.add("wrong word")
    assert kinds == {"miscopy", "wrong word"}
