"""Games of seats through the match runner (rollouts/episode/match.py, envs/core/seats.py): every
seat its own token-exact episode, groups per (task, seat), bots as opponents, a seat that stops
or never moves ending only what it should, and Nim's single-seat env."""

import asyncio

import gymnasium
import msgspec
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from toolgym.agents.types import Completion, SamplingParams
from toolgym.envs.core.seats import Match, SeatError, SoloEnv
from toolgym.envs.tasks.nim import NimGame, winning
from toolgym.rollouts.batches import BatchConfig, TaskSeedStream, collect_batch
from toolgym.rollouts.episode.config import EnvRolloutConfig
from toolgym.rollouts.episode.match import BotPolicy, MatchRunner
from toolgym.rollouts.episode.runner import RolloutRunner
from toolgym.rollouts.episodes import trajectory_to_episode
from toolgym.rollouts.types import StopReason


def match_runner(renderer, policy, *, learn="all", opponent=None, group_size=2, **kwargs):
    config = EnvRolloutConfig(
        env_id="toolgym/Nim-v0", env_kwargs=kwargs, group_size=group_size, max_turns=16, max_tokens_per_turn=8
    )
    return MatchRunner(RolloutRunner(policy, renderer, config), learn=learn, opponent=opponent)


def play(runner, seeds):
    return asyncio.run(runner.run_groups(seeds))


def test_mirror_play_gives_each_seat_its_own_episode_and_group(renderer):
    played = play(match_runner(renderer, BotPolicy(renderer, "expert")), [0, 1, 2])
    assert len(played) == 3 * 2 * 2  # tasks x matches x seats
    by_match = {}
    for t in played:
        by_match.setdefault((t.task_seed, t.sample_index), {})[t.seat] = t
        assert t.group_id == 2 * [0, 1, 2].index(t.task_seed) + ("first", "second").index(t.seat)
        assert t.stop_reason == StopReason.ANSWERED and t.error is None
        assert t.total_reward == pytest.approx(sum(t.reward_components.values()))
    for (seed, _), seats in by_match.items():
        first, second = seats["first"], seats["second"]
        stones = NimGame()
        stones.reset(seed)
        # two experts: the seat to move first wins exactly from a winning position
        assert first.reward_components["game"] == (1.0 if winning(stones.stones) else -1.0)
        assert second.reward_components["game"] == -first.reward_components["game"]
        # each seat saw its own conversation: the second seat's first message is the first's move
        assert first.transitions[0].observation == f"Stones: {stones.stones}."
        taken = int(first.transitions[0].action.text)
        assert second.transitions[0].observation == f"Opponent took {taken}. Stones: {stones.stones - taken}."
        # the moves alternate: every action of one seat is in the other's next observation
        for move, reply in zip(second.transitions, first.transitions[1:], strict=False):
            assert reply.observation.startswith(f"Opponent took {move.action.text}.")


def test_each_seat_is_a_token_exact_episode(renderer):
    played = play(match_runner(renderer, BotPolicy(renderer, "random")), [5])
    for t in played:
        episode = trajectory_to_episode(t, 1.0)
        sampled = [tok for tok, m in zip(episode.tokens, episode.loss_mask, strict=True) if m]
        assert sampled == [tok for tr in t.transitions for tok in tr.action.tokens]
        assert renderer.decode(episode.tokens).count("Stones") >= len(t.transitions)


def test_replay_verifies_a_matchs_seats_played_again_together(renderer):
    from toolgym.rollouts.recording.replay import verify_trajectories, verify_trajectory

    played = play(match_runner(renderer, BotPolicy(renderer, "random"), group_size=2), [0, 4])
    assert len(played) == 8 and verify_trajectories(played, renderer) == []  # 4 matches, 2 seats each
    # a seat alone (a match that trained one seat) cannot be: its env's replies held the other's moves
    (t, *_) = played
    assert verify_trajectory(t) == [
        f"seat {t.seat!r} of a match whose other seats are not in the recording: not verified"
    ]
    assert [p for _, _, p in verify_trajectories([t])] == [verify_trajectory(t)]
    # a move changed in one seat's recording: the replayed game differs for both seats
    first = next(x for x in played if x.seat == "first" and len(x.transitions) > 1)
    move = first.transitions[0].action
    other = "1" if move.text != "1" else "2"
    tampered = msgspec.structs.replace(
        first,
        transitions=[msgspec.structs.replace(first.transitions[0], action=msgspec.structs.replace(move, text=other)),
                     *first.transitions[1:]],
    )  # fmt: skip
    partner = next(
        x
        for x in played
        if x.seat == "second" and (x.task_seed, x.sample_index) == (first.task_seed, first.sample_index)
    )
    found = {t.seat: p for _, t, p in verify_trajectories([tampered, partner])}
    assert any("observation differs" in p for p in found["first"])
    assert any(f"Opponent took {other}." in p for p in found["second"])


