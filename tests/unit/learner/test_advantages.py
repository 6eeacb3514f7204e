"""Advantage estimators and dynamic sampling against plain re-derivations."""

import math

import pytest

from learner.advantages import batch_advantages, filter_zero_variance, group_advantages


def _mean(xs):
    return sum(xs) / len(xs)


def _std_unbiased(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


REWARDS = [1.0, 0.0, 0.1, 1.0, 0.9]


def test_grpo_is_mean_std_normalised():
    eps = 1e-6
    expected = [(r - _mean(REWARDS)) / (_std_unbiased(REWARDS) + eps) for r in REWARDS]
    assert group_advantages(REWARDS, "grpo", eps) == pytest.approx(expected, abs=1e-12)


def test_drgrpo_subtracts_mean_only():
    expected = [r - _mean(REWARDS) for r in REWARDS]
    assert group_advantages(REWARDS, "drgrpo") == pytest.approx(expected, abs=1e-12)


def test_rloo_uses_leave_one_out_baseline():
    expected = []
    for i, r in enumerate(REWARDS):
        others = [x for j, x in enumerate(REWARDS) if j != i]
        expected.append(r - _mean(others))
    assert group_advantages(REWARDS, "rloo") == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_constant_group_and_single_sample_give_zero(estimator):
    assert group_advantages([0.7, 0.7, 0.7], estimator) == pytest.approx([0.0, 0.0, 0.0])
    assert group_advantages([1.0], estimator) == [0.0]
    assert group_advantages([], estimator) == []


def test_grpo_eps_bounds_tiny_std():
    adv = group_advantages([0.0, 1e-9], "grpo", eps=1e-6)
    assert all(abs(a) < 1e-3 for a in adv)


def test_unknown_estimator_is_rejected():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages([0.0, 1.0], "ppo")


def test_batch_advantages_per_group():
    out = batch_advantages([[0.0, 1.0], [2.0, 2.0, 5.0]], "drgrpo")
    assert out[0] == pytest.approx([-0.5, 0.5])
    assert out[1] == pytest.approx([-1.0, -1.0, 2.0])


def test_dynamic_sampling_drops_and_counts_zero_variance_groups():
    groups = [("a", [1.0, 1.0]), ("b", [0.0, 1.0]), ("c", [0.0, 0.0, 0.0]), ("d", [0.5]), ("e", [0.2, 0.3])]
    kept, dropped = filter_zero_variance(groups, lambda g: g[1])
    assert [g[0] for g in kept] == ["b", "e"]
    assert dropped == 3
