"""toolgym/TextWorld-v0: games generated and compiled from the seed (TextWorld's own generator
and Inform 7), the walkthrough oracle winning them, the score's per-turn rewards, invalid
commands answered and counted, cleaned observations, the compiled-game cache (reused, built
once by two processes at once), a game that cannot be built failing only its reset, and
check_env. Compiling a game takes a second or two of CPU: the games are built once per module."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium
import pytest
import torch
from gymnasium.utils.env_checker import check_env

pytest.importorskip("textworld")

from toolgym.configs.assembly.parts import build_renderer, model_config
from toolgym.configs.checks import check_against_machine, check_environment
from toolgym.configs.cli.main import main as cli_main
from toolgym.configs.load import load_config
from toolgym.envs import list_envs
from toolgym.envs.adapters.textworld import (
    ADMISSIBLE_HEADING,
    Renaming,
    TextWorldEnv,
    TextWorldGameError,
    clean_feedback,
    generator_seed,
)
from toolgym.rollouts.batches import TaskSeedStream
from toolgym.trainers.metrics_log import read_metrics

ENV_ID = "toolgym/TextWorld-v0"
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def game_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("textworld-games")


def make(game_dir: Path, **kwargs) -> TextWorldEnv:
    env = gymnasium.make(ENV_ID, game_dir=str(game_dir), **kwargs).unwrapped
    assert isinstance(env, TextWorldEnv)
    return env


def play(env, actions):
    """Step `actions` until the episode ends: (rewards, observations, last info, terminated)."""
    rewards, observations, info, terminated = [], [], {}, False
    for action in actions:
        observation, reward, terminated, truncated, info = env.step(action)
        rewards.append(reward)
        observations.append(observation)
        if terminated or truncated:
            break
    return rewards, observations, info, terminated


def test_registered_and_listed_with_its_knobs():
    knobs = list_envs()[ENV_ID]
    assert knobs["nb_rooms"] == 5 and knobs["quests"] == 3 and knobs["quest_length"] == 5
    assert knobs["admissible_commands"] is False and knobs["game_dir"] is None


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_oracle_wins_and_the_score_rewards_sum_to_the_final_score(game_dir, seed):
    env = make(game_dir)
    _, info = env.reset(seed=seed)
    walkthrough = env.oracle_actions()
    assert len(walkthrough) >= 9 and env.answer == walkthrough[-1]
    assert info["max_score"] == 3
    rewards, _, last, terminated = play(env, walkthrough)
    assert terminated and len(rewards) == len(walkthrough)
    assert last["end_reason"] == "answered" and last["failure_mode"] == "success"
    metrics = last["metrics"]
    assert metrics["success"] == 1.0 and metrics["normalized_score"] == 1.0
    assert sum(rewards) == metrics["score"] == info["max_score"] == sum(last["reward_components"].values())
    assert sum(1 for r in rewards if r > 0) == 3  # one point per quest, at the step it is reached
    assert metrics["invalid_commands"] == 0.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("look")
    env.close()


def test_the_basic_theme_names_objects_by_number_and_lists_the_steps(game_dir):
    env = make(game_dir, nb_rooms=2, nb_objects=4, quest_length=5, quests=2, theme="basic")
    observation, info = env.reset(seed=1)
    assert info["game"].endswith("-basic") and env.game_path(1).parent.name.startswith(f"tw-{info['game']}-")
    walkthrough = env.oracle_actions()
    assert len(walkthrough) >= 8 and info["max_score"] == 2
    # The goal states each step in order in plain sentences; the names are numbered (box6, W-key).
    assert observation.startswith("First, ") and "Next, " in observation
    assert any(re.search(r"\b[a-z]+\d+\b|\b[A-Z]-[a-z]+\b", command) for command in walkthrough)
    _, _, last, terminated = play(env, walkthrough)
    assert terminated and last["metrics"]["success"] == 1.0
    env.close()
    for theme in ("castle", ["basic"]):
        with pytest.raises(ValueError, match="theme must be one of"):
            make(game_dir, theme=theme)


@pytest.mark.slow
def test_a_game_whose_walkthrough_is_ambiguous_is_made_with_other_names(game_dir):
    # TextWorld's first text seed for this game names a "safe" and a "Canadian style safe", and
    # the walkthrough's "insert ... into safe" is answered "Which do you mean ...?".
    env = make(game_dir, quest_length=4)
    env.reset(seed=2147483649)
    _, _, last, terminated = play(env, env.oracle_actions())
    assert terminated and last["metrics"]["success"] == 1.0
    env.close()


@pytest.mark.slow
def test_same_seed_same_transcript_and_seeds_differ(game_dir):
    env = make(game_dir)
    first, _ = env.reset(seed=0)
    transcript = play(env, ["look", *env.oracle_actions()])[1]
    again, _ = env.reset(seed=0)
    assert again == first and play(env, ["look", *env.oracle_actions()])[1] == transcript
    other, _ = env.reset(seed=1)
    assert other != first
    env.close()


def test_training_streams_play_different_games(game_dir):
    """Task streams are 2**32 apart (SFT's demonstrations and RL's tasks are two streams): their
    seeds must not fold onto the same games, nor onto the held-out eval games."""
    firsts = [TaskSeedStream(stream=k).take(1)[0][0] for k in (0, 1, 2)]
    assert len({generator_seed(s) for s in firsts}) == 3 and generator_seed(5) == 5
    assert all(generator_seed(s) >= 2**31 for s in firsts)
    env = make(game_dir, nb_rooms=2, nb_objects=4, quest_length=2, quests=2)
    openings = {env.reset(seed=s)[0] for s in firsts[:2]}
    assert len(openings) == 2
    env.close()


def test_renaming_is_a_bijection_that_keeps_keys_paired_with_their_locks():
    text = "Unlock C-box with C-key, take key8 from box05 in Room66; room0, c-door, thing33, snack1."
    shown = Renaming(7).show(text)
    assert Renaming(7).show(text) == shown and Renaming(8).show(text) != shown
    assert Renaming(7).unshow(shown) == text and Renaming(7).show(Renaming(7).unshow(text)) == text
    letter = re.search(r"Unlock ([A-Z])-box with ([A-Z])-key", shown)
    assert letter and letter.group(1) == letter.group(2)  # a key still opens its own lock
    assert re.search(rf"\b{letter.group(1).lower()}-door\b", shown)  # and the case is kept
    # Every noun keeps its noun and a number of 1-2 digits; text that is not a name is untouched.
    assert re.fullmatch(
        r"Unlock [A-Z]-box with [A-Z]-key, take key\d{1,2} from box\d{1,2} in Room\d{1,2}; "
        r"room\d{1,2}, [a-z]-door, thing\d{1,2}, snack\d{1,2}\.",
        shown,
    )
    names = [Renaming(seed).show("box6") for seed in range(40)]
    assert len(set(names)) > 20  # the number is drawn over the grammar's 110 numerals


def test_renamed_training_games_are_shared_won_and_read_under_other_names(game_dir):
    env = make(
        game_dir, nb_rooms=2, nb_objects=4, quest_length=5, quests=2, theme="basic",
        rename_entities=True, training_games=2,
    )  # fmt: skip
    seeds = TaskSeedStream(stream=0).take(6)[0] + TaskSeedStream(stream=1).take(6)[0]
    assert {env.generator_seed(s) for s in seeds} == {2**31, 2**31 + 1}  # two games, however many seeds
    assert env.generator_seed(1) == 1  # held-out eval seeds are their own games
    openings = {}
    for seed in seeds[:4]:
        opening, info = env.reset(seed=seed)
        openings.setdefault(info["generator_seed"], set()).add(opening)
        renamed = env.oracle_actions()
        _, _, last, terminated = play(env, renamed)
        assert terminated and last["metrics"]["success"] == 1.0 and last["invalid_commands"] == 0
    # Two episodes of one game read it under different names.
    assert any(len(texts) > 1 for texts in openings.values())
    # The game's own names are not the episode's: the plain walkthrough is (mostly) not accepted.
    plain = TextWorldEnv(
        nb_rooms=2, nb_objects=4, quest_length=5, quests=2, theme="basic", game_dir=str(game_dir)
    )
    plain.reset(seed=seeds[0])
    env.reset(seed=seeds[0])
    assert plain.oracle_actions() != env.oracle_actions()
    _, _, last, _ = play(env, plain.oracle_actions())
    assert last["invalid_commands"] >= 1 and last["metrics"]["success"] == 0.0
    for env_ in (env, plain):
        env_.close()
    with pytest.raises(ValueError, match="rename_entities needs theme"):
        make(game_dir, rename_entities=True)
    with pytest.raises(ValueError, match="training_games must be an int >= 0"):
        make(game_dir, training_games=-1)


@pytest.mark.slow
def test_invalid_command_answered_counted_and_penalised(game_dir):
    env = make(game_dir, invalid_command_penalty=0.25)
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step("xyzzy")
    assert observation == "That's not a verb I recognise." and not (terminated or truncated)
    assert info["invalid_command"] and info["invalid_commands"] == 1 and reward == -0.25
    observation, reward, *_, info = env.step("take the moon\nand more")
    assert "moon" not in observation and observation  # the game answered the first line
    assert info["command"] == "take the moon" and info["metrics"]["invalid_commands"] == 2.0
    assert info["reward_components"]["invalid_command"] == -0.5
    _, reward, *_, info = env.step("  LOOK ")  # admissible: case and spaces do not matter
    assert not info["invalid_command"] and reward == 0.0 and info["invalid_commands"] == 2
    env.close()


@pytest.mark.slow
def test_observations_are_cleaned_and_admissible_commands_listed(game_dir):
    env = make(game_dir, admissible_commands=True)
    question, _ = env.reset(seed=0)
    raw = env._game.reset()["feedback"]  # what the interpreter itself prints
    assert "$$" in raw and re.search(r"-= \w+ =-\d+/\d+", raw)
    assert question[0].isalpha()  # the banner's ASCII art is gone
    assert "$$" not in question and "\n>" not in question and not re.search(r"=-\d+/\d+", question)
    assert ADMISSIBLE_HEADING in question and "inventory, look" in question.split(ADMISSIBLE_HEADING)[1]
    _, observations, _, _ = play(env, env.oracle_actions())
    for observation in observations:
        assert "\n>" not in observation and not re.search(r"=-\d+/\d+", observation)
        assert "\n\n\n" not in observation and observation == observation.strip()
    assert "RESTART" not in observations[-1] and "The End" in observations[-1]
    assert ADMISSIBLE_HEADING in observations[0] and ADMISSIBLE_HEADING not in observations[-1]
    env.close()


def test_clean_feedback_drops_banner_prompt_status_and_restart():
    raw = (
        "\n\n   ____  __\n  |    \\|  \\\n   \\$$$$$ $$\n\nWelcome! Your task.\n\n-= Hall =-\nA hall.\n\n\n\n"
        ">                                -= Hall =-0/3"
    )
    assert clean_feedback(raw, first=True) == "Welcome! Your task.\n\n-= Hall =-\nA hall."
    end = "\nYou win.\n\n   *** The End ***\n\nWould you like to RESTART, RESTORE a saved game, QUIT or UNDO?\n>   -= Hall =-3/9"
    assert clean_feedback(end) == "You win.\n\n   *** The End ***"


@pytest.mark.slow
def test_a_second_env_reuses_the_compiled_game(game_dir):
    first = make(game_dir)
    first.reset(seed=0)
    path = first.game_path(0)
    stamp = path.stat().st_mtime_ns
    second = make(game_dir)
    second.reset(seed=0)
    assert second.builds == 0 and path.stat().st_mtime_ns == stamp
    assert not [p for p in game_dir.iterdir() if p.name.startswith(".build-")]
    first.close()
    second.close()


_BUILD = """
import sys, gymnasium, toolgym.envs
env = gymnasium.make("toolgym/TextWorld-v0", game_dir=sys.argv[1]).unwrapped
env.reset(seed=5)
print(len(env.oracle_actions()))
"""


@pytest.mark.slow
def test_two_processes_building_one_seed_both_get_the_whole_game(tmp_path):
    procs = [
        subprocess.Popen([sys.executable, "-c", _BUILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs[0] == outputs[1] and int(outputs[0]) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tw-r5-o10-l5-q3-s5"]
    assert sorted(p.name for p in (tmp_path / "tw-r5-o10-l5-q3-s5").iterdir()) == ["game.json", "game.z8"]


def _children() -> set[int]:
    me = str(os.getpid())
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                    found.add(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


@pytest.mark.slow
def test_a_game_that_cannot_be_built_fails_its_reset_in_one_line_leaving_nothing(tmp_path):
    before = _children()
    env = make(tmp_path, quest_length=5, quest_breadth=3)  # no such quest can be generated
    with pytest.raises(TextWorldGameError) as raised:
        env.reset(seed=0)
    message = str(raised.value)
    assert "\n" not in message and "game 0" in message and "QuestGenerationError" in message
    assert list(tmp_path.iterdir()) == []
    assert _children() <= before
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("look")
    env.close()


_ESCAPES = """
import sys, gymnasium, toolgym.envs
env = gymnasium.make("toolgym/TextWorld-v0", game_dir=sys.argv[1]).unwrapped
env.reset(seed=0)
for action in ["\\\\s", "\\\\help look", "lo\\\\ok", "\\\\w{2<&"]:
    observation, _, _, _, info = env.step(action)
    print(info["invalid_commands"], repr(observation[:60]))
