"""Chunked logprob/entropy from logits: values, gradients, memory kept for backward."""

import pytest
import torch

from toolgym.trainers import logprobs as logprobs_module
from toolgym.trainers.logprobs import (
    entropy_from_logits,
    head_token_scores,
    token_logprobs,
    token_logprobs_and_entropy,
)


def _reference(logits, targets, temperature):
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return logp.gather(-1, targets[..., None])[..., 0], torch.distributions.Categorical(logits=logp).entropy()


@pytest.fixture(params=[False, True], ids=["one-chunk", "chunked"])
def chunking(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", 3 * 11)  # 3 rows per chunk
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_match_log_softmax(chunking, dtype, temperature):
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(2, 5, 11, generator=g)).to(dtype)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    logp, ent = token_logprobs_and_entropy(logits, targets, temperature)
    ref_logp, ref_ent = _reference(logits, targets, temperature)
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)
    assert token_logprobs_and_entropy(logits, targets, with_entropy=False)[1] is None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradient_matches_autograd_and_leaves_logits_alone(chunking, temperature):
    g = torch.Generator().manual_seed(4)
    base = 2 * torch.randn(3, 4, 11, generator=g)
    targets = torch.randint(0, 11, (3, 4), generator=g)
    weights = torch.randn(3, 4, generator=g)
    logits = base.clone().requires_grad_(True)
    (token_logprobs(logits, targets, temperature) * weights).sum().backward()
    reference = base.clone().requires_grad_(True)
    (_reference(reference, targets, temperature)[0] * weights).sum().backward()
    torch.testing.assert_close(logits.grad, reference.grad)
    assert torch.equal(logits.detach(), base)  # backward recomputes the softmax without touching them


def test_one_pass_logprobs_train_and_its_entropy_is_a_metric(chunking):
    # token_logprobs_and_entropy shares its pass over the logits: the logprobs' gradient is
    # token_logprobs' own, the entropy has no grad and equals entropy_from_logits.
    g = torch.Generator().manual_seed(5)
    base = 2 * torch.randn(3, 4, 11, generator=g)
    targets = torch.randint(0, 11, (3, 4), generator=g)
    weights = torch.randn(3, 4, generator=g)
    logits, alone = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    logp, ent = token_logprobs_and_entropy(logits, targets, 0.7)
    (logp * weights).sum().backward()
    (token_logprobs(alone, targets, 0.7) * weights).sum().backward()
    assert logp.requires_grad and not ent.requires_grad
    torch.testing.assert_close(logits.grad, alone.grad)
    torch.testing.assert_close(ent, entropy_from_logits(base, 0.7))


def test_gradcheck_float64(chunking):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, 0.9), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 0.9), (logits,))


def test_backward_keeps_only_the_logits():
    logits = torch.randn(4, 6, 50, requires_grad=True)
    z = logits * 1.0  # a non-leaf, like a model's output
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(z, torch.zeros(4, 6, dtype=torch.long))
    assert sum(saved) <= logits.numel() + 2 * 4 * 6  # the logits + targets + one float per position


def test_bad_temperature():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(torch.zeros(1, 3), -1.0)


# ---- the fused head: hidden states and the output layer straight into logprobs ----------------


@pytest.fixture(params=[False, True], ids=["one-head-chunk", "head-chunked"])
def head_chunking(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(logprobs_module, "HEAD_CHUNK_ELEMENTS", 4 * 13)  # 4 rows per chunk
    return request.param


def _head(hidden_size=6, vocab=13, seed=7, bias=False):
    torch.manual_seed(seed)
    return torch.nn.Linear(hidden_size, vocab, bias=bias)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True], ids=["fused", "any-head"])
