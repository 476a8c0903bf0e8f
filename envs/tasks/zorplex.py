"""Zorplex: words with arbitrary values that a policy can only learn through tools.

The 26 words apple..zebra have values drawn uniformly from 1..100. By default every episode
draws a fresh table from its own seed, so values cannot be memorised. `table_seed=n` fixes the
table to `numpy.random.default_rng(n).integers(1, 101, size=26)` in word order; that is OUR
definition of "the original experiment's table" for n=42.

Tiers (question -> ideal actions):
- simple:        "What is the zorplex value of 'cat'?"         LOOKUP[cat], [ANSWER] v
- compositional: "What is zorplex('cat') + zorplex('sun')?"    one LOOKUP per word, then the
                 arithmetic evaluated left to right. easy: 2 words, +; medium: 2 words, + - *;
                 hard: 3 words, + - *.
- multi_step:    same question as simple; GETKEY[word] -> a key `ZK_` + 6 upper-case hex digits,
                 FETCH[key] -> the value. Keys are unique within a table and drawn from the
                 table's RNG right after the values (so they follow from the seed).
- recursive:     same question; LOOKUP on the asked word returns `SEE: other` along a chain of
                 1-3 redirects (easy 1, medium 2, hard 3) that ends at a word with a number.
                 `collect=True`: every word on the chain has a value (`LOOKUP[cat] = 17 SEE: sun`)
                 and the answer is all of them in chain order (`[ANSWER] 17 5`, graded as text),
                 so the first lookups' values are needed at the end.
- list:          "What are the zorplex values of 'cat', 'sun' and 'ice'? ..."   one LOOKUP per
                 word, then `[ANSWER] 17 5 3` (the values in the asked order, graded as text).
                 easy: 2 words, medium 3, hard 4. Each lookup succeeds or fails on its own: the
                 turns of one episode are independent sub-tasks (the credit demo's env).
difficulty=None draws the difficulty per episode (compositional, recursive, list); simple and
multi_step have none. `redirects=n` (recursive) fixes the chain at n redirects (n + 1 lookups),
for chains longer than hard's; `items=n` (list) fixes the list at n words.

Notes (`notes=True`, a ToolEnv knob: a NOTE tool and the notes context policy, which cuts the
conversation to the task and the notes after each one): in the recursive tier the oracle notes
each `SEE:` target before looking it up (`LOOKUP[cat]`, `NOTE[sun]`, `LOOKUP[sun]`, ...), so a
chain longer than the context window still fits; `wrong_note_actions` is a demonstrator that
notes a wrong word once and follows it to a wrong answer. With `collect=True` each note carries
the values so far and the next word (`NOTE[17 sun]`, `NOTE[17 5 ice]`): with only the last note
kept, the note is the only place the early values survive, so a window of recent turns cannot
answer; the fallible demonstrator's one wrong note names a wrong word or miscopies a value. In the list tier,
`wrong_lookup_actions` is a demonstrator whose every lookup independently goes to a wrong word
with a given probability (its value then lands in the answer: wrong).

Tool results: `LOOKUP[cat] = 17`, `LOOKUP[cat] = SEE: sun`, `LOOKUP[xyz] = UNKNOWN`,
`GETKEY[cat] = ZK_3F9A01`, `GETKEY[xyz] = UNKNOWN_WORD`, `FETCH[ZK_000000] = INVALID_KEY`.
Unknown words and keys are ordinary results (they cost a tool call, not an error).

Process reward (recursive and list tiers, off by default): `chain_reward=r` awards r, as the
reward component `chain`, at the step of each LOOKUP that follows the solution's chain of
lookups. Recursive: the lookup of the chain's next word not yet looked up (the asked word first,
then each `SEE:` target in order, the last being the word with the number); skipping ahead pays
nothing. List: the first lookup of each asked word, in any order (one wrong lookup does not stop
the others paying). Each word pays once, so n words pay at most n * r, and repeating pays
nothing. The texts the policy sees do not change.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from ..core.grading import numeric
from ..core.grading import text as text_grader
from ..core.task import Example, Task
from ..core.tool_env import ToolEnv
from ..tools.typed import Call, Tool, ToolResult

WORDS: tuple[str, ...] = (
    "apple", "banana", "cat", "dog", "elephant", "fish", "grape", "house", "ice", "jungle",
    "kite", "lemon", "moon", "night", "ocean", "piano", "queen", "river", "sun", "tree",
    "umbrella", "violet", "water", "xray", "yellow", "zebra",
)  # fmt: skip
TIERS: tuple[str, ...] = ("simple", "compositional", "multi_step", "recursive", "list")
DIFFICULTIES: dict[str, tuple[str | None, ...]] = {
    "simple": (None,),
    "compositional": (None, "easy", "medium", "hard"),
    "multi_step": (None,),
    "recursive": (None, "easy", "medium", "hard"),
    "list": (None, "easy", "medium", "hard"),
}
_LEVELS = ("easy", "medium", "hard")
_OPS = ("+", "-", "*")

_INTRO = "Every word has a secret zorplex value. Only the tools know it."
_INSTRUCTIONS = {
    "simple": _INTRO,
    "compositional": _INTRO + " Do the arithmetic left to right.",
    "multi_step": "Every word has a secret zorplex value, stored under a key. Only the tools know them.",
    "recursive": _INTRO + " A word may point to another word (SEE: word); follow it until you get a number.",
    "collect": _INTRO
    + " A word's value may point on to another word (17 SEE: sun): follow the chain to its end and"
    " answer every value on it, in chain order, separated by spaces.",
    "list": _INTRO + " Answer every value asked, in the order asked, separated by spaces.",
}
_REDIRECTS = {"easy": 1, "medium": 2, "hard": 3}  # recursive: a chain of n redirects, n + 1 lookups
_LIST_LENGTHS = {"easy": 2, "medium": 3, "hard": 4}
_Q = "What is the zorplex value of 'cat'?"


def _lookup(word: str) -> Call:
    return Call("LOOKUP", {"word": word})


def _note(text: str) -> Call:
    return Call("NOTE", {"text": text})


def _list_question(words: list[str]) -> str:
    quoted = [f"'{w}'" for w in words]
    return f"What are the zorplex values of {', '.join(quoted[:-1])} and {quoted[-1]}?"


def _compositional(expression: str, values: dict[str, int], answer: int) -> Example:
    return Example(f"What is {expression}?", [(_lookup(w), v) for w, v in values.items()], answer)


# Worked examples for the system prompt, written in the env's tool-call format.
_EXAMPLES = {
    "simple": Example(_Q, [(_lookup("cat"), 17)], 17),
    ("compositional", "easy"): _compositional("zorplex('cat') + zorplex('sun')", {"cat": 17, "sun": 5}, 22),
    ("compositional", "medium"): _compositional("zorplex('cat') - zorplex('sun')", {"cat": 17, "sun": 5}, 12),
    ("compositional", "hard"): _compositional(
        "zorplex('cat') - zorplex('sun') * zorplex('ice')", {"cat": 17, "sun": 5, "ice": 3}, 36
    ),
    "multi_step": Example(
        _Q, [(Call("GETKEY", {"word": "cat"}), "ZK_3F9A01"), (Call("FETCH", {"key": "ZK_3F9A01"}), 17)], 17
    ),
    "recursive": Example(_Q, [(_lookup("cat"), "SEE: sun"), (_lookup("sun"), 17)], 17),
    "list": Example(_list_question(["cat", "sun"]), [(_lookup("cat"), 17), (_lookup("sun"), 5)], "17 5"),
}
_NOTES_EXAMPLE = Example(
    _Q, [(_lookup("cat"), "SEE: sun"), (_note("sun"), "noted"), (_lookup("sun"), 17)], 17
)
_QC = "What are the zorplex values along the chain from 'cat'?"
_COLLECT_EXAMPLE = Example(_QC, [(_lookup("cat"), "17 SEE: sun"), (_lookup("sun"), 5)], "17 5")
_COLLECT_NOTES_EXAMPLE = Example(
    _QC, [(_lookup("cat"), "17 SEE: sun"), (_note("17 sun"), "noted"), (_lookup("sun"), 5)], "17 5"
)


def fixed_table(table_seed: int) -> tuple[dict[str, int], np.random.Generator]:
    """The table for `table_seed`, and its RNG positioned just after the values (for keys)."""
    rng = np.random.default_rng(table_seed)
    return dict(zip(WORDS, rng.integers(1, 101, size=len(WORDS)).tolist(), strict=True)), rng


def draw_keys(rng: np.random.Generator) -> dict[str, str]:
    """One distinct `ZK_XXXXXX` key per word, drawn from `rng`."""
    codes = rng.integers(0, 1 << 24, size=len(WORDS)).tolist()
    while len(set(codes)) < len(codes):  # p ~ 2e-5 per table
        codes = rng.integers(0, 1 << 24, size=len(WORDS)).tolist()
    return {word: f"ZK_{code:06X}" for word, code in zip(WORDS, codes, strict=True)}


def _evaluate(values: list[int], ops: list[str]) -> int:
    total = values[0]
    for op, value in zip(ops, values[1:], strict=True):
        total = total + value if op == "+" else total - value if op == "-" else total * value
    return total


class ZorplexEnv(ToolEnv):
    """`gymnasium.make("toolgym/Zorplex-v0", tier="compositional", difficulty="hard")`.

    tier: simple, compositional, multi_step, recursive or list. difficulty: see the module doc.
    table_seed: fix the table (None: a new table per episode). chain_reward: the recursive and
    list tiers' process reward per lookup that follows the chain (module doc; 0 = off).
    redirects (recursive), items (list): a fixed length. collect (recursive): every chain word has
    a value and the answer lists them (module doc). Other keyword arguments are the ToolEnv knobs
    (max_turns=5, rewards, limits).
    """

    def __init__(
        self,
        tier: str = "simple",
        difficulty: str | None = None,
        table_seed: int | None = None,
        chain_reward: float = 0.0,
        redirects: int | None = None,
        items: int | None = None,
        collect: bool = False,
        **knobs: Any,
    ):
        if tier not in TIERS:
            raise ValueError(f"Zorplex tier must be one of {TIERS}, got {tier!r}")
        if difficulty not in DIFFICULTIES[tier]:
            raise ValueError(
                f"Zorplex tier {tier!r} takes difficulty in {DIFFICULTIES[tier]}, got {difficulty!r}"
            )
        if table_seed is not None and (not isinstance(table_seed, int) or table_seed < 0):
            raise ValueError(f"table_seed must be None or an int >= 0, got {table_seed!r}")
        number = isinstance(chain_reward, int | float) and not isinstance(chain_reward, bool)
        if not number or not math.isfinite(chain_reward):
            raise ValueError(f"chain_reward must be a finite number, got {chain_reward!r}")
        if chain_reward and tier not in ("recursive", "list"):
            raise ValueError(
                f"chain_reward is the recursive and list tiers' process reward, got tier {tier!r}"
            )
        if redirects is not None and (
            tier != "recursive" or not isinstance(redirects, int) or not 1 <= redirects <= len(WORDS) - 2
        ):
            raise ValueError(
                f"redirects is the recursive tier's chain length, an int in 1..{len(WORDS) - 2}: got "
                f"{redirects!r} for tier {tier!r}"
            )
        if items is not None and (
            tier != "list" or not isinstance(items, int) or not 2 <= items <= len(WORDS) // 2
        ):
            raise ValueError(
                f"items is the list tier's number of words, an int in 2..{len(WORDS) // 2}: got "
                f"{items!r} for tier {tier!r}"
            )
        if collect and tier != "recursive":
            raise ValueError(f"collect is a recursive tier's variant, got tier {tier!r}")
        self.collect = bool(collect)
        self.redirects_fixed = redirects
        self.items_fixed = items
        self.chain_reward = float(chain_reward)
        self.chain: list[str] = []
        self._followed: set[str] = set()  # the chain's words looked up so far (each pays once)
        self._strayed = 0  # lookups that did not follow the chain (a wrong word, or one again)
        self.tier = tier
        self.difficulty = difficulty
        self.table_seed = table_seed
        self._fixed_table: dict[str, int] | None = None
        self._fixed_keys: dict[str, str] | None = None
        if table_seed is not None:
            self._fixed_table, table_rng = fixed_table(table_seed)
            self._fixed_keys = draw_keys(table_rng)
        self.table: dict[str, int] = {}
        self.redirects: dict[str, str] = {}  # recursive: each chain word's next
        self.keys: dict[str, str] = {}
        self._key_values: dict[str, int] = {}

        if tier == "multi_step":
            tools = [
                Tool("GETKEY", "the key of a word", self._getkey, arg="word"),
                Tool("FETCH", "the zorplex value stored under a key", self._fetch, arg="key"),
            ]
        else:
            tools = [Tool("LOOKUP", "the zorplex value of a word", self._lookup, arg="word")]
        level = difficulty or "hard"
        example = _EXAMPLES[(tier, level)] if tier == "compositional" else _EXAMPLES[tier]
        noting = tier == "recursive" and bool(knobs.get("notes"))
        if noting:
            example = _NOTES_EXAMPLE
        if self.collect:
            example = _COLLECT_NOTES_EXAMPLE if noting else _COLLECT_EXAMPLE
        knobs.setdefault("grader", text_grader() if tier == "list" or self.collect else numeric())
        instructions = _INSTRUCTIONS["collect" if self.collect else tier]
        super().__init__(tools=tools, instructions=instructions, example=example, **knobs)

        most_calls = {"simple": 1, "multi_step": 2}.get(tier) or (
            {"easy": 2, "medium": 2, "hard": 3}[level] if tier == "compositional" else self._lookups(level)
        )
        most_turns = most_calls + 1 + (most_calls - 1 if noting else 0)  # a note per redirect
        if self.max_turns < most_turns or self.max_tool_calls < most_calls:
            raise ValueError(
                f"Zorplex {tier}/{difficulty} needs up to {most_calls} tool calls and an answer: "
                f"{' and notes' if noting else ''}: max_turns >= {most_turns} and max_tool_calls >= {most_calls}, got "
                f"max_turns={self.max_turns}, max_tool_calls={self.max_tool_calls}"
            )

    def _lookups(self, level: str) -> int:
        """The lookups a recursive chain or a list of `level` takes (`redirects`/`items` win)."""
        if self.tier == "list":
            return self.items_fixed or _LIST_LENGTHS[level]
        return (self.redirects_fixed or _REDIRECTS[level]) + 1

    # ---- tools (per-episode state: table, redirects, keys) -------------------------------------

    def _lookup(self, word: str) -> str | ToolResult:
        word = word.lower()
        target = self.redirects.get(word)
        value = self.table.get(word)
        text = f"SEE: {target}" if target is not None else "UNKNOWN" if value is None else str(value)
        if self.collect and target is not None:
            text = f"{value} SEE: {target}"
        if self.tier == "list":  # an asked word's first lookup, in any order
            following = word in self.chain and word not in self._followed
        else:  # the chain's next word
            following = len(self._followed) < len(self.chain) and word == self.chain[len(self._followed)]
        if following:
            self._followed.add(word)
        else:
            self._strayed += 1
        if self.chain_reward and following:
            return ToolResult(text, {"chain": self.chain_reward})
        return text

    def credit_state(self) -> str | None:
        """The recursive and list tiers: the chain's words followed and the lookups that strayed
        so far (`credit = "turn_state"`'s key, envs/core/info.py); None for the other tiers."""
        if self.tier not in ("recursive", "list"):
            return None
        return f"followed {len(self._followed)} strayed {self._strayed}"

    def _getkey(self, word: str) -> str:
        return self.keys.get(word.lower(), "UNKNOWN_WORD")

    def _fetch(self, key: str) -> str:
        value = self._key_values.get(key.upper())
        return "INVALID_KEY" if value is None else str(value)

    # ---- tasks ---------------------------------------------------------------------------------

    def new_task(self) -> Task:
        rng = self.np_random
        if self._fixed_table is None:
            self.table = dict(zip(WORDS, rng.integers(1, 101, size=len(WORDS)).tolist(), strict=True))
        else:
            self.table = self._fixed_table
        self.redirects, self.chain, self._followed, self._strayed = {}, [], set(), 0
        order = rng.permutation(len(WORDS)).tolist()
        word = WORDS[order[0]]
        question = f"What is the zorplex value of '{word}'?"

        if self.tier == "simple":
            value = self.table[word]
            return Task(question, value, [_lookup(word)])

        if self.tier == "compositional":
            level = self.difficulty or _LEVELS[int(rng.integers(3))]
            n_words = 3 if level == "hard" else 2
            words = [WORDS[i] for i in order[:n_words]]
            if level == "easy":
                ops = ["+"]
            else:
                ops = [_OPS[i] for i in rng.integers(3, size=n_words - 1).tolist()]
            expression = " ".join(
                f"{op} zorplex('{w}')" for op, w in zip(["", *ops], words, strict=True)
            ).lstrip()
            answer = _evaluate([self.table[w] for w in words], ops)
            return Task(f"What is {expression}?", answer, [_lookup(w) for w in words])

        if self.tier == "multi_step":
            self.keys = self._fixed_keys if self._fixed_keys is not None else draw_keys(rng)
            self._key_values = {key: self.table[w] for w, key in self.keys.items()}
            value, key = self.table[word], self.keys[word]
            return Task(question, value, [Call("GETKEY", {"word": word}), Call("FETCH", {"key": key})])

        if self.tier == "list":
            level = self.difficulty or _LEVELS[int(rng.integers(3))]
            self.chain = [WORDS[i] for i in order[: self._lookups(level)]]
            answer = " ".join(str(self.table[w]) for w in self.chain)
            return Task(_list_question(self.chain), answer, [_lookup(w) for w in self.chain])

        # recursive: order[0] -> order[1] -> ... -> the chain's last word, which holds the number.
        level = self.difficulty or _LEVELS[int(rng.integers(3))]
        self.chain = [WORDS[i] for i in order[: self._lookups(level)]]
        self.redirects = dict(itertools.pairwise(self.chain))
        value = self.table[self.chain[-1]]
        if self.collect:
            question = f"What are the zorplex values along the chain from '{word}'?"
            value = " ".join(str(self.table[w]) for w in self.chain)
        if not self.notes:
            return Task(question, value, [_lookup(w) for w in self.chain])
        steps: list[Call] = [_lookup(self.chain[0])]
        for at, word in enumerate(self.chain[1:], start=1):
            steps += [
                _note(self._collect_note(self.chain[:at], word) if self.collect else word),
                _lookup(word),
            ]
        return Task(question, value, steps, needed_tool_calls=len(self.chain))

    def _collect_note(self, looked_up: list[str], next_word: str) -> str:
        """The collecting chain's note: the values of the words looked up so far, then the next word."""
        return " ".join([*(str(self.table[w]) for w in looked_up), next_word])

    def wrong_note_actions(self, rng: np.random.Generator) -> list[str] | None:
        """A demonstrator's script that notes a wrong word at one redirect (drawn from `rng`),
        looks it up and answers its value (wrong); None without notes or redirects. Collecting,
        the wrong note names a wrong word or, as often, miscopies one value, which then rides
        along in every later note and the answer."""
        if not self.notes or len(self.chain) < 2:
            return None
        at = int(rng.integers(1, len(self.chain)))  # the note of chain[at] goes wrong
        off_chain = [w for w in WORDS if w not in self.chain]
        wrong = off_chain[int(rng.integers(len(off_chain)))]
        if not self.collect:
            steps: list[Call] = [_lookup(self.chain[0])]
            for word in self.chain[1:at]:
                steps += [_note(word), _lookup(word)]
            steps += [_note(wrong), _lookup(wrong)]
            actions = [self.format.render_calls(self.tools, [step]) for step in steps]
            return [*actions, self.answer_action(self.table[wrong])]
        miscopy = bool(rng.random() < 0.5)
        slot = int(rng.integers(at))  # the value miscopied, one of those noted so far
        shift = int(rng.integers(1, 100))
        path = self.chain if miscopy else [*self.chain[:at], wrong]
        carried = [str(self.table[w]) for w in path]  # the values the notes from `at` on carry
        if miscopy:
            carried[slot] = str((int(carried[slot]) + shift - 1) % 100 + 1)  # another value
        steps = [_lookup(path[0])]
        for i, word in enumerate(path[1:], start=1):
            note = " ".join([*carried[:i], word]) if i >= at else self._collect_note(path[:i], word)
            steps += [_note(note), _lookup(word)]
        actions = [self.format.render_calls(self.tools, [step]) for step in steps]
        return [*actions, self.answer_action(" ".join(carried))]

    def wrong_lookup_actions(self, rng: np.random.Generator, p: float) -> list[str] | None:
        """A demonstrator's script for the list tier: each asked word's lookup independently goes,
        with probability `p`, to a word not asked (drawn from `rng`), and the answer lists the
        values it looked up (so it is wrong). None in another tier or when no lookup goes wrong."""
        if self.tier != "list" or not self.chain:
            return None
        wrong = rng.random(len(self.chain)) < p
        off_list = [w for w in WORDS if w not in self.chain]
        picks = rng.integers(len(off_list), size=len(self.chain)).tolist()
        if not wrong.any():
            return None
        looked_up = [off_list[i] if bad else w for w, bad, i in zip(self.chain, wrong, picks, strict=True)]
        actions = [self.format.render_calls(self.tools, [_lookup(w)]) for w in looked_up]
        return [*actions, self.answer_action(" ".join(str(self.table[w]) for w in looked_up))]
