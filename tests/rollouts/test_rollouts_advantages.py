"""GRPO / Dr. GRPO advantages and DAPO overlong shaping against hand-computed numbers."""

import math
import re

import pytest

from toolgym.rollouts.scoring.advantages import (
    AdvantageConfig,
    AdvantageEstimator,
    OverlongShaping,
    batch_advantages,
    group_advantages,
    is_zero_variance,
    overlong_penalty,
    shaped_rewards,
)


def test_grpo_uses_sample_std():
    # mean 0.5, deviations +-0.5, sample variance 4*0.25/3 = 1/3 -> std 0.57735
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], AdvantageEstimator.GRPO, eps=0.0)
    assert adv == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], abs=1e-7)
    # mean 1, deviations [1, -1, 0], sample variance 2/2 = 1
    adv = group_advantages([2.0, 0.0, 1.0], AdvantageEstimator.GRPO, eps=0.0)
    assert adv == pytest.approx([1.0, -1.0, 0.0])


def test_grpo_eps_in_denominator():
    adv = group_advantages([2.0, 0.0, 1.0], AdvantageEstimator.GRPO, eps=0.5)
    assert adv == pytest.approx([1 / 1.5, -1 / 1.5, 0.0])


def test_dr_grpo_is_mean_centred_only():
    assert group_advantages([1.0, 0.0, 0.0, 1.0], AdvantageEstimator.DR_GRPO) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([3.0, 0.0, 0.0], AdvantageEstimator.DR_GRPO) == pytest.approx([2.0, -1.0, -1.0])


@pytest.mark.parametrize("estimator", list(AdvantageEstimator))
def test_degenerate_groups_give_zero(estimator):
    assert group_advantages([0.7, 0.7, 0.7], estimator) == [0.0, 0.0, 0.0]
    assert group_advantages([5.0], estimator) == [0.0]
    assert group_advantages([], estimator) == []


def test_overlong_penalty_matches_dapo():
    shaping = OverlongShaping(max_length=20, cache_length=5)
    assert overlong_penalty(0, shaping) == 0.0
    assert overlong_penalty(15, shaping) == 0.0  # L_max - L_cache: still free
    assert overlong_penalty(16, shaping) == pytest.approx(-0.2)
    assert overlong_penalty(18, shaping) == pytest.approx(-0.6)
    assert overlong_penalty(20, shaping) == pytest.approx(-1.0)
    assert overlong_penalty(21, shaping) == -1.0
    assert overlong_penalty(10_000, shaping) == -1.0
    with pytest.raises(ValueError, match="cache_length"):
        OverlongShaping(max_length=4, cache_length=5)


def test_batch_advantages_groups_interleaved_ids():
    config = AdvantageConfig(estimator=AdvantageEstimator.DR_GRPO)
    # group 7: [1, 0] -> [0.5, -0.5]; group 3: [0, 0, 3] -> [-1, -1, 2]
    adv = batch_advantages([1.0, 0.0, 0.0, 0.0, 3.0], [7, 3, 7, 3, 3], config)
    assert adv == pytest.approx([0.5, -1.0, -0.5, -1.0, 2.0])


def test_batch_advantages_with_overlong_shaping():
    config = AdvantageConfig(
        estimator=AdvantageEstimator.DR_GRPO, overlong=OverlongShaping(max_length=20, cache_length=5)
    )
    # shaped rewards: 1 + 0, 1 - 0.6, 0 - 1 -> mean 0.1333..
    adv = batch_advantages([1.0, 1.0, 0.0], [0, 0, 0], config, sampled_lengths=[10, 18, 25])
    shaped = [1.0, 0.4, -1.0]
    mean = sum(shaped) / 3
    assert adv == pytest.approx([s - mean for s in shaped])
    with pytest.raises(ValueError, match="sampled_lengths"):
        batch_advantages([1.0], [0], config)


def test_grpo_advantages_have_unit_sample_std():
    adv = group_advantages([0.0, 0.3, 1.0, 0.9, 0.2], AdvantageEstimator.GRPO, eps=0.0)
    mean = sum(adv) / len(adv)
    std = math.sqrt(sum((a - mean) ** 2 for a in adv) / (len(adv) - 1))
    assert mean == pytest.approx(0.0, abs=1e-12)
    assert std == pytest.approx(1.0)


def test_zero_variance():
    assert is_zero_variance([1.0, 1.0])
    assert not is_zero_variance([1.0, 0.0])
    assert is_zero_variance([])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_reward_is_an_error_that_names_it(bad):
    rewards = [1.0, 0.0, bad, 0.0]
    message = f"rewards must be finite numbers, got {bad!r} at index 2 of 4"
    for estimator in AdvantageEstimator:
        with pytest.raises(ValueError, match=re.escape(message)):
            group_advantages(rewards, estimator)
    with pytest.raises(ValueError, match=re.escape(message)):
        batch_advantages(rewards, [0, 0, 1, 1], AdvantageConfig())
    with pytest.raises(ValueError, match=re.escape(message)):
        shaped_rewards(rewards, [1, 1, 1, 1], AdvantageConfig(overlong=OverlongShaping(8, 4)))
    with pytest.raises(ValueError, match="got nan at index 1 of 2"):
        is_zero_variance([1.0, math.nan])  # [nan, nan] would otherwise count as having signal
