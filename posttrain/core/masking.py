"""Masked and NaN-aware reductions, and completion masks cut at the first EOS.

Every loss, advantage and metric in the online-RL code reduces over "valid" positions only: completion tokens before
(and including) the first EOS, minus tool-result tokens, minus masked-out sequences. The helpers here make those
reductions safe: positions where the mask is 0 never leak into a result, even when they hold NaN or inf (padding
positions often do), and an empty mask gives 0 (means) or NaN (spreads), never an exception.

NaN-aware helpers (`nanstd`, `nanmin`, `nanmax`) follow TRL's semantics: rewards that a reward function declined to
score (``None`` -> NaN) are ignored; an all-NaN input gives NaN.
"""

from __future__ import annotations

import torch

__all__ = [
    "completion_mask_from_eos",
    "masked_batch_mean",
    "masked_mean",
    "masked_std",
    "masked_sum",
    "masked_var",
    "masked_where",
    "nanmax",
    "nanmin",
    "nanstd",
]


def masked_where(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Return ``x * mask`` with masked-out positions forced to exactly 0 (broadcasting ``x`` against ``mask``).

    Plain ``x * mask`` turns a NaN/inf at a padding position into NaN; ``torch.where`` does not, and also gives
    those positions a zero gradient. A fractional mask acts as a weight.

    Args:
        x: values, any shape broadcastable with ``mask`` (e.g. ``(B, T)`` or ``(B, 1)``).
        mask: 0/1 (or weight) tensor, e.g. ``(B, T)``.
    """
    mask = mask.to(x.dtype) if x.is_floating_point() else mask
    return torch.where(mask != 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m over ``dim`` (all dims if None), ignoring masked-out positions even if they hold NaN/inf.

    Args:
        x: values, broadcastable with ``mask``, e.g. ``(B, T)``.
        mask: ``(B, T)`` 0/1 (or weights).
        dim: reduction dim; ``None`` sums everything.

    Returns:
        Scalar tensor, or the tensor reduced over ``dim``.
    """
    masked = masked_where(x, mask)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m / Σ m over ``dim``; 0 (not NaN) where the mask is empty.

    Args:
        x: values, broadcastable with ``mask``, e.g. ``(B, T)``. A ``(B, 1)`` ``x`` counts once per valid token.
        mask: ``(B, T)`` 0/1 (or weights).
        dim: reduction dim; ``None`` averages over everything.

    Returns:
        Scalar, or the tensor reduced over ``dim`` (e.g. ``(B,)`` for ``dim=-1``).
    """
    if not x.is_floating_point():
        x = x.float()
    x, mask = torch.broadcast_tensors(x, mask.to(x.dtype))
    num = masked_sum(x, mask, dim)
    den = mask.sum() if dim is None else mask.sum(dim=dim)
    den = den.to(num.dtype)
    return torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(num))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, dim: int | None = None) -> torch.Tensor:
    """Variance of the valid entries: mean_m((x − mean_m(x))²), times n/(n−1) when ``unbiased`` (Bessel).

    Args:
        x: values broadcastable with ``mask``, e.g. ``(B, T)``.
        mask: ``(B, T)`` 0/1.
        unbiased: apply Bessel's correction n/(n−1), with n = Σ m.
        dim: reduction dim; ``None`` uses every entry.

    Returns:
        Scalar (or reduced tensor). Undefined cases give NaN: an empty mask, or n ≤ 1 with ``unbiased=True``.
    """
    x, mask = torch.broadcast_tensors(x, mask.to(x.dtype))
    mean = masked_mean(x, mask, dim)
    centered = x - (mean if dim is None else mean.unsqueeze(dim))
    var = masked_mean(centered**2, mask, dim)
    n = (mask.sum() if dim is None else mask.sum(dim=dim)).to(var.dtype)
    nan = torch.full_like(var, float("nan"))
    if unbiased:
        return torch.where(n > 1, var * n / (n - 1).clamp(min=1e-12), nan)
    return torch.where(n > 0, var, nan)


def masked_std(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, dim: int | None = None) -> torch.Tensor:
    """√masked_var (see :func:`masked_var`; NaN where the variance is undefined)."""
    return masked_var(x, mask, unbiased=unbiased, dim=dim).sqrt()


def masked_batch_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of a per-token or per-sequence indicator, as TRL reduces clip ratios.

    A ``(B, 1)`` tensor (sequence-level importance sampling) is averaged over sequences; a ``(B, T)`` tensor over
    valid tokens (Σ x·m / max(Σ m, 1)).

    Args:
        x: ``(B, T)`` or ``(B, 1)`` values (e.g. ``is_low_clipped`` from a policy objective).
        mask: ``(B, T)`` 0/1.
    """
    if x.dim() >= 2 and x.shape[-1] == 1 and mask.shape[-1] != 1:
        return x.float().mean()
    return masked_mean(x.float(), mask)


def nanstd(tensor: torch.Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected standard deviation over the non-NaN entries (TRL's ``nanstd``), of all entries or along
    ``dim``.

    σ = sqrt( n/(n−1) · nanmean((x − nanmean(x))²) ), n = number of non-NaN entries.

    Returns:
        A scalar (``dim=None``) or the reduced tensor; NaN where n ≤ 1 (the unbiased estimate is undefined), as in
        TRL.
    """
    if dim is None:
        variance = torch.nanmean((tensor - torch.nanmean(tensor)) ** 2)
        count = (~torch.isnan(tensor)).sum()
        if keepdim:
            variance, count = variance.reshape([1] * tensor.dim()), count.reshape([1] * tensor.dim())
    else:
        mean = torch.nanmean(tensor, dim=dim, keepdim=True)
        variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=keepdim)
        count = (~torch.isnan(tensor)).sum(dim=dim, keepdim=keepdim)
    variance = variance * count / (count - 1)  # n=1 gives 0·inf = NaN, n=0 gives NaN: both intended
    return torch.sqrt(variance)


def nanmin(tensor: torch.Tensor) -> torch.Tensor:
    """Minimum over non-NaN entries; NaN if every entry is NaN (or the tensor is empty)."""
    valid = tensor[~torch.isnan(tensor)]
    if valid.numel() == 0:
        return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    return valid.min()


def nanmax(tensor: torch.Tensor) -> torch.Tensor:
    """Maximum over non-NaN entries; NaN if every entry is NaN (or the tensor is empty)."""
    valid = tensor[~torch.isnan(tensor)]
    if valid.numel() == 0:
        return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    return valid.max()


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """Mask that keeps each completion up to and including its first EOS token.

    m[i, t] = 1 if t ≤ first index of an EOS in row i (any id in ``eos_token_id``), else 0. A row without EOS
    (truncated at ``max_completion_length``) is all ones.

    Args:
        completion_ids: ``(B, T)`` generated token ids.
        eos_token_id: one EOS id or a list of them (models with several end-of-turn tokens).

    Returns:
        ``(B, T)`` long tensor of 0/1.
    """
    if completion_ids.dim() != 2:
        raise ValueError(f"completion_ids must have shape (B, T), got {tuple(completion_ids.shape)}.")
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not eos_ids:
        raise ValueError("eos_token_id is empty: pass the tokenizer's eos_token_id (an int or a list of ints).")
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    batch, length = completion_ids.shape
    # argmax of a bool row returns the first True; rows with no EOS keep index T (past the end) so all are kept.
    first_eos = torch.where(
        is_eos.any(dim=1),
        is_eos.int().argmax(dim=1),
        torch.full((batch,), length, dtype=torch.long, device=completion_ids.device),
    )
    positions = torch.arange(length, device=completion_ids.device).expand(batch, -1)
    return (positions <= first_eos.unsqueeze(1)).long()


def flush_left(mask: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Shift each row's nonzero-mask entries to the left, then drop the columns that are zero in every row (TRL's).

    ``mask`` ``(N, M)`` 0/1; every tensor in ``tensors`` is ``(N, M)`` and moves with it (its values outside the
    mask become 0); each row keeps the order of its entries. Mask ``[[0, 0, 1, 1], [0, 1, 0, 0]]`` with the tensor
    ``[[9, 9, a, b], [9, c, 9, 9]]`` gives the mask ``[[1, 1], [1, 0]]`` and the tensor ``[[a, b], [c, 0]]``.

    Returns:
        The new mask alone when no ``tensors`` are given, else ``(mask, *tensors)``.
    """
    keep = mask.bool()
    # a stable sort of "not kept" (0 = kept first) moves kept entries to the front in their original order
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    width = int(keep.sum(dim=1).max().item()) if keep.numel() else 0
    new_keep = torch.gather(keep, 1, order)[:, :width]
    out_mask = new_keep.to(mask.dtype)
    outs = [torch.where(new_keep, torch.gather(t, 1, order)[:, :width], torch.zeros((), dtype=t.dtype)) for t in tensors]
    return out_mask if not outs else (out_mask, *outs)
