"""Losses against hand-computed values; masking, ratio-1, clip thresholds, micro-batching."""

import math

import msgspec
import pytest
import torch

from toolgym.trainers.losses import (
    LossConfig,
    LossNormaliser,
    TopKForwardKL,
    aggregate,
    combine_metrics,
    finish_metrics,
    policy_loss,
)

torch.set_default_dtype(torch.float32)


def _leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def _run(config, logp, sampler, adv, mask, **kw):
    logp = _leaf(logp)
    loss, metrics = policy_loss(
        config,
        logp,
        torch.tensor(sampler, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        torch.tensor(mask),
        **kw,
    )
    loss.backward()
    return loss.item(), logp.grad, metrics


# One sequence, log-ratios log(1.1), log(1.3), log(0.7), advantages +1, +1, -1.
LOGP = [[math.log(1.1) - 1.0, math.log(1.3) - 2.0, math.log(0.7) - 0.5]]
SAMPLER = [[-1.0, -2.0, -0.5]]
ADV = [[1.0, 1.0, -1.0]]
MASK = [[1, 1, 1]]


def test_config_defaults_and_validation():
    assert (LossConfig(name="grpo").eps_low, LossConfig(name="grpo").eps_high) == (0.2, 0.2)
    dapo = LossConfig(name="dapo")
    assert (dapo.eps_low, dapo.eps_high, dapo.aggregation) == (0.2, 0.28, "token-mean")
    assert LossConfig(name="gspo").eps_high == 4e-4
    assert LossConfig(name="grpo").aggregation == "seq-mean-token-mean"
    assert msgspec.convert({"name": "dapo", "eps_high": 0.3}, LossConfig).eps_high == 0.3
    with pytest.raises(ValueError, match="name"):
        LossConfig(name="ppo")
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="constant_normaliser"):
        LossConfig(aggregation="seq-mean-token-sum-norm")
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"name": "grpo", "epsilon": 0.1}, LossConfig)


def test_grpo_hand_computed():
    loss, grad, m = _run(LossConfig(name="grpo"), LOGP, SAMPLER, ADV, MASK)
    # token losses: -1.1 (inside), -1.2 (clipped high), +0.8 (clipped low, A<0); seq-mean-token-mean
    assert loss == pytest.approx((-1.1 - 1.2 + 0.8) / 3)
    torch.testing.assert_close(grad, torch.tensor([[-1.1 / 3, 0.0, 0.0]], dtype=torch.float64))
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert m["ratio_max"].item() == pytest.approx(1.3)
    assert m["ratio_min"].item() == pytest.approx(0.7)
    assert m["ratio_mean"].item() == pytest.approx((1.1 + 1.3 + 0.7) / 3)
    assert m["num_tokens"].item() == 3


def test_dapo_clip_higher_hand_computed():
    loss, grad, _m = _run(LossConfig(name="dapo"), LOGP, SAMPLER, ADV, MASK)
    assert loss == pytest.approx((-1.1 - 1.28 + 0.8) / 3)
    torch.testing.assert_close(grad, torch.tensor([[-1.1 / 3, 0.0, 0.0]], dtype=torch.float64))
    # ratio 1.25 is clipped by GRPO's 0.2 but not by DAPO's 0.28
    logp = [[math.log(1.25)]]
    _, g_dapo, _ = _run(LossConfig(name="dapo"), logp, [[0.0]], [[1.0]], [[1]])
    _, g_grpo, _ = _run(LossConfig(name="grpo"), logp, [[0.0]], [[1.0]], [[1]])
    assert g_dapo.item() == pytest.approx(-1.25) and g_grpo.item() == 0.0


