"""toolgym/TextArena-v0: offline TextArena games through check_env, random-action episodes,
the games' own reference solutions, determinism per seed (also with episodes interleaved), the
scripted opponent, games refused offline, and recordings replayed with --verify (the oracle
through the CLI; a model policy on a game without an oracle)."""

import math
import re
import subprocess
import sys
import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

pytest.importorskip("textarena")

from toolgym.envs import list_envs
from toolgym.envs.adapters.textarena import GameUnavailable, offline_problem

ENV_ID = "toolgym/TextArena-v0"
SINGLE = ["GuessTheNumber-v0", "Mastermind-v0", "TowerOfHanoi-v0", "FrozenLake-v0"]
TWO = ["TicTacToe-v0", "ConnectFour-v0", "Nim-v0", "KuhnPoker-v0"]
GAMES = SINGLE + TWO
_MOVE = re.compile(r"\[[^\[\]\n]{1,20}\]")
# Moves of the games whose board does not list them (their prompt shows one example).
MOVES = {
    "TowerOfHanoi-v0": [f"[{a} {b}]" for a in "ABC" for b in "ABC" if a != b],
    "Nim-v0": [f"[{pile} {count}]" for pile in range(3) for count in range(1, 6)],
}


def make(game, **kwargs):
    return gymnasium.make(ENV_ID, game=game, **kwargs)


def test_registered_and_listed_with_its_knobs():
    knobs = list_envs()[ENV_ID]
    assert knobs["game"] == "GuessTheNumber-v0" and knobs["opponent"] == "random" and knobs["player"] == 0
    assert knobs["invalid_move_penalty"] == 0.0 and knobs["max_turns"] == 100


@pytest.mark.parametrize("game", GAMES)
def test_check_env(game):
    env = make(game)
    assert env.unwrapped.num_players == (1 if game in SINGLE else 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)


def random_action(observation: str, env, rng: np.random.Generator) -> str:
    """Mostly a move the game showed (often legal), sometimes noise."""
    moves = _MOVE.findall(observation + env.unwrapped.system_prompt) + MOVES.get(env.unwrapped.game_id, [])
    if moves and rng.random() < 0.8:
        return moves[int(rng.integers(len(moves)))]
    return env.action_space.sample()


def play(env, seed, rng, max_steps=200):
    observation, _ = env.reset(seed=seed)
    transcript, total = [observation], 0.0
    for _ in range(max_steps):
        action = random_action(observation, env, rng)
        observation, reward, terminated, truncated, info = env.step(action)
        transcript += [action, observation, reward]
        total += reward
        if terminated or truncated:
            return transcript, total, terminated, truncated, info
    raise AssertionError("the episode did not end")


@pytest.mark.parametrize("game", GAMES)
def test_100_random_action_episodes(game):
    env = make(game, max_turns=30)
    env.action_space.seed(0)
    rng = np.random.default_rng(0)
    legal_moves = 0
    for seed in range(100):
        _, total, terminated, truncated, info = play(env, seed, rng)
        assert terminated != truncated
        assert math.isclose(total, sum(info["reward_components"].values()), abs_tol=1e-9)
        assert info["metrics"]["invalid_moves"] == info["invalid_moves"] and info["failure_mode"]
        legal_moves += info["turn"] - info["invalid_moves"]
    assert legal_moves >= 50  # the games were played, not only refused


@pytest.mark.parametrize("game", ["GuessTheNumber-v0", "Mastermind-v0"])
def test_the_games_reference_solution_scores_full_reward(game):
    env = make(game)
    for seed in range(10):
        _, info = env.reset(seed=seed)
        actions = env.unwrapped.oracle_actions()
        assert info["answer"] == actions[-1]
        for action in actions:
            _, reward, terminated, truncated, info = env.step(action)
        assert terminated and not truncated and reward == 1.0 and info["failure_mode"] == "success"
        assert info["metrics"]["success"] == 1.0 and info["reward_components"]["game"] == 1.0


def test_a_game_without_a_reference_has_no_oracle():
    env = make("TicTacToe-v0")
    _, info = env.reset(seed=0)
    assert info["answer"] is None
    with pytest.raises(NotImplementedError, match="no reference solution"):
        env.unwrapped.oracle_actions()


