"""Per-token self-distillation losses (TRL's ``trl.experimental.sdft`` / ``sdpo`` ``loss_utils``).

Self-distillation (SDFT: Shenfeld et al., "Self-Distillation Enables Continual Learning",
https://huggingface.co/papers/2601.19897; SDPO: GRPO plus the same term) distils the student toward a *teacher* that
is the same network (its initial weights, its live weights or an EMA of them) conditioned on a richer prompt. Both
score the same sampled completion, so the logits here are aligned position by position: ``student_logits`` and
``teacher_logits`` ``(B, T, V)`` (or ``(N, V)``) at the positions predicting the completion tokens, already divided
by the temperature. Each loss returns the per-token loss ``(B, T)`` (or ``(N,)``); aggregation is the caller's
(:func:`self_distillation_loss` is SDFT's sequence-mean-token-mean).

The three ``distillation_mode`` values:

- ``"topk_logits"`` (:func:`compute_topk_self_distillation_loss`): the divergence on the student's top-k token ids
  per position, both sides' full-vocabulary log-probs gathered there, then renormalised over the k ids, or (with
  ``distillation_add_tail``) completed with one tail bucket ``1 − Σ_k p_k`` (``core.distill.add_tail_bucket``).
- ``"full_logits"`` (:func:`compute_full_logit_self_distillation_loss`): the divergence over the whole vocabulary.
- ``"sampled_token"`` (:func:`compute_sampled_token_self_distillation_loss`): reverse KL estimated at the sampled
  token only, ``sg[log π_S(y_t) − log π_T(y_t)] · log π_S(y_t)`` (its gradient is the REINFORCE gradient of
  KL(π_S‖π_T) with per-token reward ``log π_T − log π_S``); reverse KL only, so ``alpha`` must be 1.

The divergence :func:`compute_divergence` is ``core.distill.token_generalized_jsd`` with TRL's ``alpha`` in the role
of GKD's β: α = 0 → KL(p_T‖p_S) (forward), α = 1 → KL(p_S‖p_T) (reverse), otherwise
α·KL(p_T‖p_M) + (1 − α)·KL(p_S‖p_M) with p_M = (1 − α)·p_S + α·p_T.

:func:`apply_importance_sampling_clipping` reweights a per-token loss by the clipped, detached ratio
``min(π_θ(y_t) / π_old(y_t), clip)`` between the current student and the student that sampled the rollout (TRL's
``distillation_is_clip``), for rollouts reused over several optimizer steps.
"""

from __future__ import annotations

import torch

from posttrain.core.aggregation import seq_mean_token_mean
from posttrain.core.distill import sparse_support_divergence, token_generalized_jsd
from posttrain.core.logprobs import selective_log_softmax

__all__ = [
    "DISTILLATION_MODES",
    "apply_importance_sampling_clipping",
    "compute_divergence",
    "compute_full_logit_self_distillation_loss",
    "compute_sampled_token_self_distillation_loss",
    "compute_self_distillation_per_token_loss",
    "compute_topk_self_distillation_loss",
    "sampled_token_self_distillation_loss_from_logps",
    "self_distillation_loss",
]