def test_dual_clip_bounds_negative_advantage():
    # ratio 5, A = -1: PPO loss 5, dual-clip c=3 bounds it at 3 with zero gradient
    loss, grad, m = _run(LossConfig(name="grpo", dual_clip=3.0), [[math.log(5.0)]], [[0.0]], [[-1.0]], [[1]])
    assert loss == pytest.approx(3.0) and grad.item() == 0.0 and m["dual_clip_frac"].item() == 1.0
    loss, grad, _ = _run(LossConfig(name="grpo"), [[math.log(5.0)]], [[0.0]], [[-1.0]], [[1]])
    assert loss == pytest.approx(5.0) and grad.item() == pytest.approx(5.0)
    # ratio 2 < c: the dual clip leaves it alone
    loss, _, _ = _run(LossConfig(name="grpo", dual_clip=3.0), [[math.log(2.0)]], [[0.0]], [[-1.0]], [[1]])
    assert loss == pytest.approx(2.0)


def test_reinforce_hand_computed():
    logp, adv = [[-1.0, -2.0, -3.0]], [[2.0, -1.0, 5.0]]
    loss, grad, _ = _run(LossConfig(name="reinforce"), logp, [[0.0] * 3], adv, [[1, 1, 0]])
    assert loss == pytest.approx(-(2.0 * -1.0 + -1.0 * -2.0) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.5, 0.0]], dtype=torch.float64))