def test_learn_one_trains_one_seat_per_match_against_a_bot(renderer):
    runner = match_runner(
        renderer, BotPolicy(renderer, "random"), learn="one", opponent="expert", group_size=4
    )
    assert runner.groups_per_task == 2
    played = play(runner, [3, 4])
    assert len(played) == 2 * 4  # one learning seat per match
    for t in played:
        assert t.seat == ("first", "second")[t.sample_index % 2]
    with pytest.raises(ValueError, match="unknown bot 'grandmaster'"):
        match_runner(renderer, BotPolicy(renderer, "random"), learn="one", opponent="grandmaster")


class Rambler:
    """A policy that never stops: every turn is cut by the token limit."""

    policy_version = 0
    max_seq_len = None

    def __init__(self, renderer):
        self.renderer = renderer

    async def generate(self, prompts, params: SamplingParams):
        tokens = list(self.renderer.encode("one two three four five six seven"))[: params.max_tokens]
        return [Completion(tokens=tokens, logprobs=[0.0] * len(tokens), text="", finish_reason="length")]


def test_a_seat_cut_off_forfeits_and_the_other_seat_wins(renderer):
    runner = match_runner(renderer, Rambler(renderer), learn="one", opponent="random", group_size=1)
    (t,) = play(runner, [7])  # the policy on seat "first", cut at its first turn
    assert t.seat == "first" and t.stop_reason == StopReason.MAX_TOKENS
    assert t.reward_components["game"] == -1.0  # settled as a forfeit
    # the bot's seat woke to the end of the game: played in mirror, both seats end
    mirror = match_runner(renderer, Rambler(renderer), group_size=1)
    first, second = play(mirror, [7])
    assert first.stop_reason == StopReason.MAX_TOKENS
    assert second.stop_reason == StopReason.ENV_ERROR and "before seat 'second' moved" in (second.error or "")


class OneMoveThenRamble(Rambler):
    """Plays "1" on its first turn in each episode, then never stops."""

    def for_episode(self, env, seed):
        policy = OneMoveThenRamble(self.renderer)
        policy.moved = False
        return policy

    async def generate(self, prompts, params: SamplingParams):
        if not getattr(self, "moved", True):
            self.moved = True
            tokens = [*self.renderer.encode("1"), self.renderer.im_end_id]
            return [Completion(tokens=tokens, logprobs=[0.0] * len(tokens), text="1", finish_reason="stop")]
        return await super().generate(prompts, params)


def test_a_seat_cut_off_mid_game_wakes_the_seat_waiting_on_it(renderer):
    first, second = play(match_runner(renderer, OneMoveThenRamble(renderer), group_size=1), [7])
    # first: "1", second: "1", then first rambles, is cut, and forfeits while second waits
    assert [t.action.text for t in second.transitions] == ["1"]
    assert first.stop_reason == StopReason.MAX_TOKENS and first.reward_components["game"] == -1.0
    assert second.stop_reason == StopReason.ANSWERED and second.reward_components["game"] == 1.0
    assert second.final_observation.endswith("first stopped playing. You win.")


def test_a_seat_that_never_moves_is_an_env_error_for_that_seat_only(renderer):
    # two stones: the expert moving first takes both, so the second seat never gets a turn
    played = play(match_runner(renderer, BotPolicy(renderer, "expert"), min_stones=2, max_stones=2), [0])
    for t in played:
        if t.seat == "first":
            assert t.stop_reason == StopReason.ANSWERED and t.reward_components["game"] == 1.0
        else:
            assert t.stop_reason == StopReason.ENV_ERROR
            assert t.error == "SeatError: the game ended before seat 'second' moved"


