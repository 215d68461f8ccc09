"""Corrections for off-policy data: rollout-vs-trainer importance sampling, off-policy sequence masking and the
high-entropy token mask.

* :func:`rollout_importance_weights` — the sampler (vLLM) and the trainer compute slightly different log-probs
  for the same tokens (kernels, precision, sampling post-processing). Re-weighting each token or sequence by
  π_old/π_sampler, truncated (TIS) or masked (MIS) to ``[C_min, C_max]``, keeps the policy gradient unbiased
  ("Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", Yao et al. 2025).
* :func:`truncated_log_kept_mass` — with ``top_k`` / ``top_p`` / ``min_p`` the sampler draws from the distribution
  renormalised over the kept tokens, so its log-probs are log(p_t / S) with S the kept mass, while the trainer's
  π is the full softmax. Comparing the two puts a factor S (not a policy change) into every ratio; the sampler
  records log S per token and :func:`rollout_importance_weights` adds it back (TRL 1.17's correction).
* :func:`off_policy_sequence_mask` — DeepSeek-V3.2's off-policy sequence masking: drop negative-advantage
  sequences that drifted too far from the sampling policy.
* :func:`entropy_quantile_mask` / :func:`entropy_threshold` — "Beyond the 80/20 Rule" (Wang et al. 2025): train
  only on the top-ρ highest-entropy "forking" tokens.
"""

from __future__ import annotations

from typing import Literal

import torch

from posttrain.core.masking import masked_sum, masked_where

__all__ = [
    "ROLLOUT_IS_MODES",
    "entropy_quantile_mask",
    "entropy_threshold",
    "off_policy_sequence_mask",
    "rollout_importance_weights",
    "truncated_log_kept_mass",
]

RATIO_TOLERANCE = 0.1  # ε of the ``frac_outside`` metrics: a ratio outside [1 − ε, 1 + ε] counts as mismatched

ROLLOUT_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
RolloutISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def _stat(values: torch.Tensor, reduce: str, like: torch.Tensor) -> torch.Tensor:
    if values.numel() == 0:  # nothing valid on this process: 0, as TRL logs it
        return torch.zeros((), dtype=like.dtype, device=like.device)
    return getattr(values, reduce)()


def truncated_log_kept_mass(full_scores: torch.Tensor, kept_scores: torch.Tensor) -> torch.Tensor:
    """log S per row: the log of the probability mass that top-k / top-p / min-p truncation kept.

    S = Σ_{v kept} softmax(full)_v = exp(logsumexp(kept) − logsumexp(full)), where ``kept_scores`` equals
    ``full_scores`` on the kept tokens and is −inf elsewhere (what transformers' warpers produce). Then
    log softmax(kept)_t + log S = log softmax(full)_t for every kept token t: adding log S to the sampler's
    processed log-prob gives the log-prob of the same token under the untruncated distribution, which is what the
    trainer's full-vocabulary log-softmax computes.

    Args:
        full_scores: ``(..., V)`` scores before truncation (after temperature / repetition penalty).
        kept_scores: ``(..., V)`` the same scores after truncation (−inf outside the kept set).

    Returns:
        ``(...)`` float32 log S ≤ 0 (0 when nothing was truncated).
    """
    full = torch.logsumexp(full_scores.float(), dim=-1)
    kept = torch.logsumexp(kept_scores.float(), dim=-1)
    return torch.clamp(kept - full, max=0.0)


def _ratio_stats(prefix: str, ratio: torch.Tensor, like: torch.Tensor, tolerance: float) -> dict[str, torch.Tensor]:
    """min / mean / max of ``ratio`` (1-D, valid entries) and the fraction outside [1 − ε, 1 + ε]."""
    outside = ((ratio < 1.0 - tolerance) | (ratio > 1.0 + tolerance)).to(like.dtype)
    return {
        f"{prefix}/min": _stat(ratio, "min", like),
        f"{prefix}/mean": _stat(ratio, "mean", like),
        f"{prefix}/max": _stat(ratio, "max", like),
        f"{prefix}/frac_outside": _stat(outside, "mean", like),
    }


