"""Inverse-CDF draws from categorical distributions: one level, or two (block sums, then inside one block).

Both map a uniform ``u`` to ``min{i : CDF_i > u · CDF_V}``, the exact inverse CDF, so a draw is distributed as
``torch.multinomial(probs, 1)``. Accumulation is in float64 so rounding cannot move visible mass between tokens, and
a zero-probability token is never returned (its CDF step is flat, and the target is kept strictly below the total).

The two-level form reads the ``(R, V)`` probabilities once for ``V / b`` block sums, then cumulates only the ``b``
entries of the chosen block: no ``(R, V)`` float64 cumulative sum, which dominates a draw at V = 152 k. With exactly
representable probabilities (no rounding anywhere) both forms return the same index for the same ``u``; otherwise
they can differ only when ``u`` falls within float64 rounding of a CDF step.
"""

from __future__ import annotations

import torch

__all__ = ["TWO_LEVEL_MIN_VOCAB", "block_size_for", "inverse_cdf", "inverse_cdf_two_level"]

# Vocabularies above this many entries use the two-level search (below it the full cumulative sum is cheap).
TWO_LEVEL_MIN_VOCAB = 4096


def _strictly_below(target: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``target`` capped at the largest float below ``total`` (``u · total`` may round up to ``total``)."""
    return torch.minimum(target, total.nextafter(torch.zeros_like(total)))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, rows_per_chunk: int = 64) -> torch.Tensor:
    """Index drawn per row of ``probs`` ``(R, V)`` for uniforms ``u`` ``(R, 1)`` float64; returns ``(R,)`` long.

    The float64 CDF is built ``rows_per_chunk`` rows at a time to bound that ``(r, V)`` copy.
    """
    out = []
    for i in range(0, probs.shape[0], rows_per_chunk):
        cdf = probs[i : i + rows_per_chunk].cumsum(dim=-1, dtype=torch.float64)  # (r, V)
        total = cdf[:, -1:]
        target = _strictly_below(u[i : i + rows_per_chunk] * total, total)  # (r, 1)
        out.append(torch.searchsorted(cdf, target, right=True).squeeze(1))
    return torch.cat(out).clamp_(max=probs.shape[1] - 1)  # (R,)


def block_size_for(vocab_size: int) -> int:
    """A power of two near ``sqrt(vocab_size)`` (at least 64): both levels then cost about the same."""
    return 1 << max(6, (vocab_size.bit_length() + 1) // 2)


# Entries per row converted to float64 at a time by the block sums: ``sum(dtype=float64)`` upcasts its whole input
# first, an (R, V) float64 copy (18.5 MiB for 16 rows of 151 936) and most of a draw's time.
_SUM_SLICE_ENTRIES = 16384


def _block_sums_float64(probs: torch.Tensor, block: int, full: int) -> torch.Tensor:
    """``(R, nb)`` float64 sums of the ``full`` whole blocks of ``block`` entries (and the partial last one), a
    slice of blocks at a time: the same sums as one call, without an ``(R, V)`` float64 copy."""
    rows, vocab = probs.shape
    n_blocks = full + (1 if full * block < vocab else 0)
    sums = torch.empty(rows, n_blocks, dtype=torch.float64, device=probs.device)
    per_slice = max(1, _SUM_SLICE_ENTRIES // block)
    for a in range(0, full, per_slice):
        b = min(a + per_slice, full)
        sums[:, a:b] = probs[:, a * block : b * block].unflatten(1, (b - a, block)).sum(-1, dtype=torch.float64)
    if n_blocks > full:
        sums[:, full] = probs[:, full * block :].sum(-1, dtype=torch.float64)
    return sums


def inverse_cdf_two_level(probs: torch.Tensor, u: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """The same draw as :func:`inverse_cdf` via block sums and one within-block search; returns ``(R,)`` long.

    Args:
        probs: ``(R, V)`` non-negative weights (need not sum to 1).
        u: ``(R, 1)`` float64 uniforms in ``[0, 1)``.
        block: Entries per block (default :func:`block_size_for` ``(V)``); the last block may be partial.
    """
    rows, vocab = probs.shape
    block = block or block_size_for(vocab)
    full = vocab // block
    sums = _block_sums_float64(probs, block, full)  # (R, nb)
    block_cdf = sums.cumsum(dim=-1)  # (R, nb)
    total = block_cdf[:, -1:]
    target = _strictly_below(u * total, total)  # (R, 1)
    chosen = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)  # (R, 1)
    before = block_cdf.gather(1, (chosen - 1).clamp(min=0)).masked_fill_(chosen == 0, 0.0)  # (R, 1)
    cols = chosen * block + torch.arange(block, device=probs.device)  # (R, b)
    inside = probs.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0)  # (R, b)
    cdf = inside.cumsum(dim=-1, dtype=torch.float64)  # (R, b)
    rest = _strictly_below(target - before, cdf[:, -1:])  # (R, 1), >= 0: block_cdf[chosen - 1] <= target
    return (chosen + 0).mul_(block).add_(torch.searchsorted(cdf, rest, right=True)).squeeze(1)  # (R,)
