"""Advantage estimators for group-sampled online RL (GRPO, GDPO, RLOO).

Rewards are flat ``(N,)`` tensors with ``N = num_prompts × G``; the G completions of a prompt are contiguous (rows
``[g·G, (g+1)·G)``), which is how the repeat sampler lays them out and how rewards are gathered across processes.

A NaN reward means "not scored" (every reward function returned ``None`` for that completion). It is excluded from
group means and standard deviations, and its advantage is 0, so it contributes no gradient.

Conventions shared by every estimator here (they follow TRL):

* standard deviations are Bessel-corrected (n − 1);
* ε = 1e-4 is *added* to the std, never used as a floor;
* a group with exactly one scored completion has std 0 (its advantage is 0 anyway: r − μ = 0); a group with none has
  mean and std NaN (and advantages 0).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "combine_rewards",
    "group_advantages",
    "group_mean_std",
    "leave_one_out_advantages",
    "normalize_advantages",
    "normalize_then_sum_advantages",
]

ScaleRewards = Literal["group", "batch", "none"]


def _check_groups(rewards: torch.Tensor, num_generations: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a flat (N,) tensor, got shape {tuple(rewards.shape)}.")
    if not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be a positive int, got {num_generations!r}.")
    if rewards.numel() % num_generations != 0:
        raise ValueError(
            f"The number of rewards ({rewards.numel()}) is not a multiple of num_generations ({num_generations}): "
            "rewards must hold whole groups of num_generations contiguous completions per prompt."
        )


def _nan_to_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), torch.zeros_like(x), x)


def group_mean_std(rewards: torch.Tensor, num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-aware per-group mean and Bessel std, broadcast back to every row.

    μ_g = mean of the scored rewards in group g; σ_g = sqrt(Σ (r − μ_g)² / (n_g − 1)) over them, with σ_g = 0 when
    n_g = 1 and NaN when n_g = 0. ``num_generations = N`` gives whole-batch statistics.

    Args:
        rewards: ``(N,)`` rewards, NaN = unscored.
        num_generations: group size G (N must be a multiple of it).

    Returns:
        ``(mean, std)``, each ``(N,)``.
    """
    _check_groups(rewards, num_generations)
    if rewards.numel() == 0:
        return rewards.clone(), rewards.clone()
    grouped = rewards.view(-1, num_generations)  # (P, G)
    valid = ~torch.isnan(grouped)
    n = valid.sum(dim=1, keepdim=True).to(rewards.dtype)
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    mean = torch.where(valid, grouped, zero).sum(dim=1, keepdim=True) / n  # 0/0 = NaN for an all-NaN group
    sq = torch.where(valid, (grouped - mean) ** 2, zero).sum(dim=1, keepdim=True)
    var = torch.where(n > 1, sq / (n - 1).clamp(min=1), torch.where(n == 1, zero, torch.full_like(n, float("nan"))))
    std = var.sqrt()
    return mean.expand_as(grouped).reshape(-1), std.expand_as(grouped).reshape(-1)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum over reward functions, skipping unscored (NaN) entries: r_i = nansum_k w_k r_ik.

    A row where every function is NaN stays NaN (unscorable), unlike a plain ``nansum`` that would give 0.

    Args:
        rewards_per_func: ``(N, K)`` rewards, one column per reward function, NaN = ``None``.
        weights: ``(K,)`` reward weights (``reward_weights``); None = all ones.

    Returns:
        ``(N,)`` combined rewards.
    """
    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func must have shape (N, K), got {tuple(rewards_per_func.shape)}.")
    num_funcs = rewards_per_func.shape[1]
    if weights is None:
        weights = torch.ones(num_funcs, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    weights = torch.as_tensor(weights, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    if weights.shape != (num_funcs,):
        raise ValueError(
            f"Number of reward weights ({weights.numel()}) must match number of reward functions ({num_funcs})."
        )
    weighted = rewards_per_func * weights.unsqueeze(0)
    total = torch.nansum(weighted, dim=1)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    return torch.where(unscorable, torch.full_like(total, float("nan")), total)


def _resolve_scale_rewards(scale_rewards: str | bool) -> str:
    if scale_rewards is True:
        return "group"
    if scale_rewards is False:
        return "none"
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(
            f"Invalid scale_rewards {scale_rewards!r}. Valid values: 'group' (or True), 'batch', 'none' (or False)."
        )
    return scale_rewards


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: ScaleRewards | bool = "group",
    eps: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages: reward minus its group mean, optionally divided by a std (DeepSeekMath; Dr. GRPO for "none").

    μ_g = nanmean of the group, then

    * ``"group"`` (or True): A = (r − μ_g) / (σ_g + ε), σ_g the group's Bessel nanstd;
    * ``"batch"``: A = (r − μ_g) / (σ_batch + ε), σ_batch the nanstd of every reward passed in (group mean, batch
      std — "Tricks or Traps" / PPO-style batch normalisation);
    * ``"none"`` (or False): A = r − μ_g (Dr. GRPO).

    NaN advantages (unscored rows, all-NaN groups) become 0. Call this on rewards gathered from every process, so the
    groups and the batch std are global.

    Args:
        rewards: ``(N,)`` combined rewards (see :func:`combine_rewards`), NaN = unscored.
        num_generations: group size G.
        scale_rewards: ``"group"``, ``"batch"``, ``"none"``, or a bool.
        eps: added to the std.

    Returns:
        ``(advantages, std)``, both ``(N,)``. ``std`` is σ_g per row (σ_batch broadcast for ``"batch"``), for the
        ``frac_reward_zero_std`` metric (``isclose(std, 0)``).
    """
    mode = _resolve_scale_rewards(scale_rewards)
    mean_g, std_g = group_mean_std(rewards, num_generations)
    if mode == "batch":
        std = group_mean_std(rewards, rewards.numel())[1] if rewards.numel() else std_g
    else:
        std = std_g
    advantages = rewards - mean_g
    if mode != "none":
        advantages = advantages / (std + eps)
    return _nan_to_zero(advantages), std