def test_a_bot_is_the_oracle_of_a_two_player_game_without_a_reference():
    """oracle="random": the bot's legal moves for the policy's seat, found on a copy of the env
    (asking twice gives the same moves), then played by the env itself to the same game end."""
    outcomes, players = set(), set()
    for seed in range(12):
        env = make("TicTacToe-v0", oracle="random", player="alternate")
        _, start = env.reset(seed=seed)
        assert start["player"] == seed % 2 and f"You are Player {seed % 2}" in env.unwrapped.system_prompt
        players.add(start["player"])
        moves = env.unwrapped.oracle_actions()
        assert moves == env.unwrapped.oracle_actions() and len(set(moves)) == len(moves)
        for move in moves:
            _, _, terminated, truncated, info = env.step(move)
            assert not info["invalid_move"]
        assert terminated and not truncated
        outcomes.add(info["metrics"]["game_reward"])
    assert outcomes == {-1.0, 0.0, 1.0} and players == {0, 1}  # random play wins, draws and loses
    with pytest.raises(ValueError, match="oracle must be None, 'random' or 'first'"):
        make("TicTacToe-v0", oracle="expert")
    env = make("GuessTheNumber-v0", oracle="random")  # one player: the oracle is its reference
    env.reset(seed=0)
    assert env.unwrapped.oracle_actions() == env.unwrapped._reference()


@pytest.mark.parametrize("game", GAMES)
def test_deterministic_per_seed_even_interleaved(game):
    alone = []
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        env = make(game, max_turns=30)
        env.action_space.seed(seed)
        alone.append(play(env, seed, rng)[0])
    # the same two episodes, stepped in turn: each env keeps its own random state
    envs = [make(game, max_turns=30) for _ in range(2)]
    rngs = [np.random.default_rng(seed) for seed in (0, 1)]
    observations, transcripts, done = [], [], [False, False]
    for seed, env in enumerate(envs):
        env.action_space.seed(seed)
        observations.append(env.reset(seed=seed)[0])
        transcripts.append([observations[-1]])
    while not all(done):
        for i, env in enumerate(envs):
            if done[i]:
                continue
            action = random_action(observations[i], env, rngs[i])
            observations[i], reward, terminated, truncated, _ = env.step(action)
            transcripts[i] += [action, observations[i], reward]
            done[i] = terminated or truncated
    assert transcripts == alone


def test_the_opponent_plays_legal_moves_and_answers_in_the_observation():
    for opponent in ("first", "random"):
        env = make("TicTacToe-v0", opponent=opponent)
        env.reset(seed=0)
        obs, _, _, _, info = env.step("[4]")
        assert not info["invalid_move"] and "[Player 1]" in obs and "attempted an invalid" not in obs
    first = make("TicTacToe-v0", opponent="first")
    first.reset(seed=0)
    assert "[Player 1] [0]" in first.step("[4]")[0]
    # the policy in the second seat: the opponent has moved before the first observation
    question, _ = make("TicTacToe-v0", player=1).reset(seed=0)
    assert "[Player 0]" in question


def test_invalid_moves_are_error_observations_counters_and_penalties():
    env = make("TicTacToe-v0", invalid_move_penalty=0.1)
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("I pass")
    assert "attempted an invalid move" in obs and not terminated
    assert reward == -0.1 and info["invalid_moves"] == 1 and info["reward_components"]["invalid_move"] == -0.1
    obs, reward, terminated, _, info = env.step("[42]")  # the game's own limit: the second one loses
    assert terminated and info["failure_mode"] == "invalid_move" and info["end_reason"] == "parse_error"
    assert reward == pytest.approx(-1.1) and info["reward_components"] == {"game": -1.0, "invalid_move": -0.2}


def test_turn_limit_truncates_and_abandon_settles():
    env = make("GuessTheNumber-v0", max_turns=1)
    env.reset(seed=0)
    answer = env.unwrapped.answer
    wrong = "[1]" if answer != "[1]" else "[2]"
    _, reward, terminated, truncated, info = env.step(wrong)
    assert (terminated, truncated, info["end_reason"], reward) == (False, True, "max_turns", 0.0)
    env = make("GuessTheNumber-v0")
    env.reset(seed=0)
    env.step(wrong)
    reward, info = env.unwrapped.abandon()
    assert reward == 0.0 and info["failure_mode"] == "no_answer" and info["metrics"]["success"] == 0.0