def test_gspo_sequence_ratio_hand_computed():
    # seq 0: log-ratios 0.1, 0.3 (mean 0.2); seq 1: one token, log-ratio -0.0001 (ratio inside clip)
    logp = [[0.1, 0.3], [-0.0001, 9.0]]
    config = LossConfig(name="gspo", eps_low=0.5, eps_high=0.5)
    loss, grad, m = _run(config, logp, [[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [2.0, 0.0]], [[1, 1], [1, 0]])
    s0, s1 = math.exp(0.2), math.exp(-0.0001)
    assert loss == pytest.approx((-s0 + -2 * s1) / 2)
    torch.testing.assert_close(
        grad, torch.tensor([[-s0 / 4, -s0 / 4], [-2 * s1 / 2, 0.0]], dtype=torch.float64)
    )
    # the default (paper) range clips seq 0 (ratio 1.22 > 1 + 4e-4) and not seq 1
    loss, grad, m = _run(
        LossConfig(name="gspo"), logp, [[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [2.0, 0.0]], [[1, 1], [1, 0]]
    )
    assert grad[0].abs().sum().item() == 0.0 and grad[1, 0].item() != 0.0
    assert m["clip_frac_high"].item() == pytest.approx(2 / 3)


def test_aggregation_modes_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    norm = LossNormaliser.from_mask(mask)
    assert norm == LossNormaliser(4.0, 2.0)
    assert aggregate(values, mask, "token-mean", norm).item() == pytest.approx(10 / 4)
    assert aggregate(values, mask, "seq-mean-token-mean", norm).item() == pytest.approx((2 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum", norm).item() == pytest.approx((6 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum-norm", norm, 8.0).item() == pytest.approx(10 / (2 * 8))
    # a sequence with no valid tokens does not count as a sequence
    mask0 = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert LossNormaliser.from_mask(mask0).num_sequences == 1.0


def test_kl_and_entropy_terms():
    logp, ref = [[-1.0, -2.0]], [[-1.5, -1.0]]
    base = LossConfig(name="reinforce")
    loss0, _, _ = _run(base, logp, [[0.0, 0.0]], [[0.0, 0.0]], [[1, 1]])
    assert loss0 == 0.0
    loss, _, m = _run(
        LossConfig(name="reinforce", kl_coef=0.1, kl_estimator="k1"),
        logp,
        [[0.0, 0.0]],
        [[0.0, 0.0]],
        [[1, 1]],
        ref_logprobs=torch.tensor(ref, dtype=torch.float64),
    )
    assert loss == pytest.approx(0.1 * ((0.5) + (-1.0)) / 2)
    loss, _grad, m = _run(
        LossConfig(name="reinforce", kl_coef=0.1),
        logp,
        [[0.0, 0.0]],
        [[0.0, 0.0]],
        [[1, 1]],
        ref_logprobs=torch.tensor(ref, dtype=torch.float64),
    )
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 1.0)]
    assert loss == pytest.approx(0.1 * sum(k3) / 2)
    assert m["kl_ref"].item() == pytest.approx(sum(k3) / 2)
    ent = torch.tensor([[1.0, 3.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        LossConfig(name="reinforce", entropy_coef=0.01),
        torch.tensor(logp, dtype=torch.float64),
        torch.zeros(1, 2, dtype=torch.float64),
        torch.zeros(1, 2, dtype=torch.float64),
        torch.tensor([[1, 1]]),
        entropy=ent,
    )
    assert loss.item() == pytest.approx(-0.01 * 2.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        _run(LossConfig(kl_coef=0.1), logp, [[0.0, 0.0]], [[0.0, 0.0]], [[1, 1]])


def test_top_k_forward_kl_hand_computed():
    """weight x sum_j p_T(j) (log p_T(j) - log p_S(j)) on each sampled token, p_T not renormalised;
    a missing top-k entry (-inf) and an unsampled token add nothing; student = teacher gives 0."""
    teacher = [[[math.log(0.5), math.log(0.3)], [math.log(0.6), -math.inf], [math.log(0.9), math.log(0.1)]]]
    student = [[[math.log(0.25), math.log(0.5)], [math.log(0.2), 0.0], [math.log(0.1), math.log(0.1)]]]
    top = torch.tensor(student, dtype=torch.float64, requires_grad=True)
    term = TopKForwardKL(0.5, top, torch.tensor(teacher, dtype=torch.float64))
    loss, _, m = _run(
        LossConfig(name="reinforce"), [[-1.0, -2.0, -3.0]], [[0.0] * 3], [[0.0] * 3], [[1, 1, 0]],
        extra_terms=[term],
    )  # fmt: skip
    first = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.5)
    second = 0.6 * math.log(0.6 / 0.2)
    assert loss == pytest.approx(0.5 * (first + second) / 2)  # reinforce: the token mean
    assert m["forward_kl_topk"].item() == pytest.approx((first + second) / 2)
    assert m["teacher_topk_mass"].item() == pytest.approx((0.8 + 0.6) / 2)
    # d loss / d log p_S(j) = -weight x p_T(j) / tokens; nothing where no teacher entry or no sample
    expected = [[[-0.5 * 0.5 / 2, -0.5 * 0.3 / 2], [-0.5 * 0.6 / 2, 0.0], [0.0, 0.0]]]
    assert top.grad is not None and torch.allclose(top.grad, torch.tensor(expected, dtype=torch.float64))
    same = TopKForwardKL(
        0.5, torch.tensor(teacher, dtype=torch.float64), torch.tensor(teacher, dtype=torch.float64)
    )
    loss, _, m = _run(
        LossConfig(name="reinforce"), [[-1.0, -2.0, -3.0]], [[0.0] * 3], [[0.0] * 3], [[1, 1, 1]],
        extra_terms=[same],
    )  # fmt: skip
    assert loss == 0.0 and m["forward_kl_topk"].item() == 0.0


def test_truncated_importance_sampling_weights():
    # trainer logp - sampler logp = log 2 and log 10; cap 3 -> weights 2 and 3
    logp = [[math.log(2.0), math.log(10.0)]]
    loss, grad, m = _run(LossConfig(name="grpo", tis_cap=3.0), logp, [[0.0, 0.0]], [[1.0, 1.0]], [[1, 1]])
    # ratio is 1 (old = trainer's own logprob): loss = -(2 + 3) / 2 (one sequence, token mean)
    assert loss == pytest.approx(-2.5)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -1.5]], dtype=torch.float64))
    assert m["tis_truncated_frac"].item() == 0.5
    assert m["tis_weight_mean"].item() == pytest.approx(2.5)


