"""Build the shipped tokenizers, `configs/assets/tokenizer.json` (the CPU default) and
`configs/assets/tokenizers/copy/tokenizer.json`, from the repo's own envs.

    python -m toolgym.tools.build_tokenizer                  # rewrite configs/assets/
    python -m toolgym.tools.build_tokenizer --split copy     # rewrite configs/assets/tokenizers/copy/
    python -m toolgym.tools.build_tokenizer --split textworld  # ... tokenizers/textworld/ (needs [textworld])
    python -m toolgym.tools.build_tokenizer --check          # exit 1 if the committed files differ
    python -m toolgym.tools.build_tokenizer --out DIR        # write elsewhere
    python -m toolgym.tools.build_tokenizer --split words --out DIR  # words never take punctuation

A byte-level BPE in the Qwen2 style (NFC, Qwen's split regex so digits are single tokens, byte-level
alphabet) with the ChatML special tokens at fixed ids, `<|endoftext|>` 0, `<|im_start|>` 1,
`<|im_end|>` 2, and at most `VOCAB_SIZE` tokens in all (the "tiny" model has 1024 embedding rows).
It is trained offline on the text the runner shows the model: the envs' system prompts and
questions, oracle actions, tool observations, error observations after the envs' own mistaken
actions, and plainly stated answers, rendered as ChatML for the envs in `ENV_CONFIGS` over fixed
seeds.

The output is deterministic (fixed seeds, fixed order; the BPE trainer breaks frequency ties by the
pair itself), so the script regenerates the committed files byte for byte, and a test checks that.
When env texts change, that test fails: rebuild with this script and commit the files.
`tokenizer.fingerprint` holds `tokenizer_fingerprint()` of the result (what recordings carry).

Other splits. With Qwen2's split `[lemon` is one token, so the call `LOOKUP[lemon]` after a
question's `'lemon'` maps one token to another and the tiny model learns that mapping per word
instead of a copy (docs/training.md, "What makes the tiny model learn to copy").
`--split words` (not shipped) lets a word take only a leading space, as GPT-2's split does: the
call's word is the question's token, but `SEE: queen` still gives ` queen` where `NOTE[queen]`
needs `queen`. `--split copy` (shipped, `[tokenizer] path = "copy"`) also joins a colon and the
space after it when a word follows, so each word a Zorplex chain passes along is one token
wherever it appears, and a lone space is still the token before a value (`= 17`, and before the answer's),
as with Qwen2's split: following the chain and copying its value are both copies (docs/context.md).
`--split textworld` (shipped, the textworld_tiny preset's) is `copy` with a number of up to two
digits one token, trained on this corpus plus TextWorld games (`textworld_texts`): a numbered name
(key86) is a noun and one numeral wherever it appears, and a TextWorld episode half as many tokens.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from ..agents.tokenizer import tokenizer_fingerprint
from ..configs.load import SHIPPED_TOKENIZER, SHIPPED_TOKENIZERS

ASSETS_DIR = SHIPPED_TOKENIZER.parent  # configs/assets/
SHIPPED_TOKENIZER_PATH = SHIPPED_TOKENIZER
FINGERPRINT_FILENAME = "tokenizer.fingerprint"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
VOCAB_SIZE = 1000
# Qwen2's pre-tokenizer split: words with an optional leading non-letter, single digits,
# punctuation runs, newline runs, spaces.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The same, except that a word takes at most a leading space (GPT-2's rule for letters).
WORDS_SPLIT_REGEX = QWEN2_SPLIT_REGEX.replace(r"[^\r\n\p{L}\p{N}]?\p{L}+", r" ?\p{L}+")
# Copy-friendly: as `words`, and a space after a colon joins the colon when a word follows
# (`SEE: queen` gives `: ` then `queen`), so a word is the same token after `'`, `[` or `: `, and a
# lone space stays the token before a value (`= 17`, and in the answer).
COPY_SPLIT_REGEX = WORDS_SPLIT_REGEX.replace(r" ?\p{L}+", r"(?<!: ) ?\p{L}+|(?<=: )\p{L}+").replace(
    r" ?[^\s\p{L}\p{N}]+[\r\n]*", r" ?[^\s\p{L}\p{N}]+(?:(?<=:) (?=\p{L}))?[\r\n]*"
)
# TextWorld's `basic` grammar: as `copy`, and a number of one or two digits is one piece, so a
# numbered name (box49, key86, room05) is a noun and one numeral token, copied from the goal as
# one token, as a lettered name (` X`-key) is: with single digits the tiny model copied letters
# and not two-digit numbers (docs/demos.md).
TEXTWORLD_SPLIT_REGEX = COPY_SPLIT_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,2}|")
SPLITS = {
    "qwen2": QWEN2_SPLIT_REGEX,
    "words": WORDS_SPLIT_REGEX,
    "copy": COPY_SPLIT_REGEX,
    "textworld": TEXTWORLD_SPLIT_REGEX,
}
# Where each shipped split lives (configs/load.py resolves `[tokenizer] path = "copy"` there).
SHIPPED_DIRS = {
    "qwen2": ASSETS_DIR,
    "copy": SHIPPED_TOKENIZERS / "copy",
    "textworld": SHIPPED_TOKENIZERS / "textworld",
}

# (env id, make kwargs, seeds). Seeds are fixed so the corpus, and so the file, never changes
# unless the envs' texts do.
ENV_CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("toolgym/Zorplex-v0", {"tier": "simple"}),
    ("toolgym/Zorplex-v0", {"tier": "compositional", "difficulty": "easy"}),
    ("toolgym/Zorplex-v0", {"tier": "compositional", "difficulty": "medium"}),
    ("toolgym/Zorplex-v0", {"tier": "compositional", "difficulty": "hard"}),
    ("toolgym/Zorplex-v0", {"tier": "multi_step"}),
    ("toolgym/Zorplex-v0", {"tier": "recursive", "difficulty": "easy"}),
    ("toolgym/Zorplex-v0", {"tier": "recursive", "difficulty": "hard"}),
    ("toolgym/SumDigits-v0", {}),
    ("toolgym/SumDigits-v0", {"max_count": 8, "max_value": 999}),
    # JSON tool calls (<tool_call> blocks, JSON Schemas, <tool_response> blocks) merge into few tokens.
    ("toolgym/Shop-v0", {}),
    ("toolgym/Zorplex-v0", {"tier": "simple", "tool_format": "json"}),
    ("toolgym/Zorplex-v0", {"tier": "multi_step", "tool_format": "json"}),
)
SEEDS_PER_CONFIG = 200
# The textworld split's corpus adds TextWorld-v0 played by its oracle: the textworld_tiny preset's
# games (its env kwargs), TEXTWORLD_EPISODES training episodes on TEXTWORLD_GAMES compiled games
# (~0.7 s each, compiled into a temporary folder), each under names of its own, weighted
# TEXTWORLD_REPEATS times against the other envs' text; and every numbered name the grammar makes,
# so each numeral is one token.
TEXTWORLD_PRESET = "textworld_tiny"
TEXTWORLD_GAMES = 16
TEXTWORLD_EPISODES = 200
TEXTWORLD_REPEATS = 3
TEXTWORLD_NAME_REPEATS = 20  # with 3, three numerals of 110 stayed two tokens


def train_bpe(
    texts: Iterable[str], vocab_size: int = VOCAB_SIZE, min_frequency: int = 2, split: str = "qwen2"
) -> Tokenizer:
    """Train a Qwen2-style byte-level BPE with the ChatML special tokens at ids 0, 1, 2.

    `texts` are the plain-text pieces between control tokens (what `ChatRenderer` encodes);
    `split` names the pre-tokenizer's regex in `SPLITS`.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, not {split!r}")
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be >= {len(SPECIAL_TOKENS) + 256} (specials + bytes)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLITS[split]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == expected_id, (token, tokenizer.token_to_id(token))
    return tokenizer


