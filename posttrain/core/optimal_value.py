"""A*-PO's value estimate and regression loss (Brantley et al. 2025, "Accelerating RL for LLM Reasoning with Optimal
Advantage Regression", arXiv 2505.20686), as pure tensor math.

* ``optimal_value``: V*(x) = β₁ · log( (1/N) Σ_i exp(r_i / β₁) ), from N reference samples of prompt x — the
  KL-regularised optimal value under π_ref with temperature β₁ (a soft maximum of the rewards: β₁ → 0 gives max_i r_i,
  β₁ → ∞ the mean).
* ``optimal_advantage_regression_loss``: mean_i ( β₂ · (log π(y_i|x_i) − log π_ref(y_i|x_i)) − (r_i − V*(x_i)) )²,
  one on-policy sample per prompt; the implicit reward β₂ log π/π_ref regresses onto the optimal advantage.
"""

from __future__ import annotations

import math

import torch

__all__ = ["optimal_advantage_regression_loss", "optimal_value"]


def optimal_value(rewards: torch.Tensor, beta1: float) -> torch.Tensor:
    """V* per prompt from ``rewards`` ``(P, N)`` (N reference samples each), computed stably with logsumexp.

    Returns:
        ``(P,)``.
    """
    if beta1 <= 0:
        raise ValueError(f"beta1 must be > 0, got {beta1}.")
    n = rewards.shape[-1]
    return beta1 * (torch.logsumexp(rewards / beta1, dim=-1) - math.log(n))


def optimal_advantage_regression_loss(
    logps: torch.Tensor, ref_logps: torch.Tensor, advantages: torch.Tensor, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The A*-PO loss over a batch of ``(B,)`` summed completion log-probs and optimal advantages r − V*.

    Returns:
        ``(loss scalar, implicit_reward (B,))``.
    """
    implicit_reward = beta2 * (logps - ref_logps)
    return ((implicit_reward - advantages.to(implicit_reward.dtype)) ** 2).mean(), implicit_reward
