"""Token-level staleness: how many weight versions each trained token lags the policy being trained.

With partial rollouts (AsyncGRPO ``partial_rollout_max_tokens``) one completion can be sampled by several weight
versions: each token carries the version that sampled it. At optimizer step ``step`` a token sampled by version
``v`` lags ``step - v`` versions. These helpers reduce a batch's per-token versions to that lag distribution (what
the trainer logs, and what its staleness rule checks: the round's *oldest* token decides).
"""

from __future__ import annotations

import torch

__all__ = ["VersionLagStats", "version_lag_stats"]


class VersionLagStats(dict):
    """``{"mean": float, "max": int, "min": int, "tokens": int, "frac": {lag: fraction of tokens}}``."""


def version_lag_stats(token_versions: torch.Tensor, valid: torch.Tensor, step: int) -> VersionLagStats:
    """The lag distribution of the valid tokens of a batch trained at ``step``.

    Args:
        token_versions: ``(B, C)`` integer weight version of each completion token (padding: any value).
        valid: ``(B, C)`` bool/0-1, True on real completion tokens (every sampled token, loss-masked or not).
        step: The optimizer step (= the trainer's weight version) the batch is trained at.

    Returns:
        ``mean`` (token-weighted lag), ``max`` / ``min`` lag, ``tokens`` (valid tokens counted) and ``frac``
        (lag -> fraction of the valid tokens with that lag, lags ascending). No valid token: zeros and ``{}``.
    """
    if token_versions.shape != valid.shape:
        raise ValueError(f"token_versions {tuple(token_versions.shape)} and valid {tuple(valid.shape)} differ.")
    lags = (int(step) - token_versions.long())[valid.bool()]  # (N,)
    if lags.numel() == 0:
        return VersionLagStats(mean=0.0, max=0, min=0, tokens=0, frac={})
    values, counts = torch.unique(lags, return_counts=True)
    n = int(lags.numel())
    frac = {int(v): int(c) / n for v, c in zip(values.tolist(), counts.tolist())}
    return VersionLagStats(
        mean=float(lags.double().mean()), max=int(lags.max()), min=int(lags.min()), tokens=n, frac=frac
    )
