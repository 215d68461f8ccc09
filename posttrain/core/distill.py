"""Token-level distillation divergences between a student and a teacher distribution over the vocabulary.

What lives here:

- ``generalized_jsd_loss`` — the generalized Jensen–Shannon divergence of GKD (Agarwal et al., "On-Policy
  Distillation of Language Models", https://huggingface.co/papers/2306.13649), used by TRL's distillation and GKD
  trainers, with ``forward_kl`` / ``reverse_kl`` wrappers for its endpoints.
- ``chunked_generalized_jsd`` — the same loss computed from last hidden states and LM-head weights in chunks of
  tokens, so that peak memory is chunk × V instead of N × V (each chunk's logits are recomputed in backward).
- ``chunked_token_map`` — any per-token function of the student's full-vocabulary log-probs (the sparse top-k
  supports, sampled-token log-probs, entropies) evaluated the same way, chunk by chunk with recompute in backward.

Conventions: logits are ``(N, V)`` or ``(B, T, V)``; ``mask`` has the leading shape and selects the tokens that
count. Logits are divided by ``temperature`` and the math runs in (at least) float32 in log space (``log_softmax``,
``logaddexp``), so bf16/fp16 logits and near-zero probabilities stay finite. Unlike the GKD paper's β-limits, the
endpoints are special-cased: β = 0 is KL(p_T‖p_S) and β = 1 is KL(p_S‖p_T) exactly (as TRL does).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = [
    "add_tail_bucket",
    "chunked_generalized_jsd",
    "chunked_token_map",
    "forward_kl",
    "generalized_jsd_loss",
    "iw_opd_loss",
    "iw_opd_weights",
    "reverse_kl",
    "sparse_support_divergence",
    "token_generalized_jsd",
]

_REDUCTIONS = ("batchmean", "sum", "mean", "none")


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # At least float32: bf16/fp16 log-softmax over a large vocabulary loses the small probabilities that KL weighs.
    return F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)


def _check_options(beta: float, temperature: float, reduction: str) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"`beta` must lie in [0, 1] (0 = forward KL, 1 = reverse KL, 0.5 = JSD); got {beta}.")
    if not temperature > 0.0:
        raise ValueError(f"`temperature` must be > 0; got {temperature}.")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"Unknown `reduction` {reduction!r}. Valid values: {', '.join(_REDUCTIONS)}.")


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p‖q) = Σ_v p_v (log p_v − log q_v) over the last dim; terms with p_v = 0 contribute 0 (not NaN)."""
    terms = torch.exp(log_p) * (log_p - log_q)
    terms = torch.where(torch.isneginf(log_p), torch.zeros_like(terms), terms)
    return terms.sum(dim=-1)


def token_generalized_jsd(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float = 0.5
) -> torch.Tensor:
    """Per-token generalized JSD from log-probabilities of shape (..., V); returns shape (...).

    - β = 0: KL(p_T‖p_S) (forward KL, mode-covering)
    - β = 1: KL(p_S‖p_T) (reverse KL, mode-seeking)
    - otherwise: β·KL(p_T‖p_M) + (1−β)·KL(p_S‖p_M) with p_M = (1−β)·p_S + β·p_T,
      log p_M = logaddexp(log p_S + log(1−β), log p_T + log β).
    """
    if beta == 0.0:
        return _kl(teacher_log_probs, student_log_probs)
    if beta == 1.0:
        return _kl(student_log_probs, teacher_log_probs)
    log_mix = torch.logaddexp(student_log_probs + math.log1p(-beta), teacher_log_probs + math.log(beta))
    return beta * _kl(teacher_log_probs, log_mix) + (1.0 - beta) * _kl(student_log_probs, log_mix)