def test_sampler_metrics():
    logp, sampler = [[-1.0, -2.0, 7.0]], [[-1.5, -1.0, 0.0]]
    _, _, m = _run(LossConfig(name="grpo"), logp, sampler, [[1.0, -3.0, 9.0]], [[1, 1, 0]])
    gaps = [0.5, -1.0]
    assert m["sampler_kl_k1"].item() == pytest.approx(-sum(gaps) / 2)
    assert m["sampler_kl_k3"].item() == pytest.approx(sum(math.exp(g) - g - 1 for g in gaps) / 2)
    assert m["logprob_gap_max"].item() == pytest.approx(1.0)
    assert m["advantage_mean"].item() == pytest.approx(-1.0)
    assert m["advantage_std"].item() == pytest.approx(2.0)


def _random_batch(seed, b=4, t=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) > 0.35
    mask[:, 0] = True
    sampler = -torch.rand(b, t, generator=g) * 3
    logp = sampler + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    return logp, sampler, adv, mask


ALL_CONFIGS = [
    LossConfig(name="reinforce"),
    LossConfig(name="grpo"),
    LossConfig(name="grpo", dual_clip=1.5, aggregation="seq-mean-token-sum"),
    LossConfig(name="dapo"),
    LossConfig(name="dapo", tis_cap=2.0, kl_coef=0.05),
    LossConfig(name="gspo", eps_low=0.1, eps_high=0.1),
    LossConfig(name="grpo", aggregation="seq-mean-token-sum-norm", constant_normaliser=16.0),
    LossConfig(name="cispo"),
    LossConfig(name="cispo", tis_cap=2.0, seq_mask="sequence"),
    LossConfig(name="grpo", seq_mask="geometric", seq_mask_low=0.9, seq_mask_high=1.1),
]


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: f"{c.name}-{c.aggregation}")
def test_masked_tokens_have_no_effect(config):
    logp, sampler, adv, mask = _random_batch(0)
    ref = sampler - 0.1

    def run(lp, sp, ad, rf):
        lp = lp.clone().requires_grad_(True)
        loss, m = policy_loss(config, lp, sp, ad, mask, ref_logprobs=rf)
        loss.backward()
        return loss, lp.grad, m

    loss_a, grad_a, m_a = run(logp, sampler, adv, ref)
    noise = torch.where(mask, 0.0, 1.0)
    poisoned = torch.where(mask, logp, torch.tensor(float("nan")))
    loss_b, grad_b, m_b = run(
        poisoned, sampler + 5 * noise, adv - 50 * noise, torch.where(mask, ref, torch.tensor(float("inf")))
    )
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(grad_a, grad_b)
    assert torch.all(grad_a[~mask] == 0)
    for key in m_a:
        assert torch.equal(m_a[key], m_b[key]), key


@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_ratio_one_reduces_to_policy_gradient(name):
    logp, _, adv, mask = _random_batch(1)
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        grads = []
        for loss_name in (name, "reinforce"):
            lp = logp.clone().requires_grad_(True)
            config = LossConfig(name=loss_name, aggregation=aggregation)
            loss, m = policy_loss(config, lp, logp.detach(), adv, mask)  # sampler == trainer: ratio 1
            loss.backward()
            grads.append(lp.grad)
            if loss_name == name:
                assert m["ratio_min"].item() == m["ratio_max"].item() == 1.0
                assert m["clip_frac_low"].item() == m["clip_frac_high"].item() == 0.0
        torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-7)