def chatml_text_pieces(messages: Sequence[tuple[str, str]]) -> Iterator[str]:
    """The text between control tokens of a ChatML rendering, split the way `ChatRenderer`
    encodes it: "{role}\\n{content}" for non-assistant turns, "assistant\\n" and the content
    apart for assistant turns, and the "\\n" after each `<|im_end|>`."""
    for role, content in messages:
        if role == "assistant":
            yield "assistant\n"
            yield content
        else:
            yield f"{role}\n{content}"
        yield "\n"


def env_conversations(seeds_per_config: int = SEEDS_PER_CONFIG) -> Iterator[list[tuple[str, str]]]:
    """Conversations as the runner shows them to the model, from the envs' public API only:
    oracle episodes (answers in the env's format and stated plainly) and episodes with the env's
    `mistaken_actions()` before every oracle action (so its error observations are in the corpus;
    three errors in a row end an episode)."""
    import gymnasium

    from .. import envs  # noqa: F401  (registers the toolgym/ envs)

    for env_id, kwargs in ENV_CONFIGS:
        env = gymnasium.make(env_id, **kwargs)
        try:
            for seed in range(seeds_per_config):
                yield _oracle_episode(env, seed, untagged=False)
                if seed % 4 == 0:
                    yield _oracle_episode(env, seed, untagged=True)
                if seed % 8 == 0:
                    yield _malformed_episode(env, seed)
        finally:
            env.close()


