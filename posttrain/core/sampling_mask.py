"""The sampler's kept support under top-k / top-p / min-p, recorded per token and replayed by the trainer
("keep sampling mask", issue 40).

With truncated sampling the sampler draws token t from q(v) = p(v) · 1[v ∈ K] / S, K the kept set and S its mass,
while the trainer's π_θ is the full softmax p. The importance ratio can be put back on one scale (the kept-mass
correction, :func:`posttrain.core.importance.truncated_log_kept_mass`), but the policy that is trained is still p,
not the q that sampled. Replaying the mask means the trainer evaluates every log-prob (π_θ, π_old, π_ref), the
entropy and the KL to the reference as a log-softmax over K only:

    log π_K(y) = z_y − logsumexp_{v ∈ K} z_v            (z: the temperature-scaled logits)

so on-policy π_old = q exactly and the ratio is 1 on every token without any correction.

**Description of K per token.** Every transformers truncation warper keeps a set of the form {v : s_v ≥ τ} of the
processed scores s (top-k keeps ties at the k-th score; min-p keeps p_v ≥ min_p · p_max; top-p keeps a prefix of
the scores sorted in decreasing order). Two encodings, chosen per token:

* **ids** — when |K| ≤ ``max_ids`` (``SAMPLING_MASK_MAX_IDS``, 16): the kept ids themselves, padded with −1. Exact
  whatever the trainer's numerics or weights, and the common case for real models (top_k ≤ 16, or a peaked
  top-p / min-p distribution). The threshold is then +inf.
* **threshold** — otherwise: τ halfway between the smallest kept score and the largest dropped one, on the sampler's
  processed-score scale (logits / temperature). The trainer keeps {v : z_v ≥ τ} of its own temperature-scaled
  logits. The midpoint makes the replay robust to numeric differences smaller than half the score gap at the cut
  (sampler and trainer run different kernels); 4 bytes per token however large K is. It is exact for the same
  weights up to that margin; off-policy (``num_iterations > 1``) it is the kept set of the current logits under
  the sampler's cut. With a ``repetition_penalty`` the sampler's scores of repeated tokens differ from the trainer's
  logits, so the threshold form is approximate there (the ids form stays exact).

**Unknown support** (threshold −inf, no ids): the full softmax, as without the mask. That is what the trainer
assumes for tokens no sampler described: ``rollout_func`` completions, vLLM servers, the ``transformers`` backend,
a step where nothing was truncated, and a cut that no threshold separates (a top-p cut between tied scores, with
more than ``max_ids`` kept). Those tokens keep the kept-mass correction of the importance ratio.

**Never empty.** The kernels always keep the sampled (label) token: the sampler drew it from K, so this changes
nothing when the description is exact and keeps log π_K finite when numerics move a threshold-form boundary.
"""

from __future__ import annotations

import torch

__all__ = [
    "SAMPLING_MASK_MAX_IDS",
    "apply_sampling_mask",
    "collate_sampling_mask",
    "describe_kept_support",
    "describe_top_k_support",
    "sampling_mask_entries",
    "sampling_mask_keep",
    "support_columns",
    "truncate_top_k",
]

SAMPLING_MASK_MAX_IDS = 16  # ids per token before switching to the threshold form (payload: 16 ints per token at most)

# One token's description on the wire (JSON) and in ``Completions.sampling_mask``: the kept ids, the threshold, or
# None (unknown: full softmax).
SamplingMaskEntry = list[int] | float | None