DISTILLATION_MODES = ("sampled_token", "full_logits", "topk_logits")


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(
            f"`distillation_alpha` must lie in [0, 1] (0 = forward KL, 1 = reverse KL, 0.5 = JSD); got {alpha}."
        )


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    # At least float32: a bf16 log-softmax over the vocabulary loses the small probabilities the KL weighs.
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def compute_divergence(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-position divergence ``(...,)`` between two log-probability tensors ``(..., K)`` over the last dim.

    α = 0: KL(p_T‖p_S); α = 1: KL(p_S‖p_T); else α·KL(p_T‖p_M) + (1 − α)·KL(p_S‖p_M), p_M = (1 − α)p_S + αp_T
    (``core.distill.token_generalized_jsd``; TRL's ``compute_divergence``).
    """
    _check_alpha(alpha)
    return token_generalized_jsd(student_log_probs, teacher_log_probs, alpha)


def compute_topk_self_distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    distillation_topk: int,
    distillation_alpha: float,
    distillation_add_tail: bool = False,
) -> torch.Tensor:
    """Divergence on the student's top-k support; ``(..., V)`` logits → ``(...,)`` per-token loss.

    The k ids with the largest student logits at each position form the support; both models' full-vocabulary
    log-probs are gathered there. Without the tail each side is renormalised over the k ids (the divergence of the
    top-k conditionals); with ``distillation_add_tail`` a (k+1)-th bucket holds each side's remaining mass
    ``1 − Σ_k p_k``, so the result approximates the full-vocabulary divergence. Gradients reach the student through
    the gathered log-probs (the support choice itself is not differentiated).

    Args:
        student_logits / teacher_logits: ``(B, T, V)`` or ``(N, V)``, same shape, temperature already applied.
        distillation_topk: k (clamped to V).
        distillation_alpha: α as in :func:`compute_divergence`.
        distillation_add_tail: Add the tail bucket instead of renormalising.
    """
    _check_alpha(distillation_alpha)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"`student_logits` {tuple(student_logits.shape)} and `teacher_logits` {tuple(teacher_logits.shape)} "
            "must have the same shape."
        )
    if distillation_topk is None or distillation_topk < 1:
        raise ValueError(f"`distillation_topk` must be a positive integer, got {distillation_topk}.")
    k = min(int(distillation_topk), student_logits.shape[-1])
    student_log_probs = _log_softmax(student_logits)
    teacher_log_probs = _log_softmax(teacher_logits).to(student_log_probs.dtype)
    support = student_logits.detach().topk(k, dim=-1).indices  # (..., k)
    mask = torch.ones_like(support, dtype=torch.bool)
    return sparse_support_divergence(
        student_log_probs.gather(-1, support),
        teacher_log_probs.gather(-1, support),
        mask,
        beta=distillation_alpha,
        add_tail=distillation_add_tail,
    )


def compute_full_logit_self_distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, distillation_alpha: float
) -> torch.Tensor:
    """Full-vocabulary divergence; ``(..., V)`` logits → ``(...,)`` per-token loss (:func:`compute_divergence`)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"`student_logits` {tuple(student_logits.shape)} and `teacher_logits` {tuple(teacher_logits.shape)} "
            "must have the same shape."
        )
    student_log_probs = _log_softmax(student_logits)
    return compute_divergence(
        student_log_probs, _log_softmax(teacher_logits).to(student_log_probs.dtype), distillation_alpha
    )


def _check_sampled_alpha(alpha: float) -> None:
    if alpha != 1.0:
        raise ValueError(
            "Only reverse KL (alpha=1.0) is supported for token-level distillation when "
            f"`distillation_mode='sampled_token'`, got alpha={alpha}"
        )


def sampled_token_self_distillation_loss_from_logps(
    student_per_token_logps: torch.Tensor,
    teacher_per_token_logps: torch.Tensor,
    *,
    distillation_alpha: float = 1.0,
) -> torch.Tensor:
    """``sg[log π_S(y_t) − log π_T(y_t)] · log π_S(y_t)`` from the sampled tokens' log-probs ``(B, T)`` → ``(B, T)``.

    Its value is the per-token reverse-KL estimate times log π_S; its gradient is ``(log π_S − log π_T)·∇log π_S``,
    the score-function gradient of KL(π_S‖π_T) on the student's own samples. Reverse KL only (α must be 1).
    """
    _check_sampled_alpha(distillation_alpha)
    teacher = teacher_per_token_logps.to(student_per_token_logps.dtype)
    return (student_per_token_logps - teacher).detach() * student_per_token_logps


def compute_sampled_token_self_distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    distillation_alpha: float = 1.0,
) -> torch.Tensor:
    """Sampled-token reverse-KL loss from logits ``(B, T, V)`` and the sampled ``completion_ids`` ``(B, T)``.

    The log-probs of the sampled tokens under each model feed
    :func:`sampled_token_self_distillation_loss_from_logps`; returns ``(B, T)``.
    """
    _check_sampled_alpha(distillation_alpha)
    student = selective_log_softmax(student_logits, completion_ids)
    with torch.no_grad():
        teacher = selective_log_softmax(teacher_logits.detach(), completion_ids)
    return sampled_token_self_distillation_loss_from_logps(student, teacher, distillation_alpha=distillation_alpha)


def compute_self_distillation_per_token_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    completion_ids: torch.Tensor | None = None,
    *,
    distillation_mode: str = "topk_logits",
    distillation_alpha: float = 0.5,
    distillation_topk: int | None = 100,
    distillation_add_tail: bool = False,
) -> torch.Tensor:
    """Dispatch on ``distillation_mode`` (one of :data:`DISTILLATION_MODES`); returns the per-token loss.

    ``completion_ids`` (the sampled tokens, the logits' leading shape) is needed by ``"sampled_token"`` only.
    """
    if distillation_mode == "topk_logits":
        if distillation_topk is None:
            raise ValueError("`distillation_mode='topk_logits'` requires `distillation_topk` to be set.")
        return compute_topk_self_distillation_loss(
            student_logits,
            teacher_logits,
            distillation_topk=distillation_topk,
            distillation_alpha=distillation_alpha,
            distillation_add_tail=distillation_add_tail,
        )
    if distillation_mode == "full_logits":
        return compute_full_logit_self_distillation_loss(
            student_logits, teacher_logits, distillation_alpha=distillation_alpha
        )
    if distillation_mode == "sampled_token":
        if completion_ids is None:
            raise ValueError("`distillation_mode='sampled_token'` needs the sampled `completion_ids`.")
        return compute_sampled_token_self_distillation_loss(
            student_logits, teacher_logits, completion_ids, distillation_alpha=distillation_alpha
        )
    raise ValueError(
        f"distillation_mode must be one of: {', '.join(repr(m) for m in DISTILLATION_MODES)}, got {distillation_mode!r}"
    )


def apply_importance_sampling_clipping(
    per_token_loss: torch.Tensor,
    student_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    clip_coeff: float,
) -> torch.Tensor:
    """``per_token_loss · min(exp(clamp(log π_θ − log π_old, −20, 20)), clip_coeff)``, the ratio detached.

    All ``(B, T)`` (or ``(N,)``): ``student_log_probs`` are the current student's log-probs of the sampled tokens,
    ``old_log_probs`` those of the student that generated them. The ratio is only capped from above (TRL).
    """
    if clip_coeff is None or not clip_coeff > 0:
        raise ValueError(f"`distillation_is_clip` must be > 0 (or None to disable clipping), got {clip_coeff}.")
    log_ratio = (student_log_probs.detach() - old_log_probs.detach().to(student_log_probs.dtype)).clamp(-20.0, 20.0)
    ratio = log_ratio.exp().clamp(max=clip_coeff)
    return per_token_loss * ratio.to(per_token_loss.dtype)


def self_distillation_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """SDFT's aggregation: each row's mean over its loss tokens, then the mean over rows (``(B, T)`` → scalar).

    ``core.aggregation.seq_mean_token_mean`` (a row without loss tokens contributes 0 and still counts as a row).
    """
    return seq_mean_token_mean(per_token_loss, loss_mask)
