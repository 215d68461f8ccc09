"""GMPO's objective (core.policy_objectives.gmpo_objective) against hand-computed numbers."""

from __future__ import annotations

import math

import torch

from posttrain.core.aggregation import AGGREGATIONS, seq_mean_token_mean
from posttrain.core.policy_objectives import POLICY_OBJECTIVES, gmpo_objective, objective_properties


def _rollout():
    old = torch.zeros(3, 3)
    log_ratio = torch.tensor([[0.5, -0.1, 9.0], [-0.6, 0.1, 0.0], [-0.6, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    advantages = torch.tensor([1.0, -1.0, 2.0])
    return (old + log_ratio).requires_grad_(True), old, advantages, mask


def test_geometric_mean_of_sign_clipped_log_ratios():
    logp, old, advantages, mask = _rollout()
    loss, stats = gmpo_objective(logp, old, advantages, mask, epsilon_low=0.4, epsilon_high=0.4)
    # row 0 (A > 0): 0.5 -> 0.4, -0.1 kept, masked 9.0 ignored: mean 0.15.  row 1 (A < 0): -0.6 -> -0.4, 0.1, 0.0:
    # mean -0.1.  row 2 (A > 0): -0.6 is below the range but A > 0 only clips from above: mean -0.6.
    expected = torch.tensor([[-math.exp(0.15)], [math.exp(-0.1)], [-2 * math.exp(-0.6)]])
    torch.testing.assert_close(loss, expected)
    assert stats["is_high_clipped"].tolist() == [[1, 0, 1], [0, 0, 0], [0, 1, 1]]
    assert stats["is_low_clipped"].tolist() == [[0, 0, 0], [1, 0, 0], [0, 0, 0]]
    # The clipped token gets no gradient; the others d/dℓ_t = −A·coef/|o|.
    loss.sum().backward()
    grad = logp.grad
    assert grad[0, 0] == 0 and grad[1, 0] == 0 and grad[0, 2] == 0
    torch.testing.assert_close(grad[0, 1], torch.tensor(-math.exp(0.15) / 2))
    torch.testing.assert_close(grad[1, 1], torch.tensor(math.exp(-0.1) / 3))
    torch.testing.assert_close(grad[2, 0], torch.tensor(-2 * math.exp(-0.6)))


def test_asymmetric_range_and_its_aggregation():
    """The objective and the per-sequence mean of the ``gmpo`` preset (which ``experimental.gmpo`` registers)."""
    logp, old, advantages, mask = _rollout()
    loss, _ = gmpo_objective(logp, old, advantages, mask, epsilon_low=0.4, epsilon_high=0.2)
    torch.testing.assert_close(loss[0], torch.tensor([-math.exp((0.2 - 0.1) / 2)]))
    objective, aggregation = POLICY_OBJECTIVES.get("gmpo"), AGGREGATIONS.get("seq_mean_token_mean")
    assert objective is gmpo_objective
    assert dict(objective_properties(objective).config_fields) == {"epsilon_low": "epsilon", "epsilon_high": "epsilon_high"}
    # The per-sequence mean of a (B, 1) loss is the plain mean over sequences; a (B, T) KL added to it is averaged
    # over each sequence's tokens (TRL's GMPO).
    per_seq, _ = objective(logp.detach(), old, advantages, mask, epsilon_low=0.4, epsilon_high=0.4)
    kl = torch.tensor([[1.0, 3.0, 100.0], [0.0, 0.0, 3.0], [2.0, 50.0, 50.0]])
    total = aggregation(per_seq + 0.1 * kl, mask)
    expected = (per_seq.squeeze(1) + 0.1 * torch.tensor([2.0, 1.0, 2.0])).mean()
    torch.testing.assert_close(total, expected)
    assert seq_mean_token_mean(per_seq, mask) == per_seq.mean()