def _oracle_episode(env: Any, seed: int, untagged: bool = False, role: str = "tool") -> list[tuple[str, str]]:
    """The oracle's episode of `seed`, the env's replies as `role`; `untagged`: the answer stated
    plainly, not in the env's format."""
    obs, info = env.reset(seed=seed)
    messages = [("system", info.get("system_prompt", "")), ("user", obs)]
    actions = list(env.unwrapped.oracle_actions())
    if untagged:
        actions[-1] = env.unwrapped.answer_action(info["answer"], tagged=False)
    return _play(env, messages, actions, role)


def _malformed_episode(env: Any, seed: int) -> list[tuple[str, str]]:
    obs, info = env.reset(seed=seed)
    messages = [("system", info["system_prompt"]), ("user", obs)]
    oracle = list(env.unwrapped.oracle_actions())
    mistakes = env.unwrapped.mistaken_actions()
    actions = [a for i, good in enumerate(oracle) for a in (mistakes[(seed + i) % len(mistakes)], good)]
    return _play(env, messages, actions)


def _play(
    env: Any, messages: list[tuple[str, str]], actions: list[str], role: str = "tool"
) -> list[tuple[str, str]]:
    """Step `actions` through `env` after `messages` (system + question), adding each action and
    the env's reply (as `role`) until the episode ends."""
    for action in actions:
        messages.append(("assistant", action))
        obs, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            break
        messages.append((role, obs))
    return messages


def corpus_texts(seeds_per_config: int = SEEDS_PER_CONFIG) -> Iterator[str]:
    for conversation in env_conversations(seeds_per_config):
        yield from chatml_text_pieces(conversation)


def textworld_texts() -> Iterator[str]:
    """The textworld split's own text (TEXTWORLD_* above), as the runner shows it to the model."""
    import tempfile

    import gymnasium

    from ..configs.load import load_config
    from ..envs.adapters.textworld import NOUNS, NUMERALS, TRAINING_SEEDS

    config, _ = load_config(TEXTWORLD_PRESET)
    texts: list[str] = []
    with tempfile.TemporaryDirectory(prefix="textworld-games-") as game_dir:
        kwargs = dict(config.env.kwargs, training_games=TEXTWORLD_GAMES, game_dir=game_dir)
        env: Any = gymnasium.make(config.env.id, **kwargs)
        try:
            for i in range(TEXTWORLD_EPISODES):  # played as they are read: a reader may stop early
                episode = _oracle_episode(env, TRAINING_SEEDS + i, role=config.rollout.observation_role)
                pieces = list(chatml_text_pieces(episode))
                texts += pieces
                yield from pieces
        finally:
            env.close()
    for _ in range(TEXTWORLD_REPEATS - 1):
        yield from texts
    names = " ".join(f"{noun}{numeral}" for noun in NOUNS for numeral in NUMERALS)
    for _ in range(TEXTWORLD_NAME_REPEATS):
        yield names


def build(out_dir: str | Path = ASSETS_DIR, split: str = "qwen2") -> Path:
    """Train on the env corpus and write `tokenizer.json` and `tokenizer.fingerprint` to `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = corpus_texts()
    if split == "textworld":
        texts = itertools.chain(texts, textworld_texts())
    tokenizer = train_bpe(texts, split=split)
    path = out_dir / "tokenizer.json"
    path.write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    (out_dir / FINGERPRINT_FILENAME).write_text(tokenizer_fingerprint(tokenizer) + "\n", encoding="utf-8")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default: the split's shipped one)"
    )
    parser.add_argument(
        "--check", action="store_true", help="build into a temporary directory and compare with --out"
    )
    parser.add_argument(
        "--split", choices=sorted(SPLITS), default="qwen2", help="the pre-tokenizer's split (default: qwen2)"
    )
    args = parser.parse_args(argv)
    shipped = SHIPPED_DIRS.get(args.split)
    if args.out is None:
        if shipped is None:
            parser.error(f"--split {args.split} is not shipped: give --out DIR")
        args.out = shipped
    taken = {d.resolve(): split for split, d in SHIPPED_DIRS.items()}
    if taken.get(args.out.resolve(), args.split) != args.split:
        parser.error(
            f"{args.out} holds the shipped {taken[args.out.resolve()]} split; write --split {args.split} elsewhere"
        )
    if not args.check:
        path = build(args.out, split=args.split)
        print(f"wrote {path} and {path.with_name(FINGERPRINT_FILENAME)}")
        return 0
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        build(tmp, split=args.split)
        stale = [
            name
            for name in ("tokenizer.json", FINGERPRINT_FILENAME)
            if not (args.out / name).is_file()
            or (args.out / name).read_bytes() != (Path(tmp) / name).read_bytes()
        ]
    if stale:
        print(f"out of date in {args.out}: {', '.join(stale)} (rerun without --check)", file=sys.stderr)
        return 1
    print(f"{args.out} is up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
