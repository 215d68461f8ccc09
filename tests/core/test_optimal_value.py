"""core.optimal_value (A*-PO) against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.optimal_value import optimal_advantage_regression_loss, optimal_value


def test_optimal_value_is_a_soft_maximum():
    rewards = torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    v = optimal_value(rewards, 0.5)
    # β₁ log((e^0 + e^2)/2) = 0.5 · log((1 + e²)/2); equal rewards give that reward
    torch.testing.assert_close(v, torch.tensor([0.5 * math.log((1 + math.e**2) / 2), 1.0, 0.0]))
    assert optimal_value(torch.tensor([[0.0, 1.0]]), 1e-3).item() == pytest.approx(1.0 - 1e-3 * math.log(2), abs=1e-6)
    with pytest.raises(ValueError):
        optimal_value(rewards, 0.0)


def test_regression_loss():
    logps = torch.tensor([-3.0, -5.0], requires_grad=True)
    ref = torch.tensor([-4.0, -5.5])
    adv = torch.tensor([0.2, -0.1])
    loss, implicit = optimal_advantage_regression_loss(logps, ref, adv, 0.1)
    torch.testing.assert_close(implicit, torch.tensor([0.1, 0.05]), atol=1e-6, rtol=0)
    assert loss.item() == pytest.approx(((0.1 - 0.2) ** 2 + (0.05 + 0.1) ** 2) / 2)
    loss.backward()  # d/dlogp_i = 2 β₂ (implicit_i − A_i) / B
    torch.testing.assert_close(logps.grad, torch.tensor([0.1 * (0.1 - 0.2), 0.1 * (0.05 + 0.1)]))
