"""Reference-free preference objectives as pure tensor math: CPO (with SimPO and AlphaPO), TPO and ORPO.

None of these compares the policy with a reference policy; each scores a (chosen, rejected) pair by the policy's own
sequence log-probs (summed, or averaged over tokens where the method says so — the trainer decides and passes the
result in):

- :data:`CONTRASTIVE_LOSSES` — the pairwise loss on the score margin ``Δ = s_c − s_r`` shared by CPO
  (https://huggingface.co/papers/2401.08417) and TPO (https://huggingface.co/papers/2405.16681): ``sigmoid``
  (label-smoothed), ``hinge``, ``ipo``, and the margin variant ``simpo`` / ``tpo-l``
  (https://huggingface.co/papers/2405.14734), each ``fn(delta, *, beta, label_smoothing, gamma) -> (B,)``.
- :func:`alphapo_reward` — AlphaPO's reward shape ``(1 − p^{−α}) / α`` (https://huggingface.co/papers/2501.03884).
- :func:`cpo_loss` — CPO's per-pair loss and rewards (AlphaPO transform, then a contrastive loss).
- :func:`log1mexp` / :func:`orpo_odds_ratio_loss` — ORPO's odds-ratio term (https://huggingface.co/papers/2403.07691).

The NLL terms (CPO's ``cpo_alpha``·NLL(chosen), TPO's ``tpo_alpha``·NLL(gold), ORPO's NLL(chosen)) are token means
over the micro-batch that the trainers compute from the same chunked per-token log-probs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from posttrain.registry import Registry

__all__ = [
    "CONTRASTIVE_LOSSES",
    "alphapo_reward",
    "contrastive_loss",
    "cpo_loss",
    "log1mexp",
    "masked_token_mean_nll",
    "orpo_odds_ratio_loss",
]

CONTRASTIVE_LOSSES: Registry[Callable[..., torch.Tensor]] = Registry("loss_type")


def _smoothed_logistic(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


@CONTRASTIVE_LOSSES.register("sigmoid")
def sigmoid(delta: torch.Tensor, *, beta: float, label_smoothing: float = 0.0, **_) -> torch.Tensor:
    """−(1−ε)·log σ(βΔ) − ε·log σ(−βΔ) (CPO Eq. 3 at ε = 0)."""
    return _smoothed_logistic(beta * delta, label_smoothing)


@CONTRASTIVE_LOSSES.register("hinge")
def hinge(delta: torch.Tensor, *, beta: float, **_) -> torch.Tensor:
    """SLiC hinge max(0, 1 − βΔ); β is the reciprocal of the margin."""
    return torch.relu(1.0 - beta * delta)


@CONTRASTIVE_LOSSES.register("ipo")
def ipo(delta: torch.Tensor, *, beta: float, **_) -> torch.Tensor:
    """IPO (Δ − 1/(2β))², β playing τ (scores are token means)."""
    return (delta - 1.0 / (2.0 * beta)) ** 2


def _margin_sigmoid(delta: torch.Tensor, *, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0, **_):
    """SimPO / TPO-L: the smoothed logistic loss of β(Δ − γ/β) = βΔ − γ (scores are token means)."""
    return _smoothed_logistic(beta * (delta - gamma / beta), label_smoothing)


CONTRASTIVE_LOSSES.add("simpo", _margin_sigmoid)
CONTRASTIVE_LOSSES.add("tpo-l", _margin_sigmoid)


def contrastive_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    loss_type: str | Callable[..., torch.Tensor] = "sigmoid",
    *,
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
) -> torch.Tensor:
    """Per-pair reference-free contrastive loss ``(B,)`` of ``Δ = chosen_scores − rejected_scores``.

    Args:
        chosen_scores, rejected_scores: ``(B,)`` policy scores (sequence log-probs, token means for
            ``ipo``/``simpo``/``tpo-l``, or AlphaPO rewards).
        loss_type: A name in :data:`CONTRASTIVE_LOSSES` or a callable ``fn(delta, *, beta, label_smoothing, gamma)``.
        beta: β (the temperature; τ for IPO).
        label_smoothing: ε of the sigmoid-type losses.
        gamma: Target reward margin γ of ``simpo`` / ``tpo-l`` (``simpo_gamma`` / ``tpo_l_gamma``).
    """
    fn = CONTRASTIVE_LOSSES.get(loss_type)
    return fn(chosen_scores - rejected_scores, beta=beta, label_smoothing=label_smoothing, gamma=gamma)


def alphapo_reward(logps: torch.Tensor, alpha: float) -> torch.Tensor:
    """AlphaPO reward shape ``r = (1 − p^{−α}) / α`` with ``p = exp(logps)``, computed as ``−expm1(−α·logps)/α``.

    α → 0 recovers ``logps`` itself (the standard log reward); α = 0 returns ``logps`` unchanged.
    """
    if alpha == 0.0:
        return logps
    return -torch.expm1(-alpha * logps) / alpha


def cpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    loss_type: str = "sigmoid",
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPO's per-pair preference loss and the rewards it logs (TRL's ``CPOTrainer.cpo_loss``).

    ``r = alphapo_reward(logps, alpha)`` (``r = logps`` when α = 0), then ``contrastive_loss(r_c, r_r)`` with
    ``gamma = simpo_gamma`` for ``simpo``. Rewards are ``β·r`` (detached). The ``cpo_alpha``·NLL(chosen) term is
    added by the trainer.

    Args:
        chosen_logps, rejected_logps: ``(B,)`` policy log-probs (summed; token means for ``ipo``/``simpo``).
        loss_type: ``sigmoid``, ``hinge``, ``ipo`` or ``simpo``.

    Returns:
        ``(losses (B,), chosen_rewards (B,), rejected_rewards (B,))``.
    """
    chosen_r = alphapo_reward(chosen_logps, alpha)
    rejected_r = alphapo_reward(rejected_logps, alpha)
    losses = contrastive_loss(
        chosen_r, rejected_r, loss_type, beta=beta, label_smoothing=label_smoothing, gamma=simpo_gamma
    )
    return losses, beta * chosen_r.detach(), beta * rejected_r.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − exp(x))`` for ``x < 0``, stable at both ends (Mächler 2012): ``log(−expm1(x))`` for x > −log 2,
    ``log1p(−exp(x))`` otherwise."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_odds_ratio_loss(
    chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, *, beta: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO's odds-ratio term on token-mean log-probs ``(B,)`` (paper Eqs. 4 and 7).

    ``log_odds = (l_c − l_r) − (log(1 − e^{l_c}) − log(1 − e^{l_r}))`` is the log odds ratio of chosen over rejected;
    the per-pair term is ``β·log σ(log_odds)``, which the trainer *subtracts* from NLL(chosen):
    ``loss = NLL(chosen) − mean(β·log σ(log_odds))``.

    Returns:
        ``(beta·logsigmoid(log_odds) (B,), logsigmoid(log_odds) (B,), log_odds (B,))`` — TRL logs the batch means of
        the last two as ``log_odds_ratio`` and ``log_odds_chosen``.
    """
    chosen_logps = chosen_logps.float()
    rejected_logps = rejected_logps.float()
    log_odds = (chosen_logps - rejected_logps) - (log1mexp(chosen_logps) - log1mexp(rejected_logps))
    ratio = F.logsigmoid(log_odds)
    return beta * ratio, ratio, log_odds


def masked_token_mean_nll(
    logps: torch.Tensor, mask: torch.Tensor, num_tokens: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Token-mean negative log-likelihood ``−Σ logps·mask / Σ mask`` over a ``(B, T)`` batch (0 when empty) —
    ``nn.CrossEntropyLoss`` over the masked tokens, as TRL's NLL terms.

    ``num_tokens``: the divisor instead of ``Σ mask`` (data-parallel: the global token count / processes, so the
    processes' mean is the token mean over all of them)."""
    mask = mask.to(logps.dtype)
    divisor = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=logps.dtype, device=logps.device)
    return -(logps * mask).sum() / divisor.clamp(min=1.0)