def _reduce(per_token: torch.Tensor, n_valid: torch.Tensor | int, vocab_size: int, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    denom = torch.as_tensor(n_valid, dtype=total.dtype, device=total.device).clamp(min=1.0)
    if reduction == "mean":
        denom = denom * vocab_size
    return total / denom


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """Generalized Jensen–Shannon divergence between student and teacher token distributions (GKD, Eq. 6).

    p_S = softmax(student_logits / temperature), p_T = softmax(teacher_logits / temperature);
    per token D_β = KL(p_T‖p_S) if β = 0, KL(p_S‖p_T) if β = 1, else β·KL(p_T‖p_M) + (1−β)·KL(p_S‖p_M) with
    p_M = (1−β)·p_S + β·p_T. Paper: https://huggingface.co/papers/2306.13649.

    Gradients flow to both inputs; pass detached teacher logits (the usual case).

    Args:
        student_logits: ``(N, V)`` or ``(B, T, V)``.
        teacher_logits: Same shape as ``student_logits``.
        mask: Optional bool/0-1 tensor with the leading shape (``(N,)`` or ``(B, T)``); tokens where it is 0 are
            ignored (e.g. prompt and padding positions, TRL's ``labels == -100``). None = every token counts.
        beta: β ∈ [0, 1].
        temperature: Softmax temperature (> 0) applied to both sides.
        reduction: ``"batchmean"`` = sum over valid tokens / number of valid tokens (mean per-token divergence);
            ``"sum"`` = sum over valid tokens; ``"mean"`` = sum / (valid tokens × V), i.e. PyTorch ``kl_div``'s
            element mean; ``"none"`` = per-token divergence with the leading shape, 0 at masked tokens.
            With no valid token the means are 0 (the denominator is clamped at 1).

    Returns:
        A scalar (float32, or float64 for float64 inputs), or per-token divergences for ``reduction="none"``.
    """
    _check_options(beta, temperature, reduction)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"`student_logits` {tuple(student_logits.shape)} and `teacher_logits` {tuple(teacher_logits.shape)} "
            "must have the same shape (same tokens, same vocabulary)."
        )
    student_log_probs = _log_probs(student_logits, temperature)
    teacher_log_probs = _log_probs(teacher_logits, temperature)
    per_token = token_generalized_jsd(student_log_probs, teacher_log_probs, beta)
    if mask is None:
        n_valid = per_token.numel()
    else:
        if mask.shape != per_token.shape:
            raise ValueError(
                f"`mask` shape {tuple(mask.shape)} must equal the logits' leading shape {tuple(per_token.shape)}."
            )
        keep = mask.to(torch.bool)
        per_token = torch.where(keep, per_token, torch.zeros_like(per_token))
        n_valid = keep.sum()
    return _reduce(per_token, n_valid, student_logits.size(-1), reduction)


def forward_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """Forward KL(p_T‖p_S) per token (mass-covering; supervised KD). ``generalized_jsd_loss`` with β = 0."""
    return generalized_jsd_loss(
        student_logits, teacher_logits, mask, beta=0.0, temperature=temperature, reduction=reduction
    )


def reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """Reverse KL(p_S‖p_T) per token (mode-seeking; on-policy distillation). ``generalized_jsd_loss`` with β = 1."""
    return generalized_jsd_loss(
        student_logits, teacher_logits, mask, beta=1.0, temperature=temperature, reduction=reduction
    )


def _chunk_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    rows: torch.Tensor,
    teacher_logits_fn: Callable[[torch.Tensor], torch.Tensor],
    beta: float,
    temperature: float,
) -> torch.Tensor:
    # Runs once in forward and once more in backward (checkpointed): only this chunk's logits are ever alive.
    student_logits = F.linear(student_hidden, student_weight, student_bias)
    student_log_probs = _log_probs(student_logits, temperature)
    with torch.no_grad():
        teacher_log_probs = _log_probs(teacher_logits_fn(rows), temperature)
    return token_generalized_jsd(student_log_probs, teacher_log_probs, beta)


