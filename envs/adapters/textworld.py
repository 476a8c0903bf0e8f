"""TextWorld's generated text adventures as a toolgym env: `toolgym/TextWorld-v0`.

    gymnasium.make("toolgym/TextWorld-v0", nb_rooms=5, nb_objects=10, quest_length=5, quests=3)

Each episode plays one game that TextWorld's own generator makes from the task seed, as
`tw-make custom --seed S` does (`textworld.generator.make_game`, then `compile_game`: Inform 7,
shipped inside the `textworld` wheel, compiles it to a Z-machine file that Jericho runs in this
process). The seed is the game: `reset(seed=s)` plays game `s` (a reset without a seed draws
one from the env's RNG). The defaults (5 rooms, 10 objects, 3 quests of 5 actions) make games
whose walkthrough is 9-15 moves (12 on average over seeds 0-7), each quest worth one point.
`theme="basic"` uses TextWorld's other text grammar: numbered names (box6, W-key, room66) and a
goal that states each step in order ("First, go south. Next, open box6. ..."), in place of the
"house" theme's named furniture and chatty narrator. A game is kept only if its walkthrough
wins it: TextWorld's names can make a walkthrough command ambiguous ("safe" beside a "Canadian
style safe"), and such a game is made again with the next text (grammar) seed, up to 5 times,
the map, objects and quests unchanged.

Games are compiled once per seed and spec and kept in `game_dir` (default
`runs/textworld-games`, the runs folder's shared cache beside the run directories: an env does
not know its run's directory, and a game compiled for one run serves the next; never the home
directory). A game is built in a private temporary folder inside `game_dir` and renamed into
place in one `os.rename`, so two processes building the same seed both end with one whole game
(the loser drops its copy). A game that cannot be generated or compiled raises
`TextWorldGameError` from `reset` with one line saying why; its temporary folder is removed and
Inform 7's compiler processes have exited (`compile_game` waits for them), so the runner ends
that one episode as an env error and the run goes on.

Why plain text actions, not a `command` tool: a text adventure's action *is* a free-text
command, and the game itself answers every command, a senseless one included ("That's not a
verb I recognise."). A tool call would only wrap the same string in a format (more tokens, a
format error the game cannot have), and `ToolEnv` ends an episode only on an answer, while a game
ends when it is won or lost. So, as `toolgym/TextArena-v0`, this is a `TextEnv`: one action is
one command (its first non-empty line, printable ASCII but the backslash, the interpreter's escape;
at most 190 characters, as the interpreter reads no more).

Observations are the game's feedback cleaned of the interpreter's padding: the title banner
(ASCII art) at the start, the `>` prompt with the status line after it (`-= Kitchen =-2/5`), the
end-of-game "Would you like to RESTART ..." line, and runs of blank lines. With
`admissible_commands=True` each observation ends with the commands the game accepts there
(`Commands you can use: ...`, sorted), TextWorld's list.

Rewards: each point the game's score goes up is the `score` component at that step (the sum of
the step rewards is the final score); a command not among the game's admissible commands in the
state it was typed in is an invalid command: answered by the game as usual, counted (info and
metric `invalid_commands`) and charged `invalid_command_penalty` (component `invalid_command`).
A win or a loss terminates the episode (end_reason `answered`; failure_mode success / lost);
`max_turns` commands without an end truncate it (`no_answer`). Metrics: `success` (won),
`score`, `normalized_score` (score / max score), `invalid_commands`, `moves`.

Names (`rename_entities=True`, theme "basic" only): each episode shows the game under names of
its own, drawn from its seed: the letters that pair keys with their locks (A-key opens A-box)
permuted, and each noun's numbers (box6, thing33, room66) permuted over the 110 numerals the
grammar makes (0-9, 00-99). The text the model reads and the walkthrough are renamed, and each
command is renamed back before the game reads it; both maps are bijections of the whole name space,
so a name the episode never showed still names no object of the game. With
`training_games=N`, the runner's training seeds (>= 2**31; the held-out eval seeds are below
2**20) play one of N games (generator seeds 2**31 .. 2**31+N-1, by a hash of the seed), so a run
compiles N training games however many episodes it plays, and with renaming each episode reads
them under other names: demonstrations and RL tasks without end from a cache of N compiled games.

The oracle plays the game's walkthrough (TextWorld's winning commands; its last command wins
the game and is `answer`), so `toolgym record --policy oracle` and `sft.source = "oracle"` make
demonstrations.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import string
import tempfile
import warnings
from pathlib import Path
from typing import Any, Final

import numpy as np
import textworld
from textworld import EnvInfos, GameOptions
from textworld.generator import compile_game, make_game

from ..core.text_env import TextEnv

DEFAULT_GAME_DIR: Final = Path("runs") / "textworld-games"
TRAINING_SEEDS: Final = 2**31  # the runner's training task seeds start here (rollouts/batches.py)
INSTRUCTIONS: Final = (
    "You are playing a text adventure game. Each of your replies is one command to the game, "
    "such as: go north, open chest, take key from chest, unlock door with key, put apple on "
    "table, look, inventory. Reply with the command only. The game tells you what happens; "
    "reach the goal it sets to win."
)
ADMISSIBLE_HEADING: Final = "Commands you can use:"
# TextWorld's text grammars: "house" (the default: rooms and objects of a house, named with
# adjectives, a chatty narrator) and "basic" (numbered names, box6 or W-key, and plain sentences:
# the goal reads "First, go south. Next, open box6. ...").
THEMES: Final = frozenset({"house", "basic"})
ATTEMPTS: Final = 5  # text seeds tried per game before it is refused
MAX_COMMAND_CHARS: Final = 190  # Jericho reads at most 198 bytes of a command
_BANNER_LINE: Final = re.compile(r"^[\s_|\\$/<>()\-=+*#.,'`~^]*$")
_RESTART: Final = re.compile(r"^\s*Would you like to RESTART.*$", re.MULTILINE)
_BLANKS: Final = re.compile(r"\n{3,}")
# Dropped from a command: all but printable ASCII, and the backslash, which DUMB-frotz (the
# interpreter Jericho runs) reads as the start of one of its own escapes: an unknown one prints its
# help without end, and a random action hung check_env there.
_DROPPED: Final = re.compile(r"[^\x20-\x7e]|\\")
_PROMPT: Final = re.compile(r"\n>[^\n]*$")


# The "basic" grammar's names (textworld/generator/data/text_grammars/basic_obj.twg, _room.twg):
# a noun and a number of one or two digits (box6, room05, thing33), and a key matched to its lock
# by a capital letter (A-key opens A-box or A-door).
NOUNS: Final = ("room", "box", "door", "stand", "thing", "snack", "key")
NUMERALS: Final = tuple(str(d) for d in range(10)) + tuple(f"{d:02d}" for d in range(100))
_NUMBERED: Final = re.compile(rf"\b({'|'.join(NOUNS)})(\d{{1,2}})\b", re.IGNORECASE)
_LETTERED: Final = re.compile(r"\b([A-Za-z])-(key|box|door)\b", re.IGNORECASE)


class Renaming:
    """One episode's names for the "basic" grammar's objects, drawn from `seed`: the key letters
    permuted, and each noun's numbers permuted over all of the grammar's numerals. `show` maps the
    game's text to the episode's names, `unshow` maps a command back; each is the other's inverse
    on any text, since both maps are bijections of the whole name space."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng([seed, 0x7E])
        letters = string.ascii_uppercase
        shown = "".join(letters[i] for i in rng.permutation(len(letters)))
        self._letters = (dict(zip(letters, shown, strict=True)), dict(zip(shown, letters, strict=True)))
        numbers: dict[str, tuple[dict[str, str], dict[str, str]]] = {}
        for noun in NOUNS:
            order = [NUMERALS[i] for i in rng.permutation(len(NUMERALS))]
            numbers[noun] = (
                dict(zip(NUMERALS, order, strict=True)),
                dict(zip(order, NUMERALS, strict=True)),
            )
        self._numbers = numbers

    def _map(self, text: str, way: int) -> str:
        def number(match: re.Match[str]) -> str:
            return match.group(1) + self._numbers[match.group(1).lower()][way][match.group(2)]

        def letter(match: re.Match[str]) -> str:
            mapped = self._letters[way][match.group(1).upper()]
            return (mapped if match.group(1).isupper() else mapped.lower()) + "-" + match.group(2)

        return _LETTERED.sub(letter, _NUMBERED.sub(number, text))

    def show(self, text: str) -> str:
        return self._map(text, 0)

    def unshow(self, text: str) -> str:
        return self._map(text, 1)