"""


def test_a_backslash_never_reaches_the_interpreter(game_dir):
    """DUMB-frotz reads a backslash as the start of one of its own escapes (an unknown one prints
    its help without end: a random action once hung check_env), so commands drop it and such an
    action is an ordinary command. In a child process, so a regression fails instead of hanging."""
    child = subprocess.run(
        [sys.executable, "-c", _ESCAPES, str(game_dir)], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["1", "2", "2", "3"], lines  # `look` is admissible
    assert "escape" not in child.stdout and "\\help" not in child.stdout


@pytest.mark.slow
def test_check_env(game_dir):
    env = make(game_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env)
    env.close()


# ---- recordings and the CPU demo preset (configs/textworld_tiny.toml) --------------------------


@pytest.mark.slow
def test_oracle_recorded_and_replayed_exactly_through_the_cli(tmp_path):
    out = tmp_path / "tw.jsonl"
    kwargs = f'{{"game_dir": "{tmp_path / "games"}", "nb_rooms": 2, "nb_objects": 4, "quest_length": 2, "quests": 2}}'

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "toolgym.configs.cli", *args], capture_output=True, text=True, timeout=300
        )

    record = cli(
        "record", "--env", ENV_ID, "--env-kwargs", kwargs, "--policy", "oracle", "--tasks", "3",
        "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert record.returncode == 0, record.stdout + record.stderr
    assert "recorded 3 episodes" in record.stdout
    assert re.search(r"failure_mode/success\s*│\s*1\.000", record.stdout), record.stdout
    replay = cli("replay", str(out), "--verify", "--summary-only")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "verify: 3/3 episodes replay exactly" in replay.stdout, replay.stdout


DEMO = "textworld_tiny"


def test_the_demo_preset_parses_and_passes_the_checks(tmp_path):
    config, _ = load_config(DEMO)
    assert config.env.kwargs["game_dir"] == "runs/textworld-games"
    config.env.kwargs["game_dir"] = str(tmp_path)  # the checks make the env: its games go here
    assert config.env.id == ENV_ID and config.sft.enabled and config.sft.source == "oracle"
    assert config.rollout.observation_role == "user"
    check_environment(config)
    renderer, _ = build_renderer(config)
    check_against_machine(config, model_config(config), renderer, torch.device("cpu"))


@pytest.mark.slow
def test_the_demo_preset_trains_end_to_end_when_shortened(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [
        f"run.run_dir={run_dir}", f'env.kwargs.game_dir="{tmp_path / "games"}"', "run.steps=1",
        "sft.steps=2", "sft.num_tasks=4", "sft.batch_episodes=4", "sft.optimizer.warmup_steps=1",
        "batch.groups_per_batch=1", "rollout.group_size=2", "batch.dynamic_sampling=false",
        "eval.num_tasks=2", "eval.samples_per_task=1", "run.export_hf=false", "run.plot=false",
    ]  # fmt: skip
    assert cli_main(["train", DEMO, "--no-progress", *(a for o in overrides for a in ("--set", o))]) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 1]
    assert any(r["kind"] == "sft" for r in records) and any(r["kind"] == "train" for r in records)
    assert (tmp_path / "games").is_dir()
