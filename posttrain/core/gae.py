"""PPO's per-token pieces (Schulman et al. 2017; Ouyang et al. 2022's RLHF recipe, as TRL's ``PPOTrainer``), pure
tensor math over completion tokens ``(B, T)`` with a completion mask m.

* ``ppo_token_rewards``: r_t = −kl_coef · KL_t on every completion token, plus the sequence score on its last token.
* ``gae``: generalised advantage estimation (Schulman et al. 2016) — δ_t = r_t + γ V_{t+1} − V_t (V past the last
  token is 0), A_t = δ_t + γλ A_{t+1}, returns R_t = A_t + V_t; masked-out positions hold 0 and do not propagate.
* ``masked_whiten``: (x − mean) / sqrt(var + 1e-8) over masked positions (``shift_mean=False`` keeps the mean);
  with ``reduce_sum`` the moments are those of every process's positions (data-parallel PPO whitens globally).
* ``clipped_value_loss``: ½ · mean_m max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²) and its clip fraction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from posttrain.core.masking import masked_mean, masked_var

__all__ = ["clipped_value_loss", "gae", "masked_whiten", "ppo_token_rewards"]


def ppo_token_rewards(
    scores: torch.Tensor, per_token_kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``(B, T)``: −kl_coef·KL_t·m_t, with ``scores`` ``(B,)`` added at each row's last masked token.

    Returns:
        ``(rewards, non_score_reward)``, the latter −kl_coef·KL·m alone.
    """
    mask = mask.to(per_token_kl.dtype)
    non_score = -kl_coef * per_token_kl * mask
    rewards = non_score.clone()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values  # (B,)
    has_token = last >= 0
    rows = torch.nonzero(has_token).flatten()
    rewards[rows, last[rows]] += scores[rows].to(rewards.dtype)
    return rewards, non_score


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns, both ``(B, T)``.

    Args:
        rewards: ``(B, T)`` per-token rewards.
        values: ``(B, T)`` value estimates V_t of the state before token t (old values, no gradient needed).
        mask: ``(B, T)`` completion mask (right-padded: tokens then padding).
        gamma: discount γ.
        lam: GAE λ.
    """
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    width = values.shape[1]
    for t in reversed(range(width)):
        next_value = values[:, t + 1] if t + 1 < width else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Whiten ``x`` ``(B, T)`` over the masked positions (unbiased variance, as TRL); masked-out positions become 0.

    ``reduce_sum``: sums a tensor over data-parallel processes (e.g. ``distributed.sum_over_processes``); the mean
    and variance are then those of the masked positions of every process (two passes: Σm, Σxm, then Σ(x−μ)²m), so
    the result equals whitening the concatenated batch on one process. None: this tensor's positions only.
    """
    if reduce_sum is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:
        m = mask.to(x.dtype)
        count, total = reduce_sum(torch.stack([m.sum(), (x * m).sum()]))
        mean = total / count
        var = reduce_sum(((x - mean) ** 2 * m).sum()) / (count - 1)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss (scalar) and the fraction of tokens where the clipped error was the larger one."""
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    losses = torch.square(values - returns)
    losses_clipped = torch.square(clipped - returns)
    loss = 0.5 * masked_mean(torch.maximum(losses, losses_clipped), mask)
    clipfrac = masked_mean((losses_clipped > losses).float(), mask)
    return loss, clipfrac