def rollout_importance_weights(
    old_logp: torch.Tensor,
    sampling_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: RolloutISMode = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
    sampling_log_kept_mass: torch.Tensor | None = None,
    tolerance: float = RATIO_TOLERANCE,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance ratio π_old / π_sampler correcting the train–inference mismatch, truncated or masked.

    With ``sampling_log_kept_mass`` (log S_t recorded by a sampler that truncated with top-k / top-p / min-p),
    the sampler's processed log-probs log(p_t / S_t) are first put back on the full-vocabulary scale,
    sampling_t ← sampling_t + log S_t, so that both sides of the ratio are log-probs under the untruncated policy
    (TRL 1.17's correction; without it the ratio carries the factor S_t on every token, ≈ 0.8 at ``top_p=0.8``).

    Δ_t = (old_t − sampling_t)·m_t. Token modes: ρ_t = exp(Δ_t), shape ``(B, T)`` (padding gets ρ = 1). Sequence
    modes: ρ_i = exp(Σ_t Δ_t), shape ``(B, 1)``. Then ``*_truncate``: ρ ← clamp(ρ, C_min, C_max) (TIS);
    ``*_mask``: ρ ← 0 where ρ < C_min or ρ > C_max (MIS). A missing bound is ±∞. The trainer multiplies the
    per-token policy loss by ρ (except for VESPO, which folds a token-level log ρ into its kernel).

    Args:
        old_logp: ``(B, T)`` trainer log-probs of the sampled tokens (π_old).
        sampling_logp: ``(B, T)`` sampler log-probs of the same tokens.
        mask: ``(B, T)`` completion (× tool) mask.
        mode: ``"token_truncate"``, ``"token_mask"``, ``"sequence_truncate"`` or ``"sequence_mask"`` (TRL default).
        clip_min: C_min or None.
        clip_max: C_max or None.
        sampling_log_kept_mass: ``(B, T)`` log S_t of each sampled token's step (0 where nothing was truncated),
            or None when the sampler recorded none (no truncation, or a backend that cannot report it).
        tolerance: ε of the ``frac_outside`` metrics.

    Returns:
        ``(ratio, stats)``: ``ratio`` detached, ``(B, T)`` or ``(B, 1)``; ``stats`` holds scalar tensors
        ``sampling_logp_difference/mean`` and ``/max`` (|old − sampling| over valid tokens) and
        ``importance_sampling_ratio/min``, ``/mean``, ``/max`` (after the constraint; over valid tokens, or over
        sequences in sequence modes). Empty selections give 0. The trainer logs them under ``sampling/``.
        Besides TRL's, the distribution of the per-token ratio before the clip / mask:
        ``raw_importance_sampling_ratio/min``, ``/mean``, ``/max``, ``/frac_outside`` (outside [1 − ε, 1 + ε]) and
        ``frac_modified_importance_sampling_ratio`` (share of ratios the clip / mask changed); with
        ``sampling_log_kept_mass`` also ``uncorrected_importance_sampling_ratio/*`` (the same four, against the
        processed log-probs as TRL 1.16 compares them) and ``log_kept_mass/mean`` / ``/min``.
    """
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(
            f"Unknown vllm_importance_sampling_mode {mode!r}. Valid modes: {', '.join(ROLLOUT_IS_MODES)}."
        )
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(
            f"vllm_importance_sampling_clip_min ({clip_min}) must be smaller than "
            f"vllm_importance_sampling_clip_max ({clip_max})."
        )
    if mode.endswith("_truncate") and clip_min is None and clip_max is None:
        raise ValueError(
            f"vllm_importance_sampling_mode={mode!r} needs at least one of vllm_importance_sampling_clip_min / "
            "vllm_importance_sampling_clip_max."
        )
    with torch.no_grad():
        valid = mask.bool()
        uncorrected_logp = sampling_logp
        if sampling_log_kept_mass is not None:
            if sampling_log_kept_mass.shape != sampling_logp.shape:
                raise ValueError(
                    f"sampling_log_kept_mass has shape {tuple(sampling_log_kept_mass.shape)} but sampling_logp has "
                    f"{tuple(sampling_logp.shape)}; the sampler must record one log kept mass per sampled token."
                )
            sampling_logp = sampling_logp + sampling_log_kept_mass.to(sampling_logp.dtype)
        diff = masked_where(old_logp - sampling_logp, mask)
        sequence_level = mode.startswith("sequence")
        log_ratio = diff.sum(dim=-1, keepdim=True) if sequence_level else diff
        ratio = torch.exp(log_ratio)
        raw_ratio = ratio
        if mode.endswith("_truncate"):
            ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
        else:
            outside = torch.zeros_like(ratio, dtype=torch.bool)
            if clip_max is not None:
                outside |= ratio > clip_max
            if clip_min is not None:
                outside |= ratio < clip_min
            ratio = ratio.masked_fill(outside, 0.0)

        delta = (old_logp - sampling_logp).abs()[valid]
        flat_ratio = ratio.flatten() if sequence_level else ratio[valid]
        flat_raw = raw_ratio.flatten() if sequence_level else raw_ratio[valid]
        like = old_logp if old_logp.is_floating_point() else old_logp.float()
        stats = {
            "sampling_logp_difference/mean": _stat(delta, "mean", like),
            "sampling_logp_difference/max": _stat(delta, "max", like),
            "importance_sampling_ratio/min": _stat(flat_ratio, "min", like),
            "importance_sampling_ratio/mean": _stat(flat_ratio, "mean", like),
            "importance_sampling_ratio/max": _stat(flat_ratio, "max", like),
        }
        # The distribution before the clip / mask, per token whatever the mode: the mismatch the user should see.
        raw_tokens = torch.exp(old_logp - sampling_logp)[valid]
        stats.update(_ratio_stats("raw_importance_sampling_ratio", raw_tokens, like, tolerance))
        stats["frac_modified_importance_sampling_ratio"] = _stat((flat_ratio != flat_raw).to(like.dtype), "mean", like)
        if sampling_log_kept_mass is not None:
            uncorrected = torch.exp(old_logp - uncorrected_logp)[valid]
            stats.update(_ratio_stats("uncorrected_importance_sampling_ratio", uncorrected, like, tolerance))
            kept = sampling_log_kept_mass.to(like.dtype)[valid]
            stats["log_kept_mass/mean"] = _stat(kept, "mean", like)
            stats["log_kept_mass/min"] = _stat(kept, "min", like)
    return ratio, stats


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    sampling_logp: torch.Tensor,
    logp: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2 off-policy sequence mask: keep a sequence iff A ≥ 0 or its mean KL estimate ≤ δ.

    KL_i = Σ_t m (sampling_logp − logp) / max(Σ_t m, 1) (k1 estimate of KL(π_sampler ‖ π_θ), no gradient).
    Negative-advantage sequences that the current policy already finds much less likely than the sampler did are
    the ones whose updates destabilise training; positive ones are always kept.

    Args:
        advantages: ``(B,)`` or ``(B, 1)`` (``(B, T)`` gives a per-token mask).
        sampling_logp: ``(B, T)`` sampler log-probs (vLLM's if available, else π_old's).
        logp: ``(B, T)`` current log-probs (detached here).
        mask: ``(B, T)``.
        threshold: δ (``off_policy_mask_threshold``).

    Returns:
        ``(B, 1)`` float: 1 = keep, 0 = drop.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    length = mask.sum(dim=-1, keepdim=True).to(logp.dtype).clamp(min=1.0)
    mean_kl = masked_sum(sampling_logp - logp.detach(), mask, dim=-1).unsqueeze(-1) / length  # (B, 1)
    keep = (advantages >= 0) | (mean_kl <= threshold)
    return keep.to(logp.dtype)


def entropy_threshold(entropy_valid: torch.Tensor, quantile_rho: float) -> torch.Tensor:
    """The entropy above which a token is in the top-ρ fraction: quantile(1 − ρ) of the valid tokens' entropies.

    Linear interpolation between order statistics (``torch.quantile``'s default), implemented with a sort so it
    also works past ``torch.quantile``'s 16M-element limit. In multi-process training, gather the valid entropies
    of every process first and pass the result to :func:`entropy_quantile_mask` as ``threshold``.

    Args:
        entropy_valid: 1-D entropies of valid tokens.
        quantile_rho: ρ in (0, 1] (``top_entropy_quantile``); ρ = 1 keeps every token.

    Returns:
        Scalar threshold; +inf if there are no valid tokens (nothing is kept).
    """
    if not 0.0 < quantile_rho <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {quantile_rho}.")
    values = entropy_valid.reshape(-1).float()
    if values.numel() == 0:
        return torch.tensor(float("inf"), device=entropy_valid.device)
    sorted_values = torch.sort(values).values
    position = (1.0 - quantile_rho) * (values.numel() - 1)
    low = int(position)
    high = min(low + 1, values.numel() - 1)
    frac = position - low
    return sorted_values[low] + frac * (sorted_values[high] - sorted_values[low])


def entropy_quantile_mask(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    quantile_rho: float,
    *,
    threshold: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Keep only high-entropy tokens: m'_t = m_t · 1[H_t ≥ quantile_{1−ρ}(H over valid tokens)].

    Args:
        entropy: ``(B, T)`` per-token entropies.
        mask: ``(B, T)`` completion mask.
        quantile_rho: ρ, the fraction of tokens to keep.
        threshold: a precomputed threshold (from :func:`entropy_threshold` on entropies gathered across
            processes); None computes it from this process's valid tokens (single-process version).

    Returns:
        ``(B, T)`` float mask (1 = keep).
    """
    valid = mask.bool()
    if threshold is None:
        threshold = entropy_threshold(entropy.detach()[valid], quantile_rho)
    keep = (entropy.detach() >= threshold) & valid
    return keep.to(entropy.dtype if entropy.is_floating_point() else torch.float32)
