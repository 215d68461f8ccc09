"""Cross-tokenizer distillation math (Universal Logit Distillation, ULD; Boizard et al. 2024,
https://huggingface.co/papers/2402.12030, as extended by TRL's GOLD trainer).

A student and a teacher with different tokenizers see the same completion text split into different tokens and
predict over different vocabularies. ULD compares the two next-token distributions without a vocabulary mapping:
both are sorted (largest probability first), the shorter one is zero-padded, and the loss is the L1 distance.

What lives here:

- ``align_by_byte_offsets`` — group consecutive tokens of each side until both reach the same byte boundary of the
  text (the points where the tokenizers agree on a split).
- ``merge_group_probs`` — one distribution per group: ``"observed"`` multiplies the first position's distribution
  by the probabilities of the group's later actual tokens; ``"bayesian"`` (chain rule, with logits shifted so
  ``probs[k]`` predicts ``token_ids[k]``) multiplies the last position's distribution by those of the earlier ones.
- ``uld_sorted_l1`` — Σ |sort(p_S) − sort(p_T)| / positions (the ULD loss).
- ``vocabulary_mapping`` / ``hybrid_uld_loss`` — tokens whose string exists in both vocabularies are compared
  directly (generalized JSD on the matched columns), the rest with the sorted L1; weights are the matched share of
  the teacher vocabulary unless given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "align_by_byte_offsets",
    "hybrid_uld_loss",
    "merge_group_probs",
    "uld_sorted_l1",
    "vocabulary_mapping",
]

_MERGE_STRATEGIES = ("observed", "bayesian")


def align_by_byte_offsets(
    student_offsets: Sequence[Sequence[int]], teacher_offsets: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """Groups of student and teacher token positions covering the same text span.

    ``*_offsets[i] = (start, end)`` byte offsets of token ``i`` in a shared text. Walk both sides, advancing the one
    whose current token ends earlier; a group closes when both end at the same byte. Leftover tokens of either side
    form a final group. Returns ``(student_groups, teacher_groups)`` of equal length.
    """
    s_groups: list[list[int]] = []
    t_groups: list[list[int]] = []
    s_start = t_start = s = t = 0
    n_s, n_t = len(student_offsets), len(teacher_offsets)
    while s < n_s and t < n_t:
        s_end, t_end = student_offsets[s][1], teacher_offsets[t][1]
        if s_end < t_end:
            s += 1
        elif s_end > t_end:
            t += 1
        else:
            s += 1
            t += 1
            s_groups.append(list(range(s_start, s)))
            t_groups.append(list(range(t_start, t)))
            s_start, t_start = s, t
    if s < n_s or t < n_t:
        s_groups.append(list(range(s_start, n_s)))
        t_groups.append(list(range(t_start, n_t)))
    return s_groups, t_groups


def merge_group_probs(
    probs: torch.Tensor,
    groups: Sequence[Sequence[int]],
    token_ids: Sequence[int],
    strategy: str = "observed",
    eps: float = 1e-8,
) -> torch.Tensor:
    """``(len(groups), V)`` one (unnormalised) distribution per group of positions of ``probs`` ``(T, V)``.

    A single-position group keeps its row. For ``[i, …, i + k]``: ``"observed"`` → ``probs[i] · Π_{j>i}
    probs[j, token_ids[j]]``; ``"bayesian"`` → ``probs[i + k] · Π_{j<i+k} probs[j, token_ids[j]]`` (scalars clamped
    at ``eps``). An empty group is a zero row.
    """
    if strategy not in _MERGE_STRATEGIES:
        raise ValueError(f"Unknown token merge strategy {strategy!r}; choose one of {_MERGE_STRATEGIES}.")
    rows = []
    for group in groups:
        if not group:
            rows.append(torch.zeros_like(probs[0]))
            continue
        if len(group) == 1:
            rows.append(probs[group[0]])
            continue
        base, scalars = (group[-1], group[:-1]) if strategy == "bayesian" else (group[0], group[1:])
        factor = probs.new_ones(())
        for j in scalars:
            factor = factor * probs[j, token_ids[j]].clamp_min(eps)
        rows.append(probs[base] * factor)
    if not rows:
        return probs.new_zeros(0, probs.shape[-1])
    return torch.stack(rows)


def _pad_to(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(a.shape[-1], b.shape[-1])
    return F.pad(a, (0, width - a.shape[-1])), F.pad(b, (0, width - b.shape[-1]))


def uld_sorted_l1(student_probs: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """ULD: Σ_{g,r} |sort↓(p_S[g])_r − sort↓(p_T[g])_r| / G over ``(G, V_S)`` and ``(G, V_T)`` (zero-padded to the
    larger vocabulary). Differentiable in both (sorting permutes, so gradients reach every probability)."""
    if student_probs.shape[0] != teacher_probs.shape[0]:
        raise ValueError(f"Both sides need the same number of positions, got {student_probs.shape[0]} and {teacher_probs.shape[0]}.")
    if student_probs.shape[0] == 0:
        return student_probs.sum() * 0.0
    s, t = _pad_to(student_probs.sort(-1, descending=True).values, teacher_probs.sort(-1, descending=True).values)
    return (s - t).abs().sum() / student_probs.shape[0]


def vocabulary_mapping(student_vocab: dict[str, int], teacher_vocab: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(teacher_ids, student_ids)`` of the token strings both vocabularies contain, sorted by teacher id."""
    pairs = sorted((t_id, student_vocab[tok]) for tok, t_id in teacher_vocab.items() if tok in student_vocab)
    teacher_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    student_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return teacher_ids, student_ids