@pytest.mark.parametrize("name,eps_low,eps_high", [("grpo", 0.2, 0.2), ("dapo", 0.2, 0.28)])
def test_clipping_engages_exactly_beyond_thresholds(name, eps_low, eps_high):
    config = LossConfig(name=name)
    delta = 1e-6
    cases = [
        (1 + eps_high - delta, 1.0, True),
        (1 + eps_high + delta, 1.0, False),
        (1 - eps_low + delta, -1.0, True),
        (1 - eps_low - delta, -1.0, False),
        # clipping never zeroes the gradient on the side that makes the update smaller
        (1 + eps_high + 0.5, -1.0, True),
        (1 - eps_low - 0.5, 1.0, True),
    ]
    for ratio, adv, has_grad in cases:
        _, grad, _ = _run(config, [[math.log(ratio)]], [[0.0]], [[adv]], [[1]])
        assert (grad.item() != 0.0) == has_grad, (ratio, adv)
        if has_grad:
            assert grad.item() == pytest.approx(-adv * ratio)


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: f"{c.name}-{c.aggregation}")
def test_micro_batched_accumulation_equals_full_batch(config):
    logp, sampler, adv, mask = _random_batch(2, b=6, t=9)
    ref = sampler - 0.2
    full = logp.clone().requires_grad_(True)
    loss_full, m_full = policy_loss(config, full, sampler, adv, mask, ref_logprobs=ref)
    loss_full.backward()

    norm = LossNormaliser.from_mask(mask)
    micro = logp.clone().requires_grad_(True)
    total, parts = 0.0, []
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        loss, m = policy_loss(
            config, micro[rows], sampler[rows], adv[rows], mask[rows], normaliser=norm, ref_logprobs=ref[rows]
        )
        loss.backward()
        total += loss.item()
        parts.append({k: v.item() for k, v in m.items()})
    assert total == pytest.approx(loss_full.item(), abs=1e-6)
    torch.testing.assert_close(micro.grad, full.grad, rtol=0, atol=1e-7)
    combined = combine_metrics(parts)
    for key, value in m_full.items():
        assert combined[key] == pytest.approx(value.item(), abs=1e-5), key


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(LossConfig(), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_cispo_hand_computed():
    # ratios 1.1, 1.3, 0.7 with A = +1, +1, -1; weights clip(ratio, 0, 1.28) = 1.1, 1.28, 0.7
    loss, grad, m = _run(LossConfig(name="cispo"), LOGP, SAMPLER, ADV, MASK)
    l0, l1, l2 = LOGP[0]
    assert loss == pytest.approx((-1.1 * l0 - 1.28 * l1 + 0.7 * l2) / 3)
    # the weight is a stop-gradient: d/dlogp = -w * A / 3 on every token, none zeroed by the clip
    torch.testing.assert_close(grad, torch.tensor([[-1.1 / 3, -1.28 / 3, 0.7 / 3]], dtype=torch.float64))
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_low"].item() == 0.0
    # a lower bound when asked: eps_low 0.2 lifts the 0.7 weight to 0.8
    _, grad, m = _run(LossConfig(name="cispo", eps_low=0.2), LOGP, SAMPLER, ADV, MASK)
    assert grad[0, 2].item() == pytest.approx(0.8 / 3)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 3)
    config = LossConfig(name="cispo")
    assert (config.eps_low, config.eps_high, config.aggregation) == (1.0, 0.28, "token-mean")
    with pytest.raises(ValueError, match="eps_low"):
        LossConfig(name="grpo", eps_low=1.0)


# seq 0: log-ratios 0.1, 0.3 (product e^0.4 = 1.49, geometric mean e^0.2 = 1.22); seq 1: one token,
# log-ratio -0.0001
SEQ_LOGP = [[0.1, 0.3], [-0.0001, 9.0]]
SEQ_ARGS = ([[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [2.0, 0.0]], [[1, 1], [1, 0]])


def test_sequence_mask_hand_computed():
    # the product bounds [0.5, 2.0] keep both sequences: plain REINFORCE, token mean over 3 tokens
    loss, grad, m = _run(LossConfig(name="reinforce", seq_mask="sequence"), SEQ_LOGP, *SEQ_ARGS)
    assert loss == pytest.approx(-(0.1 + 0.3 + 2 * -0.0001) / 3)
    assert m["seq_masked_sum"].item() == 0.0
    assert m["seq_ratio_max"].item() == pytest.approx(math.exp(0.4))
    # high 1.4 rejects seq 0 (1.49): no gradient there; the normaliser still counts its 2 tokens
    config = LossConfig(name="reinforce", seq_mask="sequence", seq_mask_high=1.4)
    loss, grad, m = _run(config, SEQ_LOGP, *SEQ_ARGS)
    assert loss == pytest.approx(-(2 * -0.0001) / 3)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [-2 / 3, 0.0]], dtype=torch.float64))
    assert m["seq_masked_sum"].item() == 1.0
    assert finish_metrics({k: v.item() for k, v in m.items()})["seq_masked_frac"] == 0.5


