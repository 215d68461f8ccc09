"""Rollout metrics with TRL's names: completion lengths, rewards, clipping ratios.

Every function takes tensors already gathered over processes (where TRL gathers) and returns ``{name: float}``;
the trainer appends them to its metric window, where NaN values are ignored when averaging.

Names (features.md §B1.10): ``completions/{mean,min,max}_length``, ``completions/{mean,min,max}_terminated_length``,
``completions/clipped_ratio``, ``rewards/{name}/{mean,std}``, ``reward``, ``reward_std``, ``frac_reward_zero_std``,
``clip_ratio/{low_mean,low_min,high_mean,high_max,region_mean}``.
"""

from __future__ import annotations

import torch

from posttrain.core.masking import nanmax, nanmin, nanstd


def _item(x: torch.Tensor) -> float:
    return float(x.detach().float().item()) if x.numel() else float("nan")


def completion_length_metrics(lengths: torch.Tensor, terminated: torch.Tensor) -> dict[str, float]:
    """Length statistics of a generation batch.

    Args:
        lengths: ``(N,)`` generated tokens per completion (tool-result tokens excluded).
        terminated: ``(N,)`` bool, True where the completion ended with EOS.

    Returns:
        ``completions/{mean,min,max}_length``, the same over EOS-terminated completions only (0 when none
        terminated, as TRL), and ``completions/clipped_ratio`` = fraction not terminated (hit the length cap).
    """
    lengths = lengths.float()
    terminated = terminated.bool()
    term = lengths[terminated]
    if term.numel() == 0:
        term = torch.zeros(1)
    return {
        "completions/mean_length": _item(lengths.mean()),
        "completions/min_length": _item(lengths.min()),
        "completions/max_length": _item(lengths.max()),
        "completions/mean_terminated_length": _item(term.mean()),
        "completions/min_terminated_length": _item(term.min()),
        "completions/max_terminated_length": _item(term.max()),
        "completions/clipped_ratio": _item(1.0 - terminated.float().mean()),
    }


def reward_metrics(
    rewards_per_func: torch.Tensor,
    names: list[str],
    rewards: torch.Tensor,
    std_for_metric: torch.Tensor | None = None,
) -> dict[str, float]:
    """Reward statistics of a generation batch.

    Args:
        rewards_per_func: ``(N, K)`` raw rewards (NaN = the function returned None).
        names: the K reward-function names.
        rewards: ``(N,)`` weighted sum per completion (NaN = unscorable).
        std_for_metric: ``(N,)`` the std each advantage was computed with (group or batch); rows with std ≈ 0
            count in ``frac_reward_zero_std``. ``None`` skips that metric.

    Returns:
        ``rewards/{name}/mean`` and ``rewards/{name}/std`` (NaN-aware), ``reward`` (nanmean), ``reward_std`` (nanstd
        over the whole batch, as TRL), ``frac_reward_zero_std``.
    """
    out: dict[str, float] = {}
    for k, name in enumerate(names):
        column = rewards_per_func[:, k].float()
        out[f"rewards/{name}/mean"] = _item(torch.nanmean(column))
        out[f"rewards/{name}/std"] = _item(nanstd(column))
    rewards = rewards.float()
    out["reward"] = _item(torch.nanmean(rewards))
    out["reward_std"] = _item(nanstd(rewards))
    if std_for_metric is not None:
        zero = torch.isclose(std_for_metric.float(), torch.zeros_like(std_for_metric.float()))
        out["frac_reward_zero_std"] = _item(zero.float().mean())
    return out


def clip_ratio_metrics(
    low: torch.Tensor,
    high: torch.Tensor,
    region: torch.Tensor,
    low_per_sequence: torch.Tensor | None = None,
    high_per_sequence: torch.Tensor | None = None,
) -> dict[str, float]:
    """TRL's clipping metrics.

    Args:
        low / high / region: the clipped fraction of the micro-batch's tokens (or sequences), over every process:
            one value, or ``(P,)`` per-process values (averaged, NaN ignored).
        low_per_sequence / high_per_sequence: ``(N,)`` each sequence's clipped fraction, gathered over processes
            (NaN = empty completion, ignored). TRL's ``low_min`` / ``high_max`` are the min / max over these
            finer-grained values; None: over ``low`` / ``high`` themselves.

    Returns:
        ``clip_ratio/low_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_mean``, ``clip_ratio/high_max``,
        ``clip_ratio/region_mean``.
    """
    low_values = low if low_per_sequence is None else low_per_sequence
    high_values = high if high_per_sequence is None else high_per_sequence
    return {
        "clip_ratio/low_mean": _item(torch.nanmean(low.float())),
        "clip_ratio/low_min": _item(nanmin(low_values.float())),
        "clip_ratio/high_mean": _item(torch.nanmean(high.float())),
        "clip_ratio/high_max": _item(nanmax(high_values.float())),
        "clip_ratio/region_mean": _item(torch.nanmean(region.float())),
    }