def describe_kept_support(
    untruncated: torch.Tensor,
    truncated: torch.Tensor,
    max_ids: int = SAMPLING_MASK_MAX_IDS,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the compact description of the set truncation kept (see the module docstring).

    Args:
        untruncated: ``(R, V)`` processed scores before top-k / top-p / min-p (after penalty and temperature).
        truncated: ``(R, V)`` the same after truncation (−inf outside the kept set).
        max_ids: largest kept set recorded as ids.
        out: an ``(R, V)`` float buffer like ``truncated`` to use as scratch (a decode loop reuses one: a fresh
            vocabulary-sized tensor per step costs page faults).

    Returns:
        ``(ids (R, max_ids) int32, −1 padded, threshold (R,) float32)``: ids form (threshold +inf), threshold form
        (ids all −1), or unknown (threshold −inf, ids all −1) when nothing was truncated or no threshold separates
        the kept scores from the dropped ones.
    """
    rows, vocab = truncated.shape
    # Float 1.0 / 0.0 masks and arithmetic instead of bool masks with where / masked_fill: on CPU the latter are
    # ~10× slower per element, and these run over (R, V) at every decode step (V = 151 936 for Qwen).
    scratch = torch.empty_like(truncated) if out is None else out
    dropped = torch.eq(truncated, float("-inf"), out=scratch)  # (R, V) 1.0 where dropped
    small = dropped.sum(-1) >= vocab - max_ids  # (R,) |K| ≤ max_ids
    any_small, all_small = torch.stack([small.any(), small.all()]).tolist()  # one host read: skip unneeded passes
    ids = torch.full((rows, max_ids), -1, dtype=torch.int32, device=truncated.device)
    if any_small:
        k = min(max_ids, vocab)
        values, top = truncated.topk(k, dim=-1)  # (R, k), decreasing: the kept ids first
        keep = (values != float("-inf")) & small.unsqueeze(-1)
        ids[:, :k] = torch.where(keep, top, -1).to(torch.int32)
    threshold = torch.full((rows,), float("inf"), dtype=torch.float32, device=truncated.device)
    if not all_small:
        min_kept = truncated.nan_to_num(neginf=float("inf")).amin(-1)  # (R,) dropped scores are −inf there
        # kept scores pushed 1e30 down, dropped ones exact: the max is the largest dropped score (≤ −1e29: none)
        max_dropped = torch.add(untruncated, dropped.sub_(1.0), alpha=1e30).amax(-1)  # (R,)
        max_dropped.masked_fill_(max_dropped < -1e29, float("-inf"))
        threshold = (min_kept + max_dropped).float().mul_(0.5)  # −inf when nothing was dropped: the full softmax
        threshold.masked_fill_(max_dropped >= min_kept, float("-inf"))  # a tie at the cut: no threshold separates it
        threshold.masked_fill_(small, float("inf"))
    return ids, threshold


def truncate_top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k truncation that also returns the kept ids: one ``topk`` for both (issue 40's cost work).

    The truncated scores are the top-k warper's, bit for bit: every score below the k-th largest becomes −inf (ties
    at the k-th score are kept). One extra candidate, the (k + 1)-th, tells whether a tie crosses the cut.

    Args:
        scores: ``(R, V)`` processed scores (after penalty and temperature).
        k: the number of tokens kept, ``1 ≤ k < V``.

    Returns:
        ``(truncated (R, V), top ids (R, k) int64 in decreasing score order, untied (R,) bool)``; ``untied`` rows keep
        exactly their top ids (the k-th score is strictly above the (k + 1)-th).
    """
    vocab = scores.shape[-1]
    if not 1 <= k < vocab:
        raise ValueError(f"truncate_top_k needs 1 <= k < V = {vocab}, got k = {k}.")
    values, top = scores.topk(k + 1, dim=-1)  # (R, k + 1), decreasing
    truncated = scores.masked_fill(scores < values[:, k - 1 : k], float("-inf"))
    return truncated, top[:, :k], values[:, k] < values[:, k - 1]


def describe_top_k_support(
    truncated: torch.Tensor, top: torch.Tensor, max_ids: int = SAMPLING_MASK_MAX_IDS
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`describe_kept_support` for rows whose kept set lies within known candidate ids, without a pass over
    the vocabulary: after a top-k cut (:func:`truncate_top_k`, untied rows), possibly narrowed further by top-p /
    min-p, the kept set is the candidates whose truncated score is still finite.

    Args:
        truncated: ``(R, V)`` the final truncated scores (−inf outside the kept set).
        top: ``(R, k)`` candidate ids containing every kept id, ``k ≤ max_ids``.

    Returns:
        ``(ids (R, max_ids) int32, −1 padded, threshold (R,) float32 +inf)``: the ids form for every row.
    """
    rows, k = top.shape
    if k > max_ids:
        raise ValueError(f"describe_top_k_support takes at most max_ids = {max_ids} candidates, got {k}.")
    ids = torch.full((rows, max_ids), -1, dtype=torch.int32, device=truncated.device)
    kept = truncated.gather(-1, top) != float("-inf")  # (R, k)
    ids[:, :k] = torch.where(kept, top, -1).to(torch.int32)
    return ids, torch.full((rows,), float("inf"), dtype=torch.float32, device=truncated.device)


def sampling_mask_entries(ids: torch.Tensor, threshold: torch.Tensor) -> list[SamplingMaskEntry]:
    """``(ids (R, K), threshold (R,))`` → one entry per row: the id list, the float threshold, or None (unknown)."""
    out: list[SamplingMaskEntry] = []
    for row_ids, tau in zip(ids.tolist(), threshold.tolist()):
        if tau == float("inf"):
            out.append([i for i in row_ids if i >= 0])
        elif tau == float("-inf"):
            out.append(None)
        else:
            out.append(tau)
    return out


def collate_sampling_mask(
    rows: list[list[SamplingMaskEntry] | None], width: int, max_ids: int = SAMPLING_MASK_MAX_IDS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tensors of per-token entries: ``(ids (B, width, max_ids) int32, threshold (B, width) float32)``.

    A row of None (a completion no sampler described) and padding are unknown (full softmax). An id list longer than
    ``max_ids`` raises: the payload is bounded by design.
    """
    inf = float("inf")
    ids = [[[-1] * max_ids for _ in range(width)] for _ in rows]  # host lists, one tensor each at the end
    threshold = [[-inf] * width for _ in rows]
    for b, row in enumerate(rows):
        for t, entry in enumerate((row or [])[:width]):
            if entry is None:
                continue
            if isinstance(entry, (list, tuple)):
                if len(entry) > max_ids:
                    raise ValueError(
                        f"A sampling-mask entry lists {len(entry)} kept ids, more than the {max_ids} allowed; a "
                        "larger kept set must be sent as its score threshold."
                    )
                if entry:
                    ids[b][t][: len(entry)] = entry
                    threshold[b][t] = inf
            else:
                threshold[b][t] = float(entry)
    return (
        torch.tensor(ids, dtype=torch.int32).reshape(len(rows), width, max_ids),
        torch.tensor(threshold, dtype=torch.float32).reshape(len(rows), width),
    )


def sampling_mask_keep(
    z: torch.Tensor,
    labels: torch.Tensor,
    ids: torch.Tensor,
    threshold: torch.Tensor,
    v0: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``(c, b)``: which of the columns ``[v0, v0 + b)`` of ``z`` each row keeps.

    keep_v = z_v ≥ τ  or  v ∈ ids  or  v = label. ``out``: a bool buffer of at least ``c · (b + 1)`` elements (the
    extra column absorbs ids outside the block, so the scatter writes only True values, deterministically).

    Args:
        z: ``(c, b)`` temperature-scaled logits of one chunk (one vocabulary block of it when tiled).
        labels: ``(c,)`` the sampled tokens (full-vocabulary ids).
        ids: ``(c, K)`` kept ids, −1 padded.
        threshold: ``(c,)`` τ (+inf: ids only; −inf: everything).
    """
    c, b = z.shape
    buf = torch.empty(c * (b + 1), dtype=torch.bool, device=z.device) if out is None else out
    keep = buf[: c * (b + 1)].view(c, b + 1)
    torch.ge(z, threshold.unsqueeze(-1).to(z.dtype), out=keep[:, :b])
    keep.scatter_(1, support_columns(ids, labels, v0, b), True)
    return keep[:, :b]


def support_columns(ids: torch.Tensor, labels: torch.Tensor, v0: int, b: int) -> torch.Tensor:
    """``(c, K + 1)`` block-local columns of each row's kept ids and label for the block ``[v0, v0 + b)``; −1
    padding and ids outside the block map to column ``b`` (a spare column the caller's buffer has)."""
    cols = torch.cat([ids.long(), labels.long().unsqueeze(-1)], dim=1) - v0
    return torch.where((cols >= 0) & (cols < b), cols, b)


def apply_sampling_mask(
    z: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor, threshold: torch.Tensor
) -> torch.Tensor:
    """``z`` ``(N, V)`` with −inf outside each row's kept support (out of place, differentiable: the gradient of a
    masked logit is 0). The reference for the chunked kernels and the full-logits path."""
    keep = sampling_mask_keep(z.detach(), labels, ids, threshold)
    return z.masked_fill(~keep, float("-inf"))