class TextWorldGameError(RuntimeError):
    """A game that could not be generated or compiled (str: one line saying why)."""


def clean_feedback(text: str, *, first: bool = False) -> str:
    """The game's text without the interpreter's padding: the `>` prompt and the status line the
    interpreter pads after it, the end-of-game RESTART question, runs of blank lines; `first`
    (the opening text) also drops the title banner, whose lines hold no letters or digits."""
    text = text.replace("\r", "")
    text = _PROMPT.sub("", text.rstrip())
    if text.startswith(">"):
        text = ""
    text = _RESTART.sub("", text)
    if first:
        lines = text.split("\n")
        start = 0
        while start < len(lines) and _BANNER_LINE.match(lines[start]):
            start += 1
        text = "\n".join(lines[start:])
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANKS.sub("\n\n", text).strip()


def normalize_command(action: str) -> str:
    """One command from an action: its first non-empty line, printable ASCII but the backslash
    only, spaces collapsed, lowercased, at most MAX_COMMAND_CHARS."""
    line = next((part for part in action.splitlines() if part.strip()), "")
    line = _DROPPED.sub("", line)
    return " ".join(line.split()).lower()[:MAX_COMMAND_CHARS]


def _start(path: Path) -> tuple[Any, Any]:
    """The game at `path` started: (TextWorld's env, its first state)."""
    infos = EnvInfos(
        admissible_commands=True,
        won=True,
        lost=True,
        score=True,
        max_score=True,
        moves=True,
        extras=["walkthrough"],
    )
    with warnings.catch_warnings():
        # Jericho knows only its own catalogue of games; TextWorld reads the score itself.
        warnings.filterwarnings("ignore", message=".*is not fully supported")
        game = textworld.start(str(path), infos)
        return game, game.reset()


