"""Shared-prefix micro-batches: the prefix is computed once, and nothing else changes."""

import random
import sys
from pathlib import Path

import msgspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainers_testlib import full_grads

from toolgym.agents.model.config import ModelConfig
from toolgym.agents.model.transformer import build_model
from toolgym.rollouts.types import Episode
from toolgym.trainers.batching import make_micro_batches
from toolgym.trainers.config import TrainerConfig
from toolgym.trainers.forward import batch_logits
from toolgym.trainers.losses import LossConfig
from toolgym.trainers.shared_prefix import shared_prefix_length
from toolgym.trainers.trainer import Trainer

torch.set_num_threads(1)


def _prefixed_episodes(n: int, prefix_len: int, seed: int = 0, vocab: int = 256) -> list[Episode]:
    """A common masked prefix (a system prompt), then a masked question and a sampled answer of
    varied lengths per episode."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    out = []
    for _ in range(n):
        question = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        answer = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        tokens = prefix + question + answer
        mask = [0] * (prefix_len + len(question)) + [1] * len(answer)
        advantage = rng.gauss(0.0, 1.0)
        out.append(
            Episode(
                tokens=tokens,
                loss_mask=mask,
                sampler_logprobs=[-5.5 * m for m in mask],
                advantages=[advantage * m for m in mask],
            )
        )
    return out


def test_shared_prefix_length_stops_at_divergence_and_at_trained_targets():
    rows = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9, 9], [1, 2, 3, 4, 5]]
    untrained = [[0] * len(r) for r in rows]
    assert shared_prefix_length(rows, untrained) == 3  # tokens 0..3 agree: positions 0..2 predict 1..3
    masks = [[0, 0, 1, 0, 0, 0], [0] * 7, [0] * 5]  # row 0 trains token 2
    assert shared_prefix_length(rows, masks) == 1
    assert shared_prefix_length(rows[:1], untrained[:1]) == 0  # one row: nothing to share
    # every row keeps an input position of its own
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]], [[0, 0, 0], [0, 0, 0]]) == 1


def test_micro_batch_layout_folds_the_prefix_into_leading_rows():
    episodes = _prefixed_episodes(6, prefix_len=30)
    (mb,) = make_micro_batches(episodes, 10_000, pad_token_id=0, share_prefix=True)
    (plain,) = make_micro_batches(episodes, 10_000, pad_token_id=0)
    assert mb.prefix_len >= 29 and mb.prefix_rows >= 1  # 30 common tokens: 29 shared positions
    width = mb.input_ids.shape[1]
    assert mb.prefix_rows == -(-mb.prefix_len // width)
    assert (
        mb.input_ids[: mb.prefix_rows].flatten()[: mb.prefix_len].tolist()
        == episodes[0].tokens[: mb.prefix_len]
    )
    assert mb.num_padded_tokens < 0.75 * plain.num_padded_tokens
    assert mb.num_real_tokens == plain.num_real_tokens - (len(episodes) - 1) * mb.prefix_len
    # the per-episode tensors are the plain ones with the shared columns removed
    p = mb.prefix_len
    for name in ("targets", "loss_mask", "advantages", "sampler_logprobs"):
        got, want = getattr(mb, name), getattr(plain, name)
        for row in range(len(episodes)):
            n = int(mb.lengths[row])
            assert torch.equal(got[row, :n], want[row, p : p + n]), name
    # no common prefix: the plain layout
    (unshared,) = make_micro_batches(_prefixed_episodes(4, 0, seed=3), 10_000, share_prefix=True)
    assert unshared.prefix_rows == 0 and unshared.positions is None


@pytest.mark.parametrize("model_name", ["test", "test-qwen3"])
def test_shared_prefix_logits_match_full_rows(model_name):
    model = build_model(model_name, seed=0)
    episodes = _prefixed_episodes(7, prefix_len=25, seed=1)
    (mb,) = make_micro_batches(episodes, 10_000, share_prefix=True)
    (plain,) = make_micro_batches(episodes, 10_000)
    assert mb.prefix_rows > 0
    with torch.no_grad():
        shared, full = batch_logits(model, mb), batch_logits(model, plain)
    for row in range(len(episodes)):
        n = int(mb.lengths[row])
        torch.testing.assert_close(
            shared[row, :n], full[row, mb.prefix_len : mb.prefix_len + n], atol=1e-5, rtol=1e-5
        )


_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)  # fmt: skip
WINDOWED = {
    "mistral": ModelConfig(**_TINY, model_type="mistral", sliding_window=6),
    "gemma3_text": ModelConfig(
        **_TINY, model_type="gemma3_text", sliding_window=5, rope_local_base_freq=1e4, query_pre_attn_scalar=16,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(WINDOWED))
def test_shared_prefix_logits_match_full_rows_with_sliding_windows(name):
    """Windows shorter than the prefix: the prefix's and the rows' attention are banded as in full
    rows (and the window binds: the full-context model's logits differ)."""
    config = WINDOWED[name]
    model = build_model(config, seed=0)
    episodes = _prefixed_episodes(5, prefix_len=25, seed=1)
    (mb,) = make_micro_batches(episodes, 10_000, share_prefix=True)
    (plain,) = make_micro_batches(episodes, 10_000)
    assert mb.prefix_rows > 0 and mb.prefix_len > 2 * (config.sliding_window or 0)
    unwindowed = build_model(msgspec.structs.replace(config, sliding_window=1000), seed=0)
    with torch.no_grad():
        shared, full = batch_logits(model, mb), batch_logits(model, plain)
        everything = batch_logits(unwindowed, plain)
    assert (full - everything).abs().max() > 1e-3
    for row in range(len(episodes)):
        n = int(mb.lengths[row])
        torch.testing.assert_close(
            shared[row, :n], full[row, mb.prefix_len : mb.prefix_len + n], atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("loss_name", ["grpo", "dapo"])
def test_trainer_step_with_shared_prefix_matches_without(loss_name):
    episodes = _prefixed_episodes(9, prefix_len=40, seed=2)
    results = {}
    for share in (True, False):
        config = TrainerConfig(loss=LossConfig(name=loss_name), micro_batch_tokens=400, share_prefix=share)
        trainer = Trainer(build_model("test", seed=0), config, device="cpu")
        metrics = trainer._forward_backward(episodes, trainer.policy_loss, sharded=False)
        results[share] = metrics, full_grads(trainer.model)
    (m_shared, g_shared), (m_plain, g_plain) = results[True], results[False]
    assert m_shared["num_tokens"] == m_plain["num_tokens"]
    assert m_shared["num_positions"] < m_plain["num_positions"]  # the prefix was computed once
    assert m_shared["loss"] == pytest.approx(m_plain["loss"], rel=1e-5, abs=1e-7)
    for name, grad in g_plain.items():
        torch.testing.assert_close(g_shared[name], grad, atol=1e-6, rtol=1e-4, msg=name)
