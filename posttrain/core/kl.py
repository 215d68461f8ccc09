"""Per-token KL(π_θ ‖ π_ref) estimators from sampled tokens (Schulman, "Approximating KL Divergence", 2020).

With x ~ π_θ and r = π_ref(x)/π_θ(x), i.e. log r = ref_logp − logp:

* k1 = −log r = logp − ref_logp          unbiased, high variance, can be negative
* k2 = ½ (log r)²                          biased, low variance, ≥ 0
* k3 = (r − 1) − log r                     unbiased, low variance, ≥ 0 (GRPO's estimator, DeepSeekMath)

All functions are elementwise on ``(B, T)`` (any matching shapes) and differentiable; masking and reduction are the
caller's job (see ``posttrain.core.aggregation``).
"""

from __future__ import annotations

import torch

__all__ = ["kl_k1", "kl_k2", "kl_k3", "kl_k3_bias_corrected"]


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp − ref_logp, shape ``(B, T)``. RLOO folds its per-sequence sum into the reward."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (logp − ref_logp)², shape ``(B, T)``."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref − logp) − (ref − logp) − 1, shape ``(B, T)`` (Schulman 2020; DeepSeekMath GRPO)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def kl_k3_bias_corrected(logp: torch.Tensor, ref_logp: torch.Tensor, is_weight: torch.Tensor) -> torch.Tensor:
    """k3 · w: k3 weighted by the policy importance weight w = π_θ/π_old (DeepSeek-V3.2, ``use_bias_correction_kl``).

    Samples come from π_old, not π_θ, so the k3 estimate of KL(π_θ ‖ π_ref) is re-weighted by w to stay unbiased.

    Args:
        logp, ref_logp: ``(B, T)`` log-probs of the sampled tokens under π_θ and π_ref.
        is_weight: ``(B, T)`` token-level or ``(B, 1)`` sequence-level weights (``importance_weights``); kept in the
            graph as TRL does.
    """
    return kl_k3(logp, ref_logp) * is_weight