def chunked_generalized_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    teacher_logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    mask: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    chunk_size: int = 1024,
) -> torch.Tensor:
    """``generalized_jsd_loss`` from last hidden states, computed ``chunk_size`` tokens at a time.

    Student logits are ``student_hidden @ student_weight.T (+ student_bias)``. Only valid (masked-in) tokens are
    processed; each chunk runs under ``torch.utils.checkpoint``, so backward recomputes that chunk's logits instead
    of keeping them: peak memory is O(chunk_size × V) rather than O(N × V). Gradients flow to ``student_hidden``,
    ``student_weight`` and ``student_bias``; the teacher side runs under ``no_grad``. Values and gradients equal
    ``generalized_jsd_loss`` on the full logits.

    Give the teacher either as ``teacher_hidden`` + ``teacher_weight`` (+ ``teacher_bias``), or as
    ``teacher_logits_fn(rows) -> (len(rows), V)``, which receives indices into the flattened tokens (e.g. to slice
    precomputed or remotely served logits).

    Args:
        student_hidden: ``(N, H)`` or ``(B, T, H)`` student hidden states at the positions that predict each token.
        student_weight: ``(V, H)`` student LM-head weight.
        student_bias: Optional ``(V,)``.
        teacher_hidden: Teacher hidden states with the student's leading shape, ``(..., H_t)``.
        teacher_weight: ``(V, H_t)`` teacher LM-head weight.
        teacher_bias: Optional ``(V,)``.
        teacher_logits_fn: Alternative to ``teacher_hidden``/``teacher_weight``.
        mask: Optional leading-shape mask of the tokens that count.
        beta, temperature, reduction: As in ``generalized_jsd_loss``.
        chunk_size: Tokens per chunk.

    Returns:
        Scalar loss, or per-token divergences with the leading shape for ``reduction="none"``.
    """
    _check_options(beta, temperature, reduction)
    if chunk_size < 1:
        raise ValueError(f"`chunk_size` must be >= 1; got {chunk_size}.")
    leading = student_hidden.shape[:-1]
    hidden = student_hidden.reshape(-1, student_hidden.size(-1))  # (N, H)
    if teacher_logits_fn is None:
        if teacher_hidden is None or teacher_weight is None:
            raise ValueError("Give the teacher as `teacher_hidden` + `teacher_weight`, or as `teacher_logits_fn`.")
        if teacher_hidden.shape[:-1] != leading:
            raise ValueError(
                f"`teacher_hidden` leading shape {tuple(teacher_hidden.shape[:-1])} must equal the student's "
                f"{tuple(leading)}."
            )
        flat_teacher = teacher_hidden.reshape(-1, teacher_hidden.size(-1))

        def teacher_logits_fn(rows: torch.Tensor) -> torch.Tensor:
            return F.linear(flat_teacher[rows], teacher_weight, teacher_bias)

    n_tokens = hidden.size(0)
    if mask is None:
        rows = torch.arange(n_tokens, device=hidden.device)
    else:
        if mask.shape != leading:
            raise ValueError(
                f"`mask` shape {tuple(mask.shape)} must equal the hidden states' leading shape {tuple(leading)}."
            )
        rows = mask.reshape(-1).to(torch.bool).nonzero(as_tuple=True)[0]

    # Recompute-in-backward only pays off when something needs a gradient.
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, student_weight, student_bias)
    )
    pieces = []
    for start in range(0, rows.numel(), chunk_size):
        chunk_rows = rows[start : start + chunk_size]
        args = (hidden[chunk_rows], student_weight, student_bias, chunk_rows, teacher_logits_fn, beta, temperature)
        if needs_grad:
            pieces.append(checkpoint(_chunk_divergence, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            pieces.append(_chunk_divergence(*args))
    per_valid = (
        torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
    )

    if reduction == "none":
        out = per_valid.new_zeros(n_tokens).index_copy(0, rows, per_valid)
        return out.reshape(leading)
    return _reduce(per_valid, rows.numel(), student_weight.size(0), reduction)


def _chunk_map(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    fn: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]],
    temperature: float,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    # Checkpointed like _chunk_divergence: this chunk's (rows, V) logits live only while it runs (and again in
    # backward, when they are recomputed).
    return tuple(fn(_log_probs(logits_fn(rows), temperature), rows))


def chunked_token_map(
    student_logits_fn: Callable[[torch.Tensor], torch.Tensor],
    n_tokens: int,
    fn: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]],
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    requires_grad: bool | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Evaluate a per-token function of the student's full-vocabulary log-probs ``chunk_size`` tokens at a time.

    For each chunk of token indices ``rows`` (into ``0 … n_tokens − 1``), ``student_logits_fn(rows)`` gives the
    ``(len(rows), V)`` student logits (differentiable, e.g. ``hidden[rows] @ Wᵀ``) and
    ``fn(log_softmax(logits / temperature) in float32, rows)`` returns a tuple of tensors with ``len(rows)`` leading
    rows (per-token losses, gathered log-probs, detached metrics; a teacher's logits for the same rows can be
    computed inside ``fn`` under ``no_grad``). The pieces are concatenated over chunks. When gradients are needed
    each chunk runs under ``torch.utils.checkpoint`` so its logits are recomputed in backward instead of kept: peak
    memory is O(chunk_size × V), not O(n_tokens × V). ``fn`` must be deterministic (it runs again in backward).

    Args:
        student_logits_fn: ``rows -> (len(rows), V)`` logits.
        n_tokens: Number of tokens N.
        fn: ``(student_log_probs (c, V), rows (c,)) -> tuple of (c, …) tensors``.
        temperature: Softmax temperature (> 0) of the student's log-probs.
        chunk_size: Tokens per chunk.
        requires_grad: Whether to checkpoint (None: when grad mode is on).
        device: Device of ``rows``.

    Returns:
        The concatenated outputs of ``fn`` (``fn`` is called once on an empty ``rows`` when ``n_tokens`` is 0).
    """
    if chunk_size < 1:
        raise ValueError(f"`chunk_size` must be >= 1; got {chunk_size}.")
    if not temperature > 0.0:
        raise ValueError(f"`temperature` must be > 0; got {temperature}.")
    checkpointed = torch.is_grad_enabled() if requires_grad is None else (requires_grad and torch.is_grad_enabled())
    pieces: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, max(int(n_tokens), 1), chunk_size):
        rows = torch.arange(start, min(int(n_tokens), start + chunk_size), device=device)
        if checkpointed and rows.numel():
            out = checkpoint(
                _chunk_map, student_logits_fn, fn, temperature, rows, use_reentrant=False, preserve_rng_state=False
            )
        else:
            out = _chunk_map(student_logits_fn, fn, temperature, rows)
        pieces.append(out)
    if len(pieces) == 1:
        return pieces[0]
    return tuple(torch.cat(parts) for parts in zip(*pieces))


# ----------------------------------------------------------------------------------------------------------------
# Sparse (top-k) supports: a teacher that only exposes its top-k log-probabilities (a generation server)
# ----------------------------------------------------------------------------------------------------------------


def add_tail_bucket(log_probs: torch.Tensor, support_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append a (K+1)-th bucket holding the mass outside the support: log(1 − Σ_k p_k) (TRL's ``loss_add_tail``).

    ``log_probs`` ``(..., K)`` are log-probabilities of the support tokens under the full distribution (−inf where
    ``support_mask`` is False). The sum is clamped just below 1 so the tail stays finite. Returns
    ``(log_probs (..., K+1), mask (..., K+1))``; the tail is always in the support.
    """
    log_sum = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=-1e-7)
    tail = torch.log(-torch.expm1(log_sum))
    return torch.cat([log_probs, tail], dim=-1), torch.cat([support_mask, torch.ones_like(support_mask[..., :1])], -1)