def test_geometric_sequence_mask_hand_computed():
    config = LossConfig(name="reinforce", seq_mask="geometric")
    assert (config.seq_mask_low, config.seq_mask_high) == (0.99, 1.01)
    _, grad, m = _run(config, SEQ_LOGP, *SEQ_ARGS)  # e^0.2 = 1.22 > 1.01: seq 0 rejected
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [-2 / 3, 0.0]], dtype=torch.float64))
    assert m["seq_ratio_max"].item() == pytest.approx(math.exp(0.2))
    assert m["seq_ratio_min"].item() == pytest.approx(math.exp(-0.0001))
    # the geometric mean does not grow with length: bounds [0.8, 1.25] keep e^0.2 = 1.22
    config = LossConfig(name="reinforce", seq_mask="geometric", seq_mask_low=0.8, seq_mask_high=1.25)
    _, _, m = _run(config, SEQ_LOGP, *SEQ_ARGS)
    assert m["seq_masked_sum"].item() == 0.0
    # and the low bound rejects from below: seq 1's e^-0.0001 < 0.99999
    config = LossConfig(name="reinforce", seq_mask="geometric", seq_mask_low=0.99999, seq_mask_high=1.25)
    _, grad, m = _run(config, SEQ_LOGP, *SEQ_ARGS)
    assert m["seq_masked_sum"].item() == 1.0 and grad[1, 0].item() == 0.0
    with pytest.raises(ValueError, match="seq_mask_low"):
        LossConfig(seq_mask="sequence", seq_mask_high=0.9)
    with pytest.raises(ValueError, match="seq_mask"):
        LossConfig(seq_mask="token")


def test_logprob_gap_by_staleness_hand_computed():
    # gaps (trainer - sampler) 0.5, -1.0, 0.25 at staleness 0, 1, 5; the 4th token is masked
    logp, sampler = [[-1.0, -2.0, -0.75, 3.0]], [[-1.5, -1.0, -1.0, 0.0]]
    staleness = torch.tensor([[0, 1, 5, 1]])
    _, _, m = _run(LossConfig(name="grpo"), logp, sampler, [[1.0] * 4], [[1, 1, 1, 0]], staleness=staleness)
    assert m["logprob_gap_mean"].item() == pytest.approx((0.5 + 1.0 + 0.25) / 3)
    done = finish_metrics(combine_metrics([{k: v.item() for k, v in m.items()}]))
    assert done["logprob_gap_mean_s0"] == pytest.approx(0.5)
    assert done["logprob_gap_mean_s1"] == pytest.approx(1.0)
    assert done["logprob_gap_mean_s2"] == 0.0  # an empty bucket
    assert done["logprob_gap_mean_s3plus"] == pytest.approx(0.25)  # staleness 5 falls in 3+
    counts = [done[f"staleness_tokens_{b}_sum"] for b in ("s0", "s1", "s2", "s3plus")]
    assert counts == [1.0, 1.0, 0.0, 1.0]
    # over micro-batches: token-weighted within each bucket (s1: gaps 1.0 and 0.5, 0.5, 0.5)
    _, _, other = _run(
        LossConfig(name="grpo"), [[0.5] * 3], [[0.0] * 3], [[1.0] * 3], [[1, 1, 1]],
        staleness=torch.tensor([[1, 1, 1]]),
    )  # fmt: skip
    parts = [{k: v.item() for k, v in x.items()} for x in (m, other)]
    done = finish_metrics(combine_metrics(parts))
    assert done["logprob_gap_mean_s1"] == pytest.approx((1.0 + 1.5) / 4)
    assert done["staleness_tokens_s1_sum"] == 4.0