def generator_seed(seed: int) -> int:
    """tw-make's --seed for task seed `seed` (NumPy takes 32 bits): the seed itself below 2**32, so
    game S is `tw-make --seed S`; above, a hash of it into [2**31, 2**32), clear of the held-out
    eval seeds. Not `seed % 2**32`: training task streams are 2**32 apart (rollouts/batches.py),
    and would all play the same games (SFT's demonstrations would be RL's tasks)."""
    if 0 <= seed < 2**32:
        return seed
    digest = hashlib.blake2b(str(seed).encode(), digest_size=4).digest()
    return 2**31 + int.from_bytes(digest, "big") % 2**31


def _walkthrough_wins(path: Path) -> bool:
    """Whether the game's walkthrough, sent as the env sends commands, wins it."""
    game, state = _start(path)
    try:
        for command in state.get("extra.walkthrough") or []:
            state, _, done = game.step(normalize_command(str(command)))
            if done:
                break
        return bool(state.get("won"))
    finally:
        game.close()


class TextWorldEnv(TextEnv):
    """`gymnasium.make("toolgym/TextWorld-v0", **knobs)`; see the module doc.

    Knobs: nb_rooms, nb_objects, quest_length (actions per quest), quests (parallel quests, one
    point each), quest_breadth (tw-make's --quest-breadth: branches
    of a quest; a branch's end is a point of its own), theme (tw-make's --theme: the text
    grammar, "house" or "basic"; see THEMES), game_dir (the compiled games' cache),
    admissible_commands (list them in each observation), invalid_command_penalty (a magnitude per
    invalid command), max_turns, rename_entities (each episode's own names; "basic" only) and
    training_games (the training seeds' games; 0: each its own); see the module doc."""

    def __init__(
        self,
        *,
        nb_rooms: int = 5,
        nb_objects: int = 10,
        quest_length: int = 5,
        quests: int = 3,
        quest_breadth: int = 1,
        theme: str = "house",
        game_dir: str | None = None,
        admissible_commands: bool = False,
        invalid_command_penalty: float = 0.0,
        max_turns: int = 50,
        rename_entities: bool = False,
        training_games: int = 0,
        max_action_chars: int = 4096,
        max_observation_chars: int = 16384,
        render_mode: str | None = None,
    ):
        super().__init__(max_action_chars=max_action_chars, max_observation_chars=max_observation_chars)
        if render_mode is not None:
            raise ValueError(f"TextWorldEnv has no render modes, got render_mode={render_mode!r}")
        for name, value, minimum in (
            ("nb_rooms", nb_rooms, 1),
            ("nb_objects", nb_objects, 0),
            ("quest_length", quest_length, 1),
            ("quests", quests, 1),
            ("quest_breadth", quest_breadth, 1),
            ("max_turns", max_turns, 1),
            ("training_games", training_games, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if (
            not isinstance(invalid_command_penalty, int | float)
            or isinstance(invalid_command_penalty, bool)
            or invalid_command_penalty < 0
        ):
            raise ValueError(
                f"invalid_command_penalty is a magnitude: a float >= 0, got {invalid_command_penalty!r}"
            )
        if not isinstance(theme, str) or theme not in THEMES:
            raise ValueError(f"theme must be one of {sorted(THEMES)}, got {theme!r}")
        if not isinstance(rename_entities, bool):
            raise ValueError(f"rename_entities must be a bool, got {rename_entities!r}")
        if rename_entities and theme != "basic":
            raise ValueError(f'rename_entities needs theme="basic" (numbered names), got theme={theme!r}')
        self.rename_entities, self.training_games = rename_entities, training_games
        self.nb_rooms, self.nb_objects, self.theme = nb_rooms, nb_objects, theme
        self.quest_length, self.quests, self.quest_breadth = quest_length, quests, quest_breadth
        self.game_dir = Path(game_dir) if game_dir is not None else DEFAULT_GAME_DIR
        self.list_admissible = bool(admissible_commands)
        self.invalid_command_penalty = float(invalid_command_penalty)
        self.max_turns = max_turns
        self._max_action_chars, self._max_observation_chars = max_action_chars, max_observation_chars
        self._game: Any = None
        self._state: Any = None
        self._done = True
        self._question = ""
        self._walkthrough: list[str] = []
        self._renaming: Renaming | None = None
        self.builds = 0  # games this env compiled (the rest came from the cache)

    # ---- the games -----------------------------------------------------------------------------

    @property
    def spec_name(self) -> str:
        breadth = f"-b{self.quest_breadth}" if self.quest_breadth != 1 else ""
        theme = f"-{self.theme}" if self.theme != "house" else ""
        return f"r{self.nb_rooms}-o{self.nb_objects}-l{self.quest_length}-q{self.quests}{breadth}{theme}"

    def generator_seed(self, seed: int) -> int:
        """tw-make's --seed for task seed `seed`: with `training_games`, a training seed's pick of
        that many games; otherwise the module's generator_seed."""
        if self.training_games and seed >= TRAINING_SEEDS:
            digest = hashlib.blake2b(f"game-of-{seed}".encode(), digest_size=8).digest()
            return TRAINING_SEEDS + int.from_bytes(digest, "big") % self.training_games
        return generator_seed(seed)

    def game_path(self, seed: int) -> Path:
        """The compiled game of `seed` in the cache (its folder also holds TextWorld's .json), named
        by the generator seed that makes it."""
        return self.game_dir / f"tw-{self.spec_name}-s{self.generator_seed(seed)}" / "game.z8"

    def build(self, seed: int) -> Path:
        """Game `seed`, compiled now unless the cache has it (see the module doc)."""
        path = self.game_path(seed)
        if path.is_file():
            return path
        self.game_dir.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=self.game_dir))
        try:
            scratch.chmod(0o755)  # the cache is shared: readable as any other folder
            seeds: int | dict[str, int] = self.generator_seed(seed)
            for attempt in range(ATTEMPTS):
                options = self._options(seeds, scratch)
                try:
                    game = make_game(options)
                    compile_game(game, options)
                except Exception as exc:  # the generator or Inform 7 refusing: this game only
                    cause = " ".join(str(exc).split()) or type(exc).__name__
                    raise TextWorldGameError(
                        f"TextWorld game {seed} ({self.spec_name}) cannot be built: "
                        f"{type(exc).__name__}: {cause[:300]}"
                    ) from None
                if _walkthrough_wins(scratch / "game.z8"):
                    break
                # A name the walkthrough cannot use ("safe" beside a "Canadian style safe" asks
                # "Which do you mean"): the same game with the next text seed.
                used = {key: int(value) for key, value in (options.seeds or {}).items()}
                seeds = {**used, "grammar": (used["grammar"] + 1) % 65535}
                for leftover in scratch.iterdir():
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
                if attempt == ATTEMPTS - 1:
                    raise TextWorldGameError(
                        f"TextWorld game {seed} ({self.spec_name}): TextWorld's walkthrough does not win "
                        f"it with any of {ATTEMPTS} text seeds"
                    )
            for leftover in scratch.iterdir():  # keep the game and its metadata only
                if leftover.name not in ("game.z8", "game.json"):
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            try:
                os.rename(scratch, path.parent)
            except OSError:
                if not path.is_file():  # not another process's finished copy: a real failure
                    raise
            self.builds += 1
            return path
        finally:
            if scratch.exists():
                shutil.rmtree(scratch, ignore_errors=True)

    def _options(self, seeds: int | dict[str, int], scratch: Path) -> GameOptions:
        options = GameOptions()
        options.seeds = seeds
        options.nb_rooms, options.nb_objects = self.nb_rooms, self.nb_objects
        options.quest_length, options.nb_parallel_quests = self.quest_length, self.quests
        options.quest_breadth = self.quest_breadth
        options.grammar.theme = self.theme
        options.path = str(scratch / "game.z8")
        options.file_ext = ".z8"
        options.force_recompile = True
        return options

    def _close_game(self) -> None:
        if self._game is not None:
            with contextlib.suppress(Exception):
                self._game.close()
            self._game = None

    # ---- TextEnv -----------------------------------------------------------------------------

    @property
    def system_prompt(self) -> str:
        return INSTRUCTIONS

    @property
    def question(self) -> str:
        return self._question

    @property
    def answer(self) -> Any:
        """The walkthrough's last command (the one that wins the game)."""
        if self._state is None:
            raise RuntimeError("TextWorldEnv: call reset() first")
        return self._walkthrough[-1] if self._walkthrough else None

    def oracle_actions(self) -> list[str]:
        if self._state is None:
            raise RuntimeError("TextWorldEnv: call reset() first")
        return list(self._walkthrough)

    def answer_action(self, answer: Any, tagged: bool = True) -> str:
        """A game has no answer tag: the command itself."""
        return str(answer)

    def mistaken_actions(self) -> tuple[str, ...]:
        return ("", "xyzzy", "take the moon")

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if options:
            raise ValueError(f"TextWorldEnv.reset takes no options, got {sorted(options)}")
        self._close_game()
        self._state = None
        self._done = True
        game_seed = seed if seed is not None else int(self.np_random.integers(2**31))
        path = self.build(game_seed)
        self._game, state = _start(path)
        self._state = state
        self._renaming = Renaming(game_seed) if self.rename_entities else None
        self._walkthrough = [self._show(str(c)) for c in (state.get("extra.walkthrough") or [])]
        self._score = int(state.get("score") or 0)
        self._max_score = int(state.get("max_score") or 0)
        self._turn = 0
        self._invalid = 0
        self._components = {"score": 0.0, "invalid_command": 0.0}
        self._question = self._observation(clean_feedback(str(state.get("feedback") or ""), first=True))
        self._done = False
        info = {
            "system_prompt": INSTRUCTIONS,
            "question": self._question,
            "answer": self.answer,
            "game_seed": game_seed,
            "generator_seed": self.generator_seed(game_seed),
            "game": self.spec_name,
            "max_score": self._max_score,
            "walkthrough_moves": len(self._walkthrough),
            "max_turns": self.max_turns,
        }
        return self._question, info

    def _show(self, text: str) -> str:
        return self._renaming.show(text) if self._renaming is not None else text

    def _observation(self, text: str) -> str:
        """The game's text as the episode shows it: renamed, with the admissible commands listed."""
        if self.list_admissible and self._state is not None and not self._state.get("done"):
            commands = sorted(self._show(str(c)) for c in self._state.get("admissible_commands") or [])
            text = f"{text}\n\n{ADMISSIBLE_HEADING} {', '.join(commands)}".strip()
        return self._show(text)[: self._max_observation_chars]

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError(
                "TextWorldEnv: step() after the episode ended (or before reset()); call reset()"
            )
        if not isinstance(action, str):
            raise TypeError(f"action must be a str, got {type(action).__name__}")
        shown = normalize_command(action[: self._max_action_chars])
        command = self._renaming.unshow(shown) if self._renaming is not None else shown  # the game's names
        admissible = {normalize_command(c) for c in self._state.get("admissible_commands") or []}
        invalid = command not in admissible
        self._turn += 1
        reward = 0.0
        if invalid:
            self._invalid += 1
            self._components["invalid_command"] -= self.invalid_command_penalty
            reward -= self.invalid_command_penalty
        state, score, done = self._game.step(command)
        self._state = state
        gained = int(score) - self._score
        self._score = int(score)
        self._components["score"] += gained
        reward += gained
        won, lost = bool(state.get("won")), bool(state.get("lost"))
        over = bool(done) or won or lost
        observation = clean_feedback(str(state.get("feedback") or "")) or "Nothing happens."
        info: dict[str, Any] = {
            "command": shown,
            "invalid_command": invalid,
            "turn": self._turn,
        }
        if over:
            info["end_reason"] = "answered"
            info["failure_mode"] = "success" if won else "lost"
        elif self._turn >= self.max_turns:
            observation = f"{observation}\n\nSTOP: turn limit reached."
            info["end_reason"] = "max_turns"
            info["failure_mode"] = "no_answer"
        self._done = over or self._turn >= self.max_turns
        info.update(self._settled_info(won))
        if self._done:
            self._close_game()
        return self._observation(observation), reward, over, self._done and not over, info

    def _settled_info(self, won: bool) -> dict[str, Any]:
        return {
            "invalid_commands": self._invalid,
            "reward_components": dict(self._components),
            "metrics": {
                "success": float(won),
                "score": float(self._score),
                "normalized_score": self._score / self._max_score if self._max_score else 0.0,
                "invalid_commands": float(self._invalid),
                "moves": float(self._turn),
            },
        }

    def abandon(self) -> tuple[float, dict[str, Any]]:
        """The runner stopped the episode: unfinished, nothing more to add."""
        if self._done:
            raise RuntimeError("TextWorldEnv: abandon() after the episode ended (or before reset())")
        self._done = True
        self._close_game()
        return 0.0, {**self._settled_info(False), "failure_mode": "no_answer"}

    def close(self) -> None:
        self._close_game()
        super().close()