def normalize_then_sum_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor | None,
    num_generations: int,
    eps: float = 1e-4,
) -> torch.Tensor:
    """GDPO advantages (``multi_objective_aggregation="normalize_then_sum"``): normalise each reward, then sum.

    z_ik = (r_ik − μ_gk) / (σ_gk + ε) within each group, per function k;  s_i = nansum_k w_k z_ik;
    A_i = (s_i − mean(s)) / (std(s) + ε) over the batch. Normalising before summing keeps a high-variance reward
    from drowning the others (GDPO, Liu et al. 2026). Unscored entries are skipped; unscorable rows and NaN → 0.

    Args:
        rewards_per_func: ``(N, K)``, NaN = unscored.
        weights: ``(K,)`` or None (ones).
        num_generations: group size G.
        eps: added to each std.

    Returns:
        ``(N,)`` advantages.
    """
    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func must have shape (N, K), got {tuple(rewards_per_func.shape)}.")
    columns = []
    for k in range(rewards_per_func.shape[1]):
        r_k = rewards_per_func[:, k]
        mean_k, std_k = group_mean_std(r_k, num_generations)
        columns.append((r_k - mean_k) / (std_k + eps))
    z = torch.stack(columns, dim=1) if columns else rewards_per_func
    summed = combine_rewards(z, weights)  # (N,), NaN for rows with nothing scored
    if summed.numel() == 0:
        return summed
    mean_b, std_b = group_mean_std(summed, summed.numel())
    return _nan_to_zero((summed - mean_b) / (std_b + eps))


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """RLOO advantages: each reward minus the mean of its scored siblings (Ahmadian et al. 2024, "Back to Basics").

    b_i = (Σ_{j∈g, scored} r_j − r_i) / (n_g − 1);  A_i = r_i − b_i. Rows that are unscored, or alone in their group
    (no sibling to form a baseline), get A = 0.

    Args:
        rewards: ``(N,)`` rewards (after any KL penalty and clipping), NaN = unscored.
        num_generations: group size G (≥ 2 for a meaningful baseline).

    Returns:
        ``(N,)`` advantages.
    """
    _check_groups(rewards, num_generations)
    grouped = rewards.view(-1, num_generations)
    valid = ~torch.isnan(grouped)
    n = valid.sum(dim=1, keepdim=True).to(rewards.dtype)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    baseline = (total - grouped) / (n - 1)  # n = 1: 0/0 = NaN -> advantage 0
    return _nan_to_zero(grouped - baseline).reshape(-1)


def normalize_advantages(
    advantages: torch.Tensor, eps: float = 1e-4, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Batch z-score: A ← (A − mean(A)) / (std(A) + ε), Bessel std (RLOO ``normalize_advantages``, REINFORCE++).

    Args:
        advantages: ``(N,)``.
        eps: added to the std.
        mask: optional ``(N,)`` bool/0-1 of rows to include in the statistics; default every non-NaN row. Rows
            outside it (and NaN results) come out as 0.

    Returns:
        ``(N,)`` normalised advantages; with fewer than two rows included the std is taken as 0.
    """
    include = ~torch.isnan(advantages)
    if mask is not None:
        include = include & mask.bool()
    selected = torch.where(include, advantages, torch.full_like(advantages, float("nan")))
    if selected.numel() == 0:
        return advantages.clone()
    mean, std = group_mean_std(selected, selected.numel())
    out = (advantages - mean) / (std + eps)
    return _nan_to_zero(torch.where(include, out, torch.zeros_like(out)))