def sparse_support_divergence(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    support_mask: torch.Tensor,
    *,
    beta: float,
    add_tail: bool = True,
) -> torch.Tensor:
    """Generalized JSD restricted to a sparse support of K tokens per position; returns ``(...,)``.

    ``student_log_probs`` / ``teacher_log_probs`` ``(..., K)`` are each model's log-probabilities of the support
    tokens (full-vocabulary log-softmax values); entries where ``support_mask`` is False are ignored. With
    ``add_tail`` each side gets the tail bucket ``1 − Σ_k p_k`` (:func:`add_tail_bucket`), a proper distribution over
    K + 1 outcomes; without it each side is renormalised over the support. Then ``token_generalized_jsd``
    (β = 0 forward KL, β = 1 reverse KL).
    """
    mask = support_mask.to(torch.bool)
    neg_inf = torch.tensor(float("-inf"), dtype=student_log_probs.dtype, device=student_log_probs.device)
    student = torch.where(mask, student_log_probs, neg_inf)
    teacher = torch.where(mask, teacher_log_probs.to(student.dtype), neg_inf)
    if add_tail:
        student, mask = add_tail_bucket(student, mask)
        teacher, _ = add_tail_bucket(teacher, support_mask.to(torch.bool))
    else:
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    # Entries outside the support get the same finite, negligible log-prob on both sides: they contribute exactly 0
    # (exp(-1e4) = 0) and, unlike -inf on both sides (−inf − (−inf) = nan), keep the backward pass finite.
    outside = torch.tensor(-1e4, dtype=student.dtype, device=student.device)
    student = torch.where(mask, student, outside)
    teacher = torch.where(mask, teacher, outside)
    per_token = token_generalized_jsd(student, teacher, beta)
    return torch.nan_to_num(per_token, nan=0.0)


