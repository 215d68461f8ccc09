"""Hand-computed checks for posttrain.core.advantages (GRPO group normalisation, GDPO, RLOO leave-one-out)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.advantages import (
    combine_rewards,
    group_advantages,
    group_mean_std,
    leave_one_out_advantages,
    normalize_advantages,
    normalize_then_sum_advantages,
)

NAN = float("nan")
EPS = 1e-4


def _close(t: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), equal_nan=True)


def test_combine_rewards_weighted_nansum_and_unscorable_rows():
    """Rows [1, NaN], [NaN, NaN], [2, 3] with weights [1, 0.5]: 1·1 = 1, unscorable NaN, 2 + 1.5 = 3.5.
    Without weights: 1, NaN, 5."""
    r = torch.tensor([[1.0, NAN], [NAN, NAN], [2.0, 3.0]])
    _close(combine_rewards(r, torch.tensor([1.0, 0.5])), [1.0, NAN, 3.5])
    _close(combine_rewards(r), [1.0, NAN, 5.0])
    _close(combine_rewards(r, [1.0, 0.5]), [1.0, NAN, 3.5])  # a plain list is accepted too


def test_combine_rewards_errors():
    with pytest.raises(
        ValueError, match=r"Number of reward weights \(3\) must match number of reward functions \(2\)"
    ):
        combine_rewards(torch.zeros(4, 2), torch.ones(3))
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        combine_rewards(torch.zeros(4))


def test_group_scaling():
    """Groups [1, 2, 3] and [0, 0, 0] (G = 3). Group 1: μ = 2, σ = √((1 + 0 + 1)/2) = 1 -> A = [−1, 0, 1]/(1 + 1e-4).
    Group 2: σ = 0 -> A = 0/(0 + 1e-4) = 0. std for the metric: [1, 1, 1, 0, 0, 0]."""
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 0.0])
    adv, std = group_advantages(rewards, 3, "group")
    d = 1 + EPS
    _close(adv, [-1 / d, 0.0, 1 / d, 0.0, 0.0, 0.0])
    _close(std, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    adv_true, _ = group_advantages(rewards, 3, True)  # True is an alias of "group"
    _close(adv_true, adv.tolist())


def test_batch_scaling():
    """Same rewards, "batch": group means [2, 0]; batch mean 1, squared deviations 0, 1, 4, 1, 1, 1 = 8, Bessel
    8/5 = 1.6, σ_batch = √1.6 = 1.264911 -> A = [−1, 0, 1, 0, 0, 0]/(1.264911 + 1e-4); std = σ_batch everywhere."""
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 0.0])
    adv, std = group_advantages(rewards, 3, "batch")
    d = math.sqrt(1.6) + EPS
    _close(adv, [-1 / d, 0.0, 1 / d, 0.0, 0.0, 0.0])
    _close(std, [math.sqrt(1.6)] * 6)


def test_no_scaling():
    """ "none" (or False): A = r − μ_g = [−1, 0, 1, 0, 0, 0]; the group std is still returned for the metric."""
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 0.0])
    for mode in ("none", False):
        adv, std = group_advantages(rewards, 3, mode)
        _close(adv, [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
        _close(std, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0])


def test_group_advantages_two_generations():
    """G = 2, rewards [0, 1]: μ = 0.5, σ = √((0.25 + 0.25)/1) = 0.707107 -> A = ∓0.5/(0.707107 + 1e-4)."""
    adv, std = group_advantages(torch.tensor([0.0, 1.0]), 2)
    d = math.sqrt(0.5) + EPS
    _close(adv, [-0.5 / d, 0.5 / d])
    _close(std, [math.sqrt(0.5)] * 2)


def test_group_advantages_nan_rewards():
    """Group [1, NaN, 3]: μ = 2 over the two scored, σ = √((1 + 1)/1) = √2 -> A = [−1/(√2+ε), 0, 1/(√2+ε)] (the
    unscored row gets 0). Group [NaN, NaN, NaN]: μ, σ NaN -> A = 0, std NaN. Group [5, NaN, NaN]: one scored ->
    σ = 0, A = 0."""
    rewards = torch.tensor([1.0, NAN, 3.0, NAN, NAN, NAN, 5.0, NAN, NAN])
    adv, std = group_advantages(rewards, 3)
    d = math.sqrt(2) + EPS
    _close(adv, [-1 / d, 0.0, 1 / d, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    _close(std, [math.sqrt(2)] * 3 + [NAN] * 3 + [0.0] * 3)
    # "batch" ignores NaN too: scored values 1, 3, 5 -> mean 3, Bessel var (4 + 0 + 4)/2 = 4, σ = 2
    adv_b, std_b = group_advantages(rewards, 3, "batch")
    _close(std_b, [2.0] * 9)
    _close(adv_b, [-1 / (2 + EPS), 0.0, 1 / (2 + EPS), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])


def test_group_mean_std_single_generation_groups():
    """G = 1 (evaluation with num_generations_eval = 1): every std is 0 and every advantage 0."""
    mean, std = group_mean_std(torch.tensor([3.0, 4.0]), 1)
    _close(mean, [3.0, 4.0])
    _close(std, [0.0, 0.0])
    _close(group_advantages(torch.tensor([3.0, 4.0]), 1)[0], [0.0, 0.0])


def test_group_advantages_errors():
    with pytest.raises(ValueError, match=r"not a multiple of num_generations \(4\)"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="Invalid scale_rewards 'std'"):
        group_advantages(torch.zeros(4), 2, "std")
    with pytest.raises(ValueError, match=r"flat \(N,\)"):
        group_advantages(torch.zeros(2, 2), 2)


def test_normalize_then_sum_advantages():
    """GDPO, G = 2, two functions. f1 = [1, 0 | 1, 1], f2 = [0, 2 | 4, 0].
    Group 1: f1 μ = .5, σ = √.5 -> z1 = ±.5/(√.5 + ε); f2 μ = 1, σ = √2 -> z2 = ∓1/(√2 + ε).
    Group 2: f1 σ = 0 -> z1 = 0; f2 μ = 2, σ = √8 -> z2 = ±2/(√8 + ε).
    s = z1 + z2 = [a − b, −a + b, c, −c] with a = .5/(√.5+ε), b = 1/(√2+ε), c = 2/(√8+ε); mean(s) = 0;
    Bessel std = √((2(a−b)² + 2c²)/3); A = s/(std + ε)."""
    r = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 4.0], [1.0, 0.0]], dtype=torch.float64)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    b = 1 / (math.sqrt(2) + EPS)
    c = 2 / (math.sqrt(8) + EPS)
    s = [a - b, -a + b, c, -c]
    std = math.sqrt((2 * (a - b) ** 2 + 2 * c**2) / 3)
    _close(normalize_then_sum_advantages(r, None, 2), [x / (std + EPS) for x in s])
    # weights [0, 1] keep only f2: s = [−b, b, c, −c]
    s2 = [-b, b, c, -c]
    std2 = math.sqrt((2 * b**2 + 2 * c**2) / 3)
    _close(normalize_then_sum_advantages(r, torch.tensor([0.0, 1.0]), 2), [x / (std2 + EPS) for x in s2])


def test_normalize_then_sum_advantages_nan():
    """Row 1 unscorable (both NaN): excluded from the batch statistics, advantage 0. f1 = [1, NaN | 0, 2] ->
    z = [0 (one scored: σ = 0), NaN | −1/(√2+ε), 1/(√2+ε)]; s = [0, NaN, −z, z], batch mean of [0, −z, z] = 0,
    std = √(2 z²/2) = z -> A = [0, 0, −z/(z+ε), z/(z+ε)]."""
    r = torch.tensor([[1.0], [NAN], [0.0], [2.0]], dtype=torch.float64)
    z = 1 / (math.sqrt(2) + EPS)
    _close(normalize_then_sum_advantages(r, None, 2), [0.0, 0.0, -z / (z + EPS), z / (z + EPS)])


def test_leave_one_out():
    """[1, 2, 3]: baselines (6−1)/2 = 2.5, (6−2)/2 = 2, (6−3)/2 = 1.5 -> A = [−1.5, 0, 1.5]. G = 2, [0, 1]: A = [−1, 1]."""
    _close(leave_one_out_advantages(torch.tensor([1.0, 2.0, 3.0]), 3), [-1.5, 0.0, 1.5])
    _close(leave_one_out_advantages(torch.tensor([0.0, 1.0, 5.0, 5.0]), 2), [-1.0, 1.0, 0.0, 0.0])


def test_leave_one_out_nan():
    """[1, NaN, 3, 4]: 3 scored, sum 8 -> b = 7/2, 5/2, 4/2 -> A = [−2.5, 0 (unscored), 0.5, 2].
    [5, NaN]: a lone scored completion has no baseline -> 0, 0."""
    _close(leave_one_out_advantages(torch.tensor([1.0, NAN, 3.0, 4.0]), 4), [-2.5, 0.0, 0.5, 2.0])
    _close(leave_one_out_advantages(torch.tensor([5.0, NAN]), 2), [0.0, 0.0])


def test_normalize_advantages():
    """[−1.5, 0, 1.5]: mean 0, Bessel std √((2.25 + 2.25)/2) = 1.5 -> [−1.5, 0, 1.5]/(1.5 + 1e-4).
    NaN rows and rows outside ``mask`` are left out of the statistics and come out 0; one row -> 0."""
    d = 1.5 + EPS
    _close(normalize_advantages(torch.tensor([-1.5, 0.0, 1.5])), [-1.5 / d, 0.0, 1.5 / d])
    _close(normalize_advantages(torch.tensor([-1.5, NAN, 0.0, 1.5])), [-1.5 / d, 0.0, 0.0, 1.5 / d])
    masked = normalize_advantages(torch.tensor([-1.5, 100.0, 0.0, 1.5]), mask=torch.tensor([1, 0, 1, 1]))
    _close(masked, [-1.5 / d, 0.0, 0.0, 1.5 / d])
    _close(normalize_advantages(torch.tensor([2.0])), [0.0])