def test_head_scores_and_gradients_equal_the_logits_path(head_chunking, temperature, bias):
    g = torch.Generator().manual_seed(8)
    head = _head(bias=bias)
    base = 2 * torch.randn(10, 6, generator=g)
    targets = torch.randint(0, 13, (10,), generator=g)
    weights = torch.randn(10, generator=g)

    hidden = base.clone().requires_grad_(True)
    logp, ent, argmax = head_token_scores(
        hidden, head, targets, temperature, with_entropy=True, with_argmax=True
    )
    (logp * weights).sum().backward()
    fused_grads = hidden.grad, head.weight.grad.clone()
    head.weight.grad = None

    reference = base.clone().requires_grad_(True)
    logits = head(reference)
    ref_logp, ref_ent = _reference(logits, targets, temperature)
    (ref_logp * weights).sum().backward()
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent.detach())
    assert torch.equal(argmax, logits.detach().argmax(-1))
    assert logp.requires_grad and not ent.requires_grad
    torch.testing.assert_close(fused_grads[0], reference.grad)
    torch.testing.assert_close(fused_grads[1], head.weight.grad)
    none = head_token_scores(base, head, targets)
    assert none[1] is None and none[2] is None


def test_head_gradcheck_float64(head_chunking):
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 5, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (9,), generator=g)
    assert torch.autograd.gradcheck(
        lambda x, w: head_token_scores(x, _WeightOnly(w), targets, 0.8)[0], (hidden, weight)
    )


class _WeightOnly(torch.nn.Linear):
    """A bias-free Linear around a given weight tensor (gradcheck perturbs the tensor itself)."""

    def __init__(self, weight):
        torch.nn.Module.__init__(self)
        self.weight, self.bias = weight, None


def test_head_under_bf16_autocast_is_close_and_keeps_float32_gradients(head_chunking):
    g = torch.Generator().manual_seed(10)
    head = _head(hidden_size=16, vocab=40)
    hidden = torch.randn(12, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (12,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _, _ = head_token_scores(hidden, head, targets)
    logp.sum().backward()
    assert logp.dtype == torch.float32
    assert hidden.grad.dtype == head.weight.grad.dtype == torch.float32
    torch.testing.assert_close(logp, _reference(head(hidden.detach()), targets, 1.0)[0], atol=0.05, rtol=0.02)


def test_head_keeps_no_logits_for_backward():
    # What autograd keeps: the hidden rows, the weight, the targets and one float per row; never
    # a [rows x vocab] tensor.
    head = _head(hidden_size=8, vocab=500)
    hidden = torch.randn(30, 8, requires_grad=True) * 1.0
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head_token_scores(hidden, head, torch.zeros(30, dtype=torch.long))
    assert max(saved) <= 500 * 8
    assert sum(saved) <= 30 * 8 + 500 * 8 + 2 * 30


# ---- several targets a position (the top-k forward KL scores the teacher's top-k too) ------------


@pytest.mark.parametrize("bias", [False, True], ids=["fused", "any-head"])
def test_several_targets_a_row_score_and_train_as_log_softmax_gathered(head_chunking, chunking, bias):
    """targets [N, C]: logprobs [N, C] and their gradients are log_softmax's gathered, through the
    fused head and through whole logits (the column 0 alone is the one-target call's)."""
    g = torch.Generator().manual_seed(12)
    head = _head(bias=bias)
    base = 2 * torch.randn(10, 6, generator=g)
    targets = torch.randint(0, 13, (10, 4), generator=g)
    weights = torch.randn(10, 4, generator=g)
    reference = base.clone().requires_grad_(True)
    logits = head(reference)
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, targets)
    (expected * weights).sum().backward()
    ref_grads = reference.grad, head.weight.grad.clone()
    for score in (
        lambda h: head_token_scores(h, head, targets, 0.7)[0],
        lambda h: token_logprobs(head(h), targets, 0.7),
    ):
        head.weight.grad = None
        hidden = base.clone().requires_grad_(True)
        logp = score(hidden)
        assert logp.shape == (10, 4)
        (logp * weights).sum().backward()
        torch.testing.assert_close(logp, expected)
        torch.testing.assert_close(hidden.grad, ref_grads[0])
        torch.testing.assert_close(head.weight.grad, ref_grads[1])
    one = head_token_scores(base, head, targets[:, 0], 0.7)[0]
    torch.testing.assert_close(one, expected[:, 0].detach())
