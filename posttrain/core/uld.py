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
- ``group_plan`` / ``chunked_uld_loss`` — the same losses for a whole micro-batch from logits *functions* (e.g.
  ``hidden[positions] @ Wᵀ``), a chunk of aligned groups at a time with recompute in backward, so no
  ``(positions, V)`` probabilities of the batch are ever built (design §3.1). Every loss above is a sum over groups
  (divided by the row's group count), which is what makes it separable into chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = [
    "GroupPlan",
    "align_by_byte_offsets",
    "chunked_uld_loss",
    "hybrid_uld_loss",
    "group_plan",
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


def _sorted_l1_rows(student_probs: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """``(G,)`` Σ_r |sort↓(p_S[g])_r − sort↓(p_T[g])_r| per row (zero-padded to the larger width)."""
    s, t = _pad_to(student_probs.sort(-1, descending=True).values, teacher_probs.sort(-1, descending=True).values)
    return (s - t).abs().sum(-1)


def uld_sorted_l1(student_probs: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """ULD: Σ_{g,r} |sort↓(p_S[g])_r − sort↓(p_T[g])_r| / G over ``(G, V_S)`` and ``(G, V_T)`` (zero-padded to the
    larger vocabulary). Differentiable in both (sorting permutes, so gradients reach every probability)."""
    if student_probs.shape[0] != teacher_probs.shape[0]:
        raise ValueError(f"Both sides need the same number of positions, got {student_probs.shape[0]} and {teacher_probs.shape[0]}.")
    if student_probs.shape[0] == 0:
        return student_probs.sum() * 0.0
    return _sorted_l1_rows(student_probs, teacher_probs).sum() / student_probs.shape[0]


def vocabulary_mapping(student_vocab: dict[str, int], teacher_vocab: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(teacher_ids, student_ids)`` of the token strings both vocabularies contain, sorted by teacher id."""
    pairs = sorted((t_id, student_vocab[tok]) for tok, t_id in teacher_vocab.items() if tok in student_vocab)
    teacher_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    student_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return teacher_ids, student_ids


def _matched_jsd_rows(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """``(G,)`` generalized JSD on (unnormalised) probability columns, Σ over each row's entries (TRL's
    probability-input ``generalized_jsd_loss``: log of probabilities clamped at 1e-8)."""
    log_s = torch.log(student.clamp_min(1e-8))
    log_t = torch.log(teacher.clamp_min(1e-8))
    if beta == 0:
        terms = log_t.exp() * (log_t - log_s)
    elif beta == 1:
        terms = log_s.exp() * (log_s - log_t)
    else:
        log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
        terms = beta * log_t.exp() * (log_t - log_m) + (1 - beta) * log_s.exp() * (log_s - log_m)
    return terms.sum(-1)


def _matched_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """Generalized JSD on (unnormalised) probability columns, Σ over entries / rows."""
    return _matched_jsd_rows(student, teacher, beta).sum() / max(student.shape[0], 1)


def _hybrid_rows(
    student_probs: torch.Tensor,
    teacher_probs: torch.Tensor,
    teacher_ids: torch.Tensor,
    student_ids: torch.Tensor,
    beta: float,
    matched_weight: float | None,
    unmatched_weight: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row ``(G,)``: (w_m·matched + w_u·unmatched, matched, unmatched) of :func:`hybrid_uld_loss`."""
    device = student_probs.device
    teacher_ids, student_ids = teacher_ids.to(device), student_ids.to(device)
    zero = student_probs.sum(-1) * 0.0
    matched = zero
    if teacher_ids.numel():
        matched = _matched_jsd_rows(student_probs[:, student_ids], teacher_probs[:, teacher_ids], beta)
    t_keep = torch.ones(teacher_probs.shape[-1], dtype=torch.bool, device=device)
    s_keep = torch.ones(student_probs.shape[-1], dtype=torch.bool, device=device)
    t_keep[teacher_ids] = False
    s_keep[student_ids] = False
    unmatched = zero
    if t_keep.any() and s_keep.any():
        unmatched = _sorted_l1_rows(student_probs[:, s_keep], teacher_probs[:, t_keep])
    if matched_weight is None:
        matched_weight = teacher_ids.numel() / max(1, teacher_probs.shape[-1])
        unmatched_weight = 1.0 - matched_weight
    return matched_weight * matched + unmatched_weight * unmatched, matched, unmatched


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
    total, matched, unmatched = _hybrid_rows(
        student_probs, teacher_probs, teacher_ids, student_ids, beta, matched_weight, unmatched_weight
    )
    n = max(student_probs.shape[0], 1)
    return total.sum() / n, matched.sum() / n, unmatched.sum() / n


# ----------------------------------------------------------------------------------------------------------------
# Chunked over groups: the micro-batch's ULD without its full-vocabulary probabilities
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class GroupPlan:
    """Where each aligned group's merged distribution comes from, on one side (flat positions into that side's
    logits): ``base`` ``(G,)`` the position whose full distribution is the group's, times the probabilities of
    ``scalar_tokens`` at ``scalar_positions`` ``(G, M)`` where ``scalar_mask`` (see :func:`merge_group_probs`)."""

    base: torch.Tensor
    scalar_positions: torch.Tensor
    scalar_tokens: torch.Tensor
    scalar_mask: torch.Tensor

    def __len__(self) -> int:
        return int(self.base.shape[0])

    def positions_per_group(self) -> list[int]:
        return (1 + self.scalar_mask.sum(-1)).tolist()

    def to(self, device: torch.device | str) -> GroupPlan:
        return GroupPlan(*(t.to(device) for t in (self.base, self.scalar_positions, self.scalar_tokens, self.scalar_mask)))

    def select(self, start: int, end: int) -> GroupPlan:
        return GroupPlan(*(t[start:end] for t in (self.base, self.scalar_positions, self.scalar_tokens, self.scalar_mask)))

    @staticmethod
    def concat(plans: Sequence[GroupPlan]) -> GroupPlan:
        width = max([p.scalar_positions.shape[1] for p in plans] + [0])
        padded = [
            [F.pad(t, (0, width - t.shape[1])) for t in (p.scalar_positions, p.scalar_tokens, p.scalar_mask)]
            for p in plans
        ]
        if not plans:
            empty = torch.zeros(0, 0, dtype=torch.long)
            return GroupPlan(torch.zeros(0, dtype=torch.long), empty, empty, empty.bool())
        return GroupPlan(
            torch.cat([p.base for p in plans]), *(torch.cat([row[k] for row in padded]) for k in range(3))
        )


def group_plan(
    groups: Sequence[Sequence[int]], token_ids: Sequence[int], strategy: str = "observed", offset: int = 0
) -> GroupPlan:
    """The :class:`GroupPlan` of :func:`merge_group_probs` for one row: group positions index the row's
    probabilities, whose row ``k`` is flat position ``offset + k`` of the logits. Groups must be non-empty."""
    if strategy not in _MERGE_STRATEGIES:
        raise ValueError(f"Unknown token merge strategy {strategy!r}; choose one of {_MERGE_STRATEGIES}.")
    base, scalars = [], []
    for group in groups:
        if not group:
            raise ValueError("group_plan needs non-empty groups (drop the empty pairs first).")
        b, rest = (group[-1], group[:-1]) if (strategy == "bayesian" and len(group) > 1) else (group[0], group[1:])
        base.append(offset + b)
        scalars.append([(offset + j, int(token_ids[j])) for j in rest])
    width = max([len(x) for x in scalars] + [0])
    positions = torch.zeros(len(groups), width, dtype=torch.long)
    tokens = torch.zeros(len(groups), width, dtype=torch.long)
    mask = torch.zeros(len(groups), width, dtype=torch.bool)
    for g, pairs in enumerate(scalars):
        for m, (pos, tok) in enumerate(pairs):
            positions[g, m], tokens[g, m], mask[g, m] = pos, tok, True
    return GroupPlan(torch.tensor(base, dtype=torch.long), positions, tokens, mask)


def _merged(logits_fn: Callable[[torch.Tensor], torch.Tensor], plan: GroupPlan, temperature: float, eps: float):
    """``(c, V)`` merged probabilities of a chunk of groups: base softmax × Π clamp(p(scalar token), eps)."""
    device = plan.base.device
    logits = logits_fn(plan.base)
    dtype = torch.promote_types(logits.dtype, torch.float32)  # at least float32 (bf16 heads)
    probs = F.softmax(logits.to(dtype) / temperature, dim=-1)
    if not bool(plan.scalar_mask.any()):
        return probs
    positions, tokens = plan.scalar_positions[plan.scalar_mask], plan.scalar_tokens[plan.scalar_mask]
    log_probs = F.log_softmax(logits_fn(positions).to(dtype) / temperature, dim=-1)
    picked = log_probs.gather(-1, tokens[:, None].to(device)).squeeze(-1).exp().clamp_min(eps)
    factors = torch.ones(plan.scalar_mask.shape, dtype=picked.dtype, device=device)
    factors = factors.masked_scatter(plan.scalar_mask.to(device), picked)
    return probs * factors.prod(-1, keepdim=True)


def _uld_chunk(
    student_logits_fn, teacher_logits_fn, student_plan, teacher_plan, weights, temperatures, mapping, beta,
    matched_weight, unmatched_weight, eps,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    student = _merged(student_logits_fn, student_plan, temperatures[0], eps)
    with torch.no_grad():
        teacher = _merged(teacher_logits_fn, teacher_plan, temperatures[1], eps)
    if mapping is None:
        total = _sorted_l1_rows(student, teacher)
        matched = unmatched = total.detach() * 0.0
    else:
        total, matched, unmatched = _hybrid_rows(
            student, teacher, mapping[0], mapping[1], beta, matched_weight, unmatched_weight
        )
    return (total * weights).sum(), (matched.detach() * weights).sum(), (unmatched.detach() * weights).sum()


def chunked_uld_loss(
    student_logits_fn: Callable[[torch.Tensor], torch.Tensor],
    teacher_logits_fn: Callable[[torch.Tensor], torch.Tensor],
    student_plan: GroupPlan,
    teacher_plan: GroupPlan,
    group_weights: torch.Tensor,
    *,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    mapping: tuple[torch.Tensor, torch.Tensor] | None = None,
    beta: float = 0.5,
    matched_weight: float | None = None,
    unmatched_weight: float | None = None,
    chunk_size: int = 1024,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ_g w_g · ULD term of aligned group g, computed a chunk of groups at a time: ``(total, matched, unmatched)``.

    Group g's merged distributions are :func:`merge_group_probs` of ``softmax(logits / temperature)`` as described
    by the two plans (``*_logits_fn(flat positions) -> (n, V)``; the student's is differentiable, the teacher's runs
    under ``no_grad``). Its term is the sorted L1 Σ_r |sort(p_S) − sort(p_T)| (:func:`uld_sorted_l1` without the
    division by G), or with ``mapping = (teacher_ids, student_ids)`` the hybrid w_m·matched + w_u·unmatched of
    :func:`hybrid_uld_loss` (``matched`` / ``unmatched`` are returned detached, weighted the same way; both 0 without
    a mapping). With ``w_g = 1 / (G_row · rows)`` this is the mean over rows of each row's ULD loss.

    Groups are taken in order until a chunk would need more than ``chunk_size`` positions (base + scalars; at least
    one group); each chunk runs under ``torch.utils.checkpoint`` when gradients are on, so its logits are recomputed
    in backward: peak memory O(chunk_size × V) whatever the batch.
    """
    if len(student_plan) != len(teacher_plan) or len(student_plan) != group_weights.shape[0]:
        raise ValueError(
            f"Both plans and the weights need one entry per group, got {len(student_plan)}, {len(teacher_plan)} and "
            f"{group_weights.shape[0]}."
        )
    if chunk_size < 1:
        raise ValueError(f"`chunk_size` must be >= 1; got {chunk_size}.")
    cost = [max(a, b) for a, b in zip(student_plan.positions_per_group(), teacher_plan.positions_per_group())]
    bounds, start, used = [], 0, 0
    for g, c in enumerate(cost):
        if g > start and used + c > chunk_size:
            bounds.append((start, g))
            start, used = g, 0
        used += c
    if start < len(cost):
        bounds.append((start, len(cost)))
    temperatures = (student_temperature, teacher_temperature)
    totals = []
    for a, b in bounds:
        args = (
            student_logits_fn, teacher_logits_fn, student_plan.select(a, b), teacher_plan.select(a, b),
            group_weights[a:b], temperatures, mapping, beta, matched_weight, unmatched_weight, eps,
        )  # fmt: skip
        if torch.is_grad_enabled():
            totals.append(checkpoint(_uld_chunk, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            totals.append(_uld_chunk(*args))
    if not totals:
        zero = group_weights.new_zeros((), dtype=torch.float32)
        return zero, zero, zero
    return tuple(torch.stack(parts).sum() for parts in zip(*totals))