class Haywire(NimGame):
    """Names a seat it does not have once the first move is made."""

    @property
    def to_move(self):
        return "third" if self.moves else super().to_move


def test_a_game_that_names_an_unknown_seat_ends_that_game_only(renderer):
    if "test/HaywireNim-v0" not in gymnasium.registry:
        gymnasium.register("test/HaywireNim-v0", entry_point=lambda **kw: SoloEnv(Haywire(), **kw))
    config = EnvRolloutConfig(env_id="test/HaywireNim-v0", env_kwargs={}, group_size=1, max_turns=16)
    played = play(MatchRunner(RolloutRunner(BotPolicy(renderer, "random"), renderer, config)), [0])
    first = next(t for t in played if t.seat == "first")  # it moved, then the game named "third"
    assert first.stop_reason == StopReason.ENV_ERROR
    assert (
        first.error
        == "SeatError: the game names an unknown seat 'third' to move (its seats: ['first', 'second'])"
    )
    assert {t.stop_reason for t in played} <= {StopReason.ENV_ERROR}  # the other seat never moved


def test_an_unknown_seat_is_refused():
    with pytest.raises(SeatError, match="unknown seat 'third'"):
        Match(NimGame(), 0).env("third")


def test_per_seat_groups_fill_a_batch(renderer):
    runner = match_runner(renderer, BotPolicy(renderer, "random"), group_size=4)
    config = BatchConfig(groups_per_batch=4, dynamic_sampling=False)
    batch = asyncio.run(collect_batch(runner, TaskSeedStream(), config))
    groups = {t.group_id for t in batch.trajectories}
    assert len(groups) == 4  # two tasks, two seats each: no surplus groups rolled
    for group in groups:
        assert len({t.seat for t in batch.trajectories if t.group_id == group}) == 1


def test_nim_env_plays_one_seat_against_a_bot():
    env = gymnasium.make("toolgym/Nim-v0", opponent="expert")
    check_env(env.unwrapped, skip_render_check=True)
    seats = set()
    for seed in range(8):
        observation, info = env.reset(seed=seed)
        seats.add(info["seat"])
        total, terminated = 0.0, False
        for action in env.unwrapped.oracle_actions():
            observation, reward, terminated, _, step_info = env.step(action)
            total += reward
        assert terminated and total in (1.0, -1.0)
        assert step_info["metrics"]["success"] == float(total > 0)
        assert step_info["credit_state"] == "0"  # the stones left: turn_state credit's key
    assert seats == {"first", "second"}  # seat None alternates over task seeds
    env.reset(seed=1)
    observation, reward, terminated, _, info = env.step("seven")
    assert observation.startswith("Invalid move: reply with a number from 1 to 3.")
    assert reward == pytest.approx(-0.1) and not terminated and info["metrics"]["invalid_moves"] == 1.0
    # asking for more than are left takes the rest, unless take_rest=False makes it invalid
    for take_rest, expected in (
        (True, "Game over"),
        (False, "Invalid move: reply with a number from 1 to 2."),
    ):
        strict = gymnasium.make(
            "toolgym/Nim-v0", seat="first", min_stones=2, max_stones=2, take_rest=take_rest
        )
        strict.reset(seed=0)
        assert expected in strict.step("3")[0]


def test_nim_leave_moves_name_the_stones_left():
    """move="leave": an action names the pile left, the bots answer in that form, and a random
    legal move depends on the pile (the form the self-play demo's SFT reads the pile through)."""
    env = gymnasium.make("toolgym/Nim-v0", seat="first", move="leave", min_stones=9, max_stones=9)
    env.reset(seed=0)
    assert "how many stones you leave" in env.unwrapped.game.system_prompt("first")
    observation, *_ = env.step("9")
    assert observation.startswith("Invalid move: reply with a number from 6 to 8. Stones: 9.")
    observation, *_ = env.step("7")  # takes 2; the random bot then takes 1-3
    taken = int(observation.split("took ")[1].split(".")[0])
    assert 1 <= taken <= 3 and f"Stones: {7 - taken}." in observation
    game = env.unwrapped.game
    rng = np.random.default_rng(0)
    for stones in range(1, 16):
        game.stones = stones
        low, high = game.legal()
        assert (low, high) == (max(0, stones - 3), stones - 1)
        left = {int(game.bot_action("first", "random", rng)) for _ in range(64)}
        assert left == set(range(low, high + 1))
        if stones % 4:
            assert int(game.bot_action("first", "expert", rng)) == stones - stones % 4
    with pytest.raises(ValueError, match="move must be 'take' or 'leave'"):
        gymnasium.make("toolgym/Nim-v0", move="give")


