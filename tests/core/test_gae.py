"""core.gae (PPO): per-token rewards, GAE and returns, whitening and the clipped value loss against a hand-computed
trajectory."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.gae import clipped_value_loss, gae, masked_whiten, ppo_token_rewards


def test_token_rewards_put_the_score_on_the_last_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    rewards, non_score = ppo_token_rewards(torch.tensor([1.0, 2.0]), kl, mask, kl_coef=0.5)
    torch.testing.assert_close(non_score, torch.tensor([[-0.05, -0.1, -0.15], [-0.2, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85], [1.8, 0.0, 0.0]]))


def test_gae_on_a_hand_computed_trajectory():
    # Row 0: three tokens, γ = 0.9, λ = 0.8.  Row 1: one token then padding (its garbage values are ignored).
    rewards = torch.tensor([[0.0, 0.0, 1.0], [2.0, 5.0, 5.0]])
    values = torch.tensor([[0.5, 0.4, 0.3], [1.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    d2 = 1.0 + 0.9 * 0.0 - 0.3  # 0.7
    d1 = 0.0 + 0.9 * 0.3 - 0.4  # -0.13
    d0 = 0.0 + 0.9 * 0.4 - 0.5  # -0.14
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    torch.testing.assert_close(advantages[0], torch.tensor([a0, a1, a2]))
    torch.testing.assert_close(returns[0], torch.tensor([a0 + 0.5, a1 + 0.4, a2 + 0.3]))
    torch.testing.assert_close(advantages[1], torch.tensor([2.0 - 1.0, 0.0, 0.0]))  # V past the end is 0
    torch.testing.assert_close(returns[1], torch.tensor([2.0, 0.0, 0.0]))
    # γ = λ = 1 without a baseline: every advantage is the rest-of-sequence reward sum
    advantages, _ = gae(rewards, torch.zeros_like(values), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages[0], torch.tensor([1.0, 1.0, 1.0]))


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = masked_whiten(x, mask)
    std = torch.tensor([1.0, 2.0, 3.0]).std()  # unbiased, over the masked values 1, 2, 3
    torch.testing.assert_close(out[0, :2], torch.tensor([-1.0, 0.0]) / std, atol=1e-4, rtol=0)
    assert out[0, 2] == 0 and out[1, 1] == 0
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False)[1, 0], 2 + 1 / std, atol=1e-4, rtol=0)


def test_masked_whiten_with_reduce_sum_uses_every_process_moments():
    """Two "processes" holding rows [1, 2] and [3, 10]: each whitens with the moments of all four values."""
    x = [torch.tensor([[1.0, 2.0, 7.0]]), torch.tensor([[3.0, 10.0, 0.0]])]
    masks = [torch.tensor([[1, 1, 0]]), torch.tensor([[1, 1, 0]])]

    def reduce_sum(local, other):
        return local + other

    mean, std = 4.0, torch.tensor([1.0, 2.0, 3.0, 10.0]).std()
    for rank in (0, 1):
        other_x, other_m = x[1 - rank], masks[1 - rank].float()
        # the peer's contributions to each collective, in call order: (Σm, Σxm), then Σ(x−μ)²m
        peers = iter(
            [torch.stack([other_m.sum(), (other_x * other_m).sum()]), ((other_x - mean) ** 2 * other_m).sum()]
        )
        out = masked_whiten(x[rank], masks[rank], reduce_sum=lambda t, peers=peers: reduce_sum(t, next(peers)))
        torch.testing.assert_close(out[0, :2], (x[rank][0, :2] - mean) / std, atol=1e-5, rtol=0)
        assert out[0, 2] == 0
    # the local whitening differs (rank 0 alone: values 1, 2)
    assert not torch.allclose(masked_whiten(x[0], masks[0])[0, :2], (x[0][0, :2] - mean) / std, atol=1e-3)
    # on one process the identity reduction gives the plain result
    torch.testing.assert_close(masked_whiten(x[0], masks[0], reduce_sum=lambda t: t), masked_whiten(x[0], masks[0]))


def test_clipped_value_loss():
    values = torch.tensor([[1.0, 0.0, 9.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.0, 0.0]])
    returns = torch.tensor([[2.0, -0.1, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, clipfrac = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2)
    # token 0: unclipped (1 − 2)² = 1, clipped (0.7 − 2)² = 1.69 → 1.69 (clipped is larger);
    # token 1: (0 + 0.1)² = 0.01 both; token 2 masked
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.01) / 2)
    assert clipfrac.item() == pytest.approx(0.5)
    loss.backward()
    assert values.grad[0, 0] == 0  # the clipped branch carries no gradient to V
    assert values.grad[0, 1].item() == pytest.approx(0.5 * 2 * 0.1 / 2)