def test_games_that_need_downloads_are_refused_in_one_line():
    problem = offline_problem("Wordle-v0")
    if problem is None:
        pytest.skip("this machine has the NLTK data Wordle needs")
    with pytest.raises(GameUnavailable) as refused:
        make("Wordle-v0")
    text = str(refused.value)
    assert "\n" not in text and "NLTK data" in text and "words" in text and "Wordle-v0" in text
    llm = str(offline_problem("TwentyQuestions-v0"))
    assert "\n" not in llm and "LLM" in llm
    with pytest.raises(ValueError, match="unknown TextArena game"):
        make("NoSuchGame-v0")


def test_a_game_that_runs_offline_is_not_refused_for_a_script_beside_it():
    # Crosswords' folder holds a clue generator that calls an LLM; the game itself never imports it
    assert offline_problem("Crosswords-v0") is None
    env = make("Crosswords-v0")
    observation, _ = env.reset(seed=0)
    assert observation


@pytest.mark.parametrize("game", ["ScorableGames-v0", "UsedCarNegotiation-v0"])
def test_a_game_whose_data_the_package_lacks_is_refused_in_one_line(game):
    with pytest.raises(GameUnavailable) as refused:
        make(game)
    text = str(refused.value)
    assert "\n" not in text and game in text and "data file" in text


@pytest.mark.parametrize("game", ["Countdown-v0", "Cryptarithm-v0", "Slitherlink-v0"])
def test_a_game_that_hands_its_reason_as_the_reward_ends_lost(game):
    """A second invalid move ends these games with the reason text where the reward goes."""
    env = make(game)
    env.reset(seed=0)
    for _ in range(3):
        _, reward, terminated, _, _ = env.step("[this is no move]")
        if terminated:
            break
    assert terminated and math.isfinite(reward) and env.unwrapped._components["game"] == -1.0


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "toolgym.configs.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


@pytest.mark.slow
def test_oracle_recorded_and_replayed_exactly_through_the_cli(tmp_path):
    out = tmp_path / "ta.jsonl"
    record = cli(
        "record", "--env", ENV_ID, "--env-kwargs", '{"game": "Mastermind-v0"}', "--policy", "oracle",
        "--tasks", "5", "--group-size", "2", "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert record.returncode == 0, record.stdout + record.stderr
    assert "recorded 10 episodes" in record.stdout, record.stdout
    replay = cli("replay", str(out), "--verify", "--summary-only")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "verify: 10/10 episodes replay exactly" in replay.stdout, replay.stdout


@pytest.mark.slow
def test_a_game_without_an_oracle_records_with_a_model_policy(tmp_path):
    """A tiny random checkpoint plays TicTacToe (mostly invalid moves); replay is exact."""
    import torch
    from tokenizers import Tokenizer

    from toolgym.agents.model.checkpoint import save_hf_checkpoint
    from toolgym.agents.model.config import NAMED_CONFIGS, ModelConfig
    from toolgym.agents.model.transformer import Transformer
    from toolgym.configs.cli.main import DEFAULT_TOKENIZER

    torch.manual_seed(0)
    vocab = Tokenizer.from_file(str(DEFAULT_TOKENIZER)).get_vocab_size()
    config = ModelConfig(**{**NAMED_CONFIGS["test"], "vocab_size": vocab})
    ckpt = save_hf_checkpoint(
        Transformer(config).eval(), config, tmp_path / "ckpt", tokenizer_path=DEFAULT_TOKENIZER
    )
    out = tmp_path / "model.jsonl"
    env = ["--env", ENV_ID, "--env-kwargs", '{"game": "TicTacToe-v0"}', "--policy", str(ckpt)]
    limits = ["--max-tokens-per-turn", "6", "--max-turns", "4"]
    record = cli(
        "record", *env, *limits, "--tasks", "2", "--group-size", "2", "--out", str(out), "--no-progress"
    )
    assert record.returncode == 0, record.stdout + record.stderr
    replay = cli(
        "replay", str(out), "--verify", "--summary-only", "--tokenizer", str(ckpt / "tokenizer.json")
    )
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "verify: 4/4 episodes replay exactly" in replay.stdout, replay.stdout