def _matched_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """Generalized JSD on (unnormalised) probability columns, Σ over entries / rows (TRL's probability-input
    ``generalized_jsd_loss``: log of probabilities clamped at 1e-8)."""
    log_s = torch.log(student.clamp_min(1e-8))
    log_t = torch.log(teacher.clamp_min(1e-8))
    if beta == 0:
        terms = log_t.exp() * (log_t - log_s)
    elif beta == 1:
        terms = log_s.exp() * (log_s - log_t)
    else:
        log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
        terms = beta * log_t.exp() * (log_t - log_m) + (1 - beta) * log_s.exp() * (log_s - log_m)
    return terms.sum() / max(student.shape[0], 1)


def hybrid_uld_loss(
    student_probs: torch.Tensor,
    teacher_probs: torch.Tensor,
    teacher_ids: torch.Tensor,
    student_ids: torch.Tensor,
    *,
    beta: float = 0.5,
    matched_weight: float | None = None,
    unmatched_weight: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hybrid ULD on aligned ``(G, V_S)`` / ``(G, V_T)`` probabilities: ``(total, matched, unmatched)``.

    matched = generalized JSD (β) between ``student_probs[:, student_ids]`` and ``teacher_probs[:, teacher_ids]``
    (Σ over entries / G); unmatched = :func:`uld_sorted_l1` of the remaining columns of each side. total =
    w_m·matched + w_u·unmatched with w_m = |matched| / V_T and w_u = 1 − w_m unless both weights are given.
    """
    device = student_probs.device
    teacher_ids, student_ids = teacher_ids.to(device), student_ids.to(device)
    zero = student_probs.sum() * 0.0
    matched = _matched_jsd(student_probs[:, student_ids], teacher_probs[:, teacher_ids], beta) if teacher_ids.numel() else zero
    t_keep = torch.ones(teacher_probs.shape[-1], dtype=torch.bool, device=device)
    s_keep = torch.ones(student_probs.shape[-1], dtype=torch.bool, device=device)
    t_keep[teacher_ids] = False
    s_keep[student_ids] = False
    unmatched = zero
    if t_keep.any() and s_keep.any():
        unmatched = uld_sorted_l1(student_probs[:, s_keep], teacher_probs[:, t_keep])
    if matched_weight is None:
        matched_weight = teacher_ids.numel() / max(1, teacher_probs.shape[-1])
        unmatched_weight = 1.0 - matched_weight
    return matched_weight * matched + unmatched_weight * unmatched, matched, unmatched