# ----------------------------------------------------------------------------------------------------------------
# IW-OPD: importance-weighted on-policy distillation (sampled-token objective)
# ----------------------------------------------------------------------------------------------------------------


def iw_opd_weights(advantages: torch.Tensor, mask: torch.Tensor, gamma: float, epsilon: float = 1e-8) -> torch.Tensor:
    """IW-OPD prefix weights ``(B, T)`` (Algorithm 1 of "On the Position Bias of On-Policy Distillation").

    With a_t the per-token advantage (teacher minus rollout log-prob of the sampled token) and
    c_t = Σ_{s<t} |a_s| the accumulated prefix discrepancy of the row,
    w_t = 1 + γ · (1 − c_t / max(Σ_s |a_s|, ε)): early tokens weigh up to 1 + γ, tokens after large drift down to 1.
    Masked positions count as a = 0. Returned detached.
    """
    abs_adv = torch.where(mask.to(torch.bool), advantages.abs(), torch.zeros_like(advantages))
    prefix = abs_adv.cumsum(dim=-1) - abs_adv
    total = abs_adv.sum(dim=-1, keepdim=True).clamp(min=epsilon)
    return (1.0 + gamma * (1.0 - prefix / total)).detach()


def iw_opd_loss(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 0.5,
    epsilon: float = 1e-8,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token IW-OPD loss ``−w_t · a_t · log π_θ(y_t)`` on ``(B, T)`` sampled-token log-probs.

    a_t = log π_T(y_t) − log π_rollout(y_t) (the student's own log-prob, detached, when no rollout log-probs are
    given), detached; w_t from :func:`iw_opd_weights`. Its gradient is the reverse-KL policy gradient with
    per-token reward a_t, reweighted by position. Returns ``(loss (B, T) zero at masked positions, advantages w·a,
    weights)``.
    """
    keep = mask.to(torch.bool)
    behaviour = student_logprobs if rollout_logprobs is None else rollout_logprobs
    zeros = torch.zeros_like(student_logprobs)
    a = torch.where(keep, teacher_logprobs.to(zeros.dtype) - behaviour.to(zeros.dtype), zeros).detach()
    weights = iw_opd_weights(a, keep, gamma, epsilon)
    advantages = weights * a
    loss = torch.where(keep, -student_logprobs * advantages, zeros)
    return loss, advantages, weights