def test_the_documented_two_seat_game_plays_solo_and_in_matches(renderer):
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "environments.md").read_text()
    section = doc[doc.index("### Games of seats") :]
    source = section[section.index("```python\n") + 10 : section.index("```\n", section.index("```python"))]
    assert len(source.splitlines()) < 50
    if "my/Nim-v0" not in gymnasium.registry:
        exec(compile(source, "docs/environments.md", "exec"), {})
    env = gymnasium.make("my/Nim-v0", opponent="random")
    check_env(env.unwrapped, skip_render_check=True)
    config = EnvRolloutConfig(env_id="my/Nim-v0", env_kwargs={}, group_size=2, max_turns=16)
    played = play(MatchRunner(RolloutRunner(BotPolicy(renderer, "random"), renderer, config)), [0, 1])
    assert len(played) == 8 and {t.seat for t in played} == {"first", "second"}
    for t in played:
        assert t.stop_reason == StopReason.ANSWERED and abs(t.reward_components["game"]) == 1.0


def test_a_textarena_two_player_game_plays_both_seats(renderer):
    pytest.importorskip("textarena")
    config = EnvRolloutConfig(
        env_id="toolgym/TextArena-v0",
        env_kwargs={"game": "TicTacToe-v0"},
        group_size=2,
        max_turns=12,
        max_tokens_per_turn=16,
    )
    played = play(MatchRunner(RolloutRunner(BotPolicy(renderer, "random"), renderer, config)), [0, 1, 2])
    assert len(played) == 12
    for t in played:
        assert t.stop_reason == StopReason.ANSWERED and t.error is None
        assert t.system_prompt.startswith(f"You are Player {t.seat[-1]} in Tic Tac Toe.")
    for seed in (0, 1, 2):
        first, second = (
            next(t for t in played if t.task_seed == seed and t.seat == s) for s in ("player_0", "player_1")
        )
        assert first.reward_components["game"] == -second.reward_components["game"]  # win/loss, or a draw
        # each seat's next message names the other's move, never its own
        for mine, theirs in zip(first.transitions, second.transitions, strict=False):
            assert f"[Player 0] {mine.action.text}" in theirs.observation
            assert f"[Player 0] {mine.action.text}" not in first.final_observation
    with pytest.raises(ValueError, match="is not a game of seats"):
        one_player = EnvRolloutConfig(env_id="toolgym/TextArena-v0", env_kwargs={"game": "GuessTheNumber-v0"})
        MatchRunner(RolloutRunner(BotPolicy(renderer, "random"), renderer, one_player))


class Scribbler(Rambler):
    """Answers every turn with a move no game accepts."""

    async def generate(self, prompts, params: SamplingParams):
        tokens = [*self.renderer.encode("[99]"), self.renderer.im_end_id]
        return [Completion(tokens=tokens, logprobs=[0.0] * len(tokens), text="[99]", finish_reason="stop")]


def test_a_textarena_seats_invalid_moves_follow_the_games_rules(renderer):
    pytest.importorskip("textarena")
    config = EnvRolloutConfig(
        env_id="toolgym/TextArena-v0",
        env_kwargs={"game": "TicTacToe-v0", "invalid_move_penalty": 0.1},
        group_size=1,
        max_turns=12,
        max_tokens_per_turn=16,
    )
    runner = MatchRunner(RolloutRunner(Scribbler(renderer), renderer, config), learn="one", opponent="random")
    (t,) = play(runner, [4])
    assert t.seat == "player_0" and t.stop_reason == StopReason.ANSWERED
    assert t.reward_components["game"] == -1.0  # the game ends it lost after its own allowance
    invalid = -t.reward_components["invalid_move"] / 0.1
    assert (
        invalid == pytest.approx(len(t.transitions))
        and t.transitions[-1].info["metrics"]["invalid_moves"] == invalid
    )
