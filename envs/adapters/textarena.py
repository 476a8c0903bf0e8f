"""TextArena's text games as a toolgym env: `toolgym/TextArena-v0`.

    gymnasium.make("toolgym/TextArena-v0", game="TicTacToe-v0", opponent="random")

`game` is a TextArena env id (its registry's kwargs apply; other keywords are passed to the
game). The game runs unwrapped: each toolgym step is one TextArena step of the policy's seat
(`player`), and the observation is what that seat was told since its last turn (`[GAME] ...`,
`[Player 1] ...`, its own move left out). The game's first prompt is the system prompt.

Two-player games are played against a fixed scripted opponent inside `step`: `opponent="first"`
plays the first legal move, `"random"` a legal move drawn from the env's seeded RNG. Its
candidates are the bracketed moves the game showed it (`'[4]'`, `[col 3]`, `[0 3]`; numbers
varied 0-9), each tried on a copy of the game and kept when the game accepts it.

Self-play: a two-player game is also a game of seats (`TextArenaGame`, the env's `game`;
envs/core/seats.py), so `[selfplay]` plays both seats at once, each its own conversation and
episode, and these bots can sit on either seat.

Invalid moves are the game's own: its message is the error observation, counted in info
`invalid_moves` and metric `invalid_moves`, and each costs `invalid_move_penalty` (reward
component `invalid_move`); the game decides when too many lose it. Rewards: the game's final
reward for the seat (win 1, loss -1, draw 0; a puzzle's own fraction) is component `game`;
metric `success` is a reward of 1 or more, `game_reward` the reward itself. An episode the game
does not end within `max_turns` is truncated (no game reward).

Determinism: TextArena draws from Python's global `random`; each env keeps its own copy of that
state and swaps it in around every call into the game, so interleaved episodes do not disturb
each other and the same seed and actions give the same transcript.

Offline: games that fetch NLTK data at first use, or that need an LLM over the network, are
refused at construction with one line saying what they need (`GameUnavailable`). The oracle
plays the library's own reference where a game keeps one (GuessTheNumber's number,
Mastermind's code); in a two-player game without one, `oracle="random"` (or `"first"`) makes
that bot the oracle of the policy's seat, so SFT demonstrations are the bot's legal moves (the
self-play recipe's warm start); other games raise NotImplementedError from `oracle_actions()`:
record them with a model policy.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import math
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Final

import numpy as np
import textarena
from textarena.envs.registration import ENV_REGISTRY

from ..core.seats import SeatedGame
from ..core.text_env import TextEnv

_NLTK_DOWNLOAD: Final = re.compile(r"nltk\.download\(\s*(\[[^\]]*\]|['\"][^'\"]+['\"])")
_QUOTED: Final = re.compile(r"['\"]([^'\"]+)['\"]")
_NETWORK_MARKERS: Final = ("OpenRouter", "OpenRouterJury", "openai")
_NLTK_CATEGORIES: Final = ("corpora", "taggers", "tokenizers", "chunkers", "models", "misc", "sentiment")
_MOVE: Final = re.compile(r"\[([^\[\]\n]{1,40})\]")
_DIGITS: Final = re.compile(r"[0-9]+")
_MAX_TRIALS: Final = 256
_NO_FORFEIT: Final = 10**6  # TextArenaGame's invalid-move limit: the game's own rules decide


class GameUnavailable(RuntimeError):
    """A TextArena game this machine cannot run offline (str: one line saying what it needs)."""


def _game_sources(entry_point: str) -> list[Path]:
    """The source files the game runs: its module and the modules of its folder that module
    imports (transitively), and the shared word lists if it uses them. A script beside it that
    the game never imports (Crosswords' clue generator calls an LLM) does not count."""
    module = entry_point.split(":")[0]
    root = Path(textarena.__file__).parent
    folder = root.joinpath(*module.split(".")[1:-1])
    start = folder / f"{module.rsplit('.', 1)[1]}.py"
    files, todo = [], [start]
    while todo:
        path = todo.pop()
        if path in files or not path.is_file():
            continue
        files.append(path)
        todo.extend(_folder_imports(path, folder, module.rsplit(".", 1)[0]))
    if any("word_lists" in f.read_text(errors="replace") for f in files):
        files.append(root / "envs" / "utils" / "word_lists.py")
    return sorted(files)


def _folder_imports(path: Path, folder: Path, package: str) -> list[Path]:
    """The files of `folder` (the game's package, `package`) that `path` imports."""
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except SyntaxError:
        return list(folder.rglob("*.py"))  # unreadable: count the whole folder, as before
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to the file's package
                parts = path.parent.relative_to(folder).parts
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                names = [".".join([*parts, base]).strip(".")] + [
                    ".".join([*parts, base, a.name]).strip(".") for a in node.names
                ]
            elif base.startswith(package + "."):
                rest = base[len(package) + 1 :]
                names = [rest] + [f"{rest}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name[len(package) + 1 :] for a in node.names if a.name.startswith(package + ".")]
        for name in names:
            if not name:
                continue
            target = folder.joinpath(*name.split("."))
            for candidate in (target.with_suffix(".py"), target / "__init__.py"):
                if candidate.is_file():
                    found.append(candidate)
    return found


def _nltk_present(resource: str) -> bool:
    import nltk  # only for the games that use it

    for category in _NLTK_CATEGORIES:
        try:
            nltk.data.find(f"{category}/{resource}")
            return True
        except LookupError:
            continue
    return False


def _game_reward(value: Any) -> float:
    """The player's reward at game over. Some games (Countdown, Cryptarithm, Slitherlink: a second
    invalid move) hand their reason text as the reward: that ends the game lost, -1."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return -1.0


def offline_problem(game: str) -> str | None:
    """What game `game` needs that an offline machine lacks (one line), or None. Reads the
    game's source without importing it (importing some games starts an NLTK download)."""
    entry = ENV_REGISTRY[game].entry_point
    if not isinstance(entry, str):
        return None
    sources = [path.read_text(errors="replace") for path in _game_sources(entry)]
    text = "\n".join(sources)
    if any(marker in text for marker in _NETWORK_MARKERS):
        return f"TextArena game {game!r} needs an LLM reached over the network (OpenRouter); it cannot run offline"
    needed = sorted({name for m in _NLTK_DOWNLOAD.finditer(text) for name in _QUOTED.findall(m.group(1))})
    missing = [name for name in needed if not _nltk_present(name)]
    if missing:
        return (
            f"TextArena game {game!r} needs NLTK data {', '.join(missing)}, which is not installed and "
            f"cannot be downloaded at run time here: run `python -m nltk.downloader {' '.join(missing)}` "
            "on a machine with a network and point NLTK_DATA at the result"
        )
    return None


def _reference_moves(game: Any) -> list[str] | None:
    """The game's own solution, where it keeps one: the moves that win it outright."""
    name = type(game).__name__
    state = getattr(getattr(game, "state", None), "game_state", None) or {}
    if name == "GuessTheNumberEnv":
        return [f"[{game.game_number}]"]
    if name == "MastermindEnv" and "secret_code" in state:
        return ["[" + " ".join(str(d) for d in state["secret_code"]) + "]"]
    return None


def _invalid(game: Any, player: int) -> bool:
    """Whether `player`'s last move was refused by the game (a warning, or the loss it caused)."""
    state = game.state
    if state.done:
        return bool(state.game_info.get(player, {}).get("invalid_move", False))
    return getattr(state, "error_count", 0) > 0


def _split_prompt(messages: list[tuple[int, str, Any]]) -> tuple[str, list[tuple[int, str, Any]]]:
    """A player's first messages as (the game's prompt to it, joined: its system prompt; the rest)."""
    prompts = [m for m in messages if m[2] == textarena.ObservationType.PROMPT]
    rest = [m for m in messages if m[2] != textarena.ObservationType.PROMPT]
    return "\n".join(m[1].strip() for m in prompts), rest


def _sender(game: Any, sender: int) -> str:
    if sender == textarena.GAME_ID:
        return "GAME"
    return str(game.state.role_mapping.get(sender, f"Player {sender}"))


class TextArenaGame(SeatedGame):
    """A two-player TextArena game as a game of seats (envs/core/seats.py), for self-play: the
    match runner plays both seats, each its own conversation (`TextArenaEnv.game`).

    Seats `player_0` and `player_1` are TextArena's players 0 and 1; each seat's system prompt is
    the game's prompt to it, its observations what it was told since its last move (its own move
    left out). The game keeps its own rules for invalid moves (its message is the observation; it
    decides when too many lose), each counted and charged `invalid_move_penalty` here. At game
    over each seat's TextArena reward (win 1, loss -1, draw 0) is its `game` result. Bots: those
    of TextArenaEnv's opponent (`random`, `first`)."""

    seats: ClassVar[tuple[str, ...]] = ("player_0", "player_1")
    bots: ClassVar[tuple[str, ...]] = ("random", "first")

    def __init__(self, env: TextArenaEnv):
        self.env = env  # its game factory, random state and move candidates
        self.prompts = dict.fromkeys(self.seats, "")
        super().__init__(
            invalid_move_penalty=env.invalid_move_penalty,
            max_invalid_moves=_NO_FORFEIT,  # the game's own rules decide
            max_moves=2 * env.max_turns,
        )

    def _player(self, seat: str) -> int:
        return self.seats.index(seat)

    def system_prompt(self, seat: str) -> str:
        return self.prompts[seat]

    def start(self) -> None:
        env = self.env
        env._seen = {player: [] for player in range(2)}
        with env._own_random():
            env._game = env._make_game()
            env._game.reset(num_players=2, seed=int(self.rng.integers(2**31)))
        for seat in self.seats:
            self.prompts[seat], rest = _split_prompt(env._messages(env._game, self._player(seat)))
            self._relay(seat, rest)

    def _relay(self, seat: str, messages: list[tuple[int, str, Any]]) -> None:
        player = self._player(seat)
        self.env._note_moves(player, messages)
        text = self.env._text(messages, player)
        if text:
            self.tell(seat, text[: self.env._max_chars()])

    @property
    def to_move(self) -> str:
        return self.seats[int(self.env._game.state.current_player_id)]

    def move(self, seat: str, action: str) -> str | None:
        env, player = self.env, self._player(seat)
        with env._own_random():
            game = env._game
            game.step(action[: env._max_action_chars])
            invalid = _invalid(game, player)
            for other in self.seats:
                self._relay(other, env._messages(game, self._player(other)))
            if game.state.done:
                rewards, info = game.close()
                results = {s: _game_reward((rewards or {}).get(self._player(s), 0.0)) for s in self.seats}
                reason = str(info.get(player, {}).get("reason", "")).rstrip(".!")
                self.finish(results, reason)
        return "" if invalid else None  # the game's own message says why

    def bot_action(self, seat: str, bot: str, rng: np.random.Generator) -> str:
        with self.env._own_random():
            return self.env._legal_move(self._player(seat), bot, rng)


class TextArenaEnv(TextEnv):
    """`gymnasium.make("toolgym/TextArena-v0", game=..., **game_kwargs)`; see the module doc.

    Knobs: player (the policy's seat, 0 or 1; "alternate": by the reset seed's parity), opponent
    ("random" or "first"), oracle (None, or the bot whose moves are the policy seat's oracle where
    the game keeps no reference), num_players (None: 2 where the game takes 2, else 1),
    invalid_move_penalty (a magnitude per invalid
    move), max_turns (the policy's moves before truncation)."""

    def __init__(
        self,
        game: str = "GuessTheNumber-v0",
        *,
        player: int | str = 0,
        opponent: str = "random",
        oracle: str | None = None,
        num_players: int | None = None,
        invalid_move_penalty: float = 0.0,
        max_turns: int = 100,
        max_action_chars: int = 4096,
        max_observation_chars: int = 16384,
        render_mode: str | None = None,
        **game_kwargs: Any,
    ):
        super().__init__(max_action_chars=max_action_chars, max_observation_chars=max_observation_chars)
        if render_mode is not None:
            raise ValueError(f"TextArenaEnv has no render modes, got render_mode={render_mode!r}")
        if game not in ENV_REGISTRY:
            raise ValueError(
                f"unknown TextArena game {game!r}; e.g. {', '.join(sorted(ENV_REGISTRY)[:8])}, ..."
            )
        if opponent not in ("random", "first"):
            raise ValueError(f"opponent must be 'random' or 'first', got {opponent!r}")
        if oracle not in (None, "random", "first"):
            raise ValueError(f"oracle must be None, 'random' or 'first', got {oracle!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        if not isinstance(invalid_move_penalty, int | float) or invalid_move_penalty < 0:
            raise ValueError(
                f"invalid_move_penalty is a magnitude: a float >= 0, got {invalid_move_penalty!r}"
            )
        problem = offline_problem(game)
        if problem is not None:
            raise GameUnavailable(problem)
        spec = ENV_REGISTRY[game]
        entry = spec.entry_point
        try:
            if isinstance(entry, str):
                module, _, attr = entry.partition(":")
                entry = getattr(importlib.import_module(module), attr)
        except (ImportError, SyntaxError, AttributeError) as exc:
            raise GameUnavailable(
                f"TextArena game {game!r} cannot be imported here: {type(exc).__name__}: {exc}"
            ) from None
        self._max_action_chars, self._max_observation_chars = max_action_chars, max_observation_chars
        self.game_id = game
        self._make_game: Callable[[], Any] = lambda: entry(**{**spec.kwargs, **game_kwargs})
        self.opponent, self.oracle = opponent, oracle
        self.invalid_move_penalty = float(invalid_move_penalty)
        self.max_turns = max_turns
        self._random_state = random.Random(0).getstate()
        self.num_players = num_players if num_players is not None else self._probe_players()
        if self.num_players not in (1, 2):
            raise ValueError(f"TextArenaEnv plays 1- and 2-player games, got num_players={self.num_players}")
        if player != "alternate" and player not in range(self.num_players):
            raise ValueError(f"player must be one of {list(range(self.num_players))} or 'alternate', got {player!r}")
        self.alternate = player == "alternate"
        self.player = 0 if self.alternate else int(player)
        self._game: Any = None
        self._seated: TextArenaGame | None = None
        self._done = True
        self._system_prompt = ""
        self._question = ""

    # ---- the game, in its own random state --------------------------------------------------

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        outside = random.getstate()
        random.setstate(self._random_state)
        try:
            yield
        finally:
            self._random_state = random.getstate()
            random.setstate(outside)

    def _probe_players(self) -> int:
        for count in (2, 1):
            with self._own_random():
                try:
                    self._make_game().reset(num_players=count, seed=0)
                except (AssertionError, ValueError, KeyError, IndexError):
                    continue
                except FileNotFoundError as exc:  # the installed package lacks the game's data
                    raise GameUnavailable(
                        f"TextArena game {self.game_id!r} needs a data file the installed textarena "
                        f"package does not ship: {exc}"
                    ) from None
            return count
        raise GameUnavailable(f"TextArena game {self.game_id!r} takes neither 1 nor 2 players")

    def _messages(self, game: Any, player: int) -> list[tuple[int, str, Any]]:
        """The messages `player` was sent since it last looked (the game's queue, emptied)."""
        if game.state.current_player_id == player and not game.state.done:
            _, messages = game.get_observation()
            return list(messages)
        messages = list(game.state.observations.get(player, []))
        game.state.observations[player] = []
        return messages

    def _text(self, messages: list[tuple[int, str, Any]], player: int | None = None) -> str:
        """`messages` as the lines `player` (default the policy's seat) reads."""
        player = self.player if player is None else player
        lines = []
        for sender, message, kind in messages:
            if sender in (player, textarena.GAME_ID) and kind == textarena.ObservationType.PLAYER_ACTION:
                continue  # the policy's own move (some games echo it as the game's) is in its context
            lines.append(f"[{_sender(self._game, sender)}] {message}".rstrip())
        return "\n".join(lines)

    def _opponent_moves(self) -> None:
        """Play the opponent until it is the policy's turn or the game is over."""
        game = self._game
        while not game.state.done and game.state.current_player_id != self.player:
            seat = game.state.current_player_id
            self._note_moves(seat, self._messages(game, seat))
            move = self._legal_move(seat)
            game.step(move)

    def _note_moves(self, seat: int, messages: list[tuple[int, str, Any]]) -> None:
        """Keep the bracketed moves `seat` was shown: a bot's candidates."""
        for _, message, _ in messages:
            self._seen[seat].extend(m for m in _MOVE.findall(str(message)) if m not in self._seen[seat])

    def _candidates(self, seat: int) -> list[str]:
        moves: dict[str, None] = {}
        for move in self._seen[seat]:
            moves[f"[{move}]"] = None
            runs = _DIGITS.findall(move)
            if 0 < len(runs) <= 2:
                parts = _DIGITS.split(move)
                for n in range(10 ** len(runs)):
                    digits = [str(n // 10**i % 10) for i in range(len(runs))]
                    varied = parts[0] + "".join(d + p for d, p in zip(digits, parts[1:], strict=True))
                    moves[f"[{varied}]"] = None
        return list(moves) or ["[pass]"]

    def _legal_move(self, seat: int, bot: str | None = None, rng: np.random.Generator | None = None) -> str:
        """Bot `bot`'s move for `seat` (default: this env's opponent, drawing from its RNG)."""
        candidates = self._candidates(seat)
        if (bot or self.opponent) == "random":
            rng = self.np_random if rng is None else rng
            candidates = [candidates[i] for i in rng.permutation(len(candidates))]
        for move in candidates[:_MAX_TRIALS]:
            trial = copy.deepcopy(self._game)
            saved = random.getstate()
            try:
                trial.step(move)
                if not _invalid(trial, seat):
                    return move
            except Exception:  # a move the game cannot even parse is no candidate
                continue
            finally:
                random.setstate(saved)
        return candidates[0]

    @property
    def game(self) -> TextArenaGame:
        """This game as a game of seats, for the match runner (self-play); two-player games only
        (AttributeError otherwise, so `getattr(env, "game", None)` is None)."""
        if self.num_players != 2:
            raise AttributeError(f"TextArena game {self.game_id!r} has {self.num_players} player: no seats to play")
        if self._seated is None:
            self._seated = TextArenaGame(self)
        return self._seated

    # ---- TextEnv ---------------------------------------------------------------------------

    @property
    def system_prompt(self) -> str:
        return self._system_prompt

    @property
    def question(self) -> str:
        return self._question

    @property
    def answer(self) -> Any:
        """The reference's last move where the game keeps one, else None."""
        moves = self._reference()
        return moves[-1] if moves else None

    def _reference(self) -> list[str] | None:
        if self._game is None:
            raise RuntimeError("TextArenaEnv: call reset() first")
        return _reference_moves(self._game)

    def oracle_actions(self) -> list[str]:
        """The game's reference moves, else (a two-player game with `oracle` set) the oracle bot's
        moves for the policy's seat over the rest of the game, played on a copy of this env."""
        moves = self._reference()
        if moves is not None:
            return moves
        if self.oracle is None or self.num_players != 2:
            raise NotImplementedError(
                f"TextArena game {self.game_id!r} keeps no reference solution, so there is no oracle; "
                "record it with a model policy (or, in a two-player game, set oracle='random')"
            )
        env = copy.deepcopy(self)  # its game, random state and RNG: this env replays the same moves
        rng = np.random.default_rng([self._game_seed, self._turn, 1])  # the bot's own, drawn from neither
        moves = []
        while not env._done:  # the copy's step ends it at the game's end or max_turns
            with env._own_random():
                moves.append(env._legal_move(self.player, self.oracle, rng))
            env.step(moves[-1])
        return moves

    def answer_action(self, answer: Any, tagged: bool = True) -> str:
        """A game has no answer tag: the move itself."""
        return str(answer)

    def mistaken_actions(self) -> tuple[str, ...]:
        return ("", "I am not sure.", "[[[")

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if options:
            raise ValueError(f"TextArenaEnv.reset takes no options, got {sorted(options)}")
        game_seed = self._game_seed = int(self.np_random.integers(2**31))
        if self.alternate:
            self.player = (game_seed if seed is None else seed) % self.num_players
        self._seen: dict[int, list[str]] = {seat: [] for seat in range(self.num_players)}
        self._turn = 0
        self._invalid_moves = 0
        self._components = {"game": 0.0, "invalid_move": 0.0}
        with self._own_random():
            self._game = self._make_game()
            self._game.reset(num_players=self.num_players, seed=game_seed)
            self._opponent_moves()
            messages = self._messages(self._game, self.player)
            if self.oracle is not None:
                self._note_moves(self.player, messages)  # the oracle bot's candidates
        self._system_prompt, rest = _split_prompt(messages)
        self._question = self._text(rest) or "[GAME] Your move."
        self._question = self._question[: self._max_chars()]
        self._done = False
        info = {
            "system_prompt": self._system_prompt,
            "question": self._question,
            "answer": self.answer,
            "game": self.game_id,
            "player": self.player,
            "num_players": self.num_players,
            "max_turns": self.max_turns,
        }
        return self._question, info

    def _max_chars(self) -> int:
        return self._max_observation_chars

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError(
                "TextArenaEnv: step() after the episode ended (or before reset()); call reset()"
            )
        if not isinstance(action, str):
            raise TypeError(f"action must be a str, got {type(action).__name__}")
        action = action[: self._max_action_chars]
        self._turn += 1
        reward = 0.0
        with self._own_random():
            self._game.step(action)
            invalid = _invalid(self._game, self.player)
            if invalid:
                self._invalid_moves += 1
                self._components["invalid_move"] -= self.invalid_move_penalty
                reward -= self.invalid_move_penalty
            self._opponent_moves()
            messages = self._messages(self._game, self.player)
            if self.oracle is not None:
                self._note_moves(self.player, messages)
            observation = self._text(messages)
        over = bool(self._game.state.done)
        info: dict[str, Any] = {
            "invalid_move": invalid,
            "invalid_moves": self._invalid_moves,
            "turn": self._turn,
        }
        if over:
            rewards, game_info = self._game.close()
            game_reward = _game_reward((rewards or {}).get(self.player, 0.0))
            self._components["game"] += game_reward
            reward += game_reward
            reason = str(game_info.get(self.player, {}).get("reason", ""))
            observation = "\n".join(p for p in (observation, f"[GAME] Game over: {reason}".rstrip()) if p)
            info["end_reason"] = "parse_error" if invalid else "answered"
            info["failure_mode"] = self._failure_mode(game_reward, invalid)
        elif self._turn >= self.max_turns:
            observation = "\n".join(p for p in (observation, "STOP: turn limit reached.") if p)
            info["end_reason"] = "max_turns"
            info["failure_mode"] = "no_answer"
        self._done = over or self._turn >= self.max_turns
        info.update(self._settled_info(over))
        return observation[: self._max_chars()], reward, over, self._done and not over, info

    def _failure_mode(self, game_reward: float, invalid: bool) -> str:
        if game_reward >= 1.0:
            return "success"
        if invalid:
            return "invalid_move"
        if self.num_players == 2:
            return "draw" if game_reward == 0 else "lost"
        return "partial" if game_reward > 0 else "failed"

    def _settled_info(self, over: bool) -> dict[str, Any]:
        game_reward = self._components["game"]
        return {
            "reward_components": dict(self._components),
            "metrics": {
                "success": float(over and game_reward >= 1.0),
                "game_reward": game_reward,
                "invalid_moves": float(self._invalid_moves),
            },
        }

    def abandon(self) -> tuple[float, dict[str, Any]]:
        """The runner stopped the episode: unfinished, no game reward (see envs/core/tool_env.py)."""
        if self._done:
            raise RuntimeError("TextArenaEnv: abandon() after the episode ended (or before reset())")
        self._done = True
        return 0.0, {**self._settled_info(False), "failure_mode": "no_answer"}
