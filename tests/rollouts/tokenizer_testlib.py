"""Fixtures for rollouts and CLI tests (their conftest.py imports them): a tiny byte-level BPE
tokenizer with the ChatML specials, trained here (no downloads), and its ChatRenderer."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from toolgym.agents.chat import ChatRenderer

_CORPUS = [
    "What is the value of zorp plus blick? LOOKUP[zorp] LOOKUP[blick] [ANSWER] 42",
    "zorp = 17. blick = 25. The answer is 42. Unknown tool FOO. Malformed call.",
    "You are a helpful agent. Use tools like LOOKUP[word] and answer with [ANSWER] <number>.",
    "What is the total digit sum of [12, 345, 6789]? GETKEY[apple] FETCH[key] SEE[x]",
    "system user assistant tool \n\n 0 1 2 3 4 5 6 7 8 9",
] * 20


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return tok


@pytest.fixture(scope="session")
def renderer(tokenizer) -> ChatRenderer:
    return ChatRenderer(tokenizer)
