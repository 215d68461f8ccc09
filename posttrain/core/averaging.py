"""Weight averaging as pure tensor math: BEMA, the bias-corrected exponential moving average of iterates
(Block & Zhang, "EMA Without the Lag", https://huggingface.co/papers/2508.00180).

With ``t`` the optimizer step, ρ the ``lag``, γ the ``multiplier``, κ the ``ema_power`` and η the ``bias_power``:

- ``β_t = max((ρ + γ·t)^{−κ}, min_ema_multiplier)`` — the EMA step size (:func:`bema_ema_beta`);
- ``α_t = (ρ + γ·t)^{−η}`` — the bias-correction scale (:func:`bema_alpha`);
- ``EMA_t = (1 − β_t)·EMA_{t−1} + β_t·θ_t`` and ``θ'_t = α_t·(θ_t − θ_0) + EMA_t`` (:func:`bema_update_`).

``t`` is the global step itself (not the steps since ``update_after``), as in TRL and the reference code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["bema_alpha", "bema_ema_beta", "bema_update_"]


def bema_ema_beta(step: int, *, lag: float, multiplier: float, ema_power: float, min_ema_multiplier: float) -> float:
    """EMA step size ``β_t = max((ρ + γ·t)^{−κ}, min_ema_multiplier)`` (κ = 0 gives β = 1: no averaging)."""
    return max((lag + multiplier * step) ** (-ema_power), min_ema_multiplier)


def bema_alpha(step: int, *, lag: float, multiplier: float, bias_power: float) -> float:
    """Bias-correction scale ``α_t = (ρ + γ·t)^{−η}`` (η = 0 gives α = 1)."""
    return (lag + multiplier * step) ** (-bias_power)


@torch.no_grad()
def bema_update_(
    current: Sequence[torch.Tensor],
    theta0: Sequence[torch.Tensor],
    ema: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor],
    *,
    beta: float,
    alpha: float,
) -> None:
    """One BEMA update, in place: ``ema ← (1 − β)·ema + β·θ_t`` then ``out ← ema + α·(θ_t − θ_0)``, per tensor.

    ``current`` are the live parameters θ_t (any device); ``theta0``, ``ema`` and ``out`` share one device (the
    BEMA buffers', usually CPU) and ``current`` is copied there first.
    """
    for theta_t, t0, e, o in zip(current, theta0, ema, out, strict=True):
        theta_t = theta_t.detach().to(device=e.device, dtype=e.dtype)
        e.mul_(1.0 - beta).add_(theta_t, alpha=beta)
        o.copy_(e + alpha * (theta_t - t0))
