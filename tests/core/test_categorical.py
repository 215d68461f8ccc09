"""Inverse-CDF sampling: the two-level search returns the one-level index for the same uniform, hand-checked draws,
zero-probability tokens never drawn, and the draw frequencies fit the distribution."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.categorical import block_size_for, inverse_cdf, inverse_cdf_two_level


def _dyadic_probs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Probabilities that are multiples of 2**-20 summing to exactly 1: every float64 sum is exact, so both searches
    see the very same CDF values and must agree everywhere, boundaries included. Many zeros, some empty blocks."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.randint(0, 50, (rows, vocab), generator=g) * (torch.rand(rows, vocab, generator=g) < 0.05)
    weights[:, vocab // 3 : vocab // 2] = 0  # whole blocks without mass
    weights[:, -1] += 1  # mass in the partial last block
    scale = 2**20
    counts = (weights.double() / weights.sum(-1, keepdim=True) * scale).floor().long()
    counts[:, 0] += scale - counts.sum(-1)  # exact total (row 0 entry absorbs the rounding)
    return (counts.double() / scale).float()


@pytest.mark.parametrize("vocab,block", [(10_000, None), (5_000, 64), (4_097, 1024)])
def test_two_level_returns_the_one_level_index_for_the_same_uniform(vocab, block):
    probs = _dyadic_probs(4, vocab, seed=vocab)
    cdf = probs.double().cumsum(-1)
    # uniforms on a grid, plus exactly on CDF steps (the boundary cases), plus the extremes
    grid = torch.linspace(0, 1, 2001, dtype=torch.float64)[:-1]
    steps = cdf[:, ::97].T.reshape(-1)
    edges = torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64)
    for u_all in (grid, steps, edges):
        for u in u_all.split(4):
            u = u[:, None] if len(u) == 4 else u.repeat(4)[:4, None]
            one = inverse_cdf(probs, u)
            two = inverse_cdf_two_level(probs, u, block)
            assert torch.equal(one, two)
            assert (probs.gather(1, two[:, None]) > 0).all()


def test_two_level_hand_checked_draws():
    probs = torch.zeros(1, 10)
    probs[0, [1, 4, 9]] = torch.tensor([0.25, 0.5, 0.25])  # CDF steps at 0.25 (token 1), 0.75 (4), 1.0 (9)
    for u, token in [(0.0, 1), (0.2499, 1), (0.25, 4), (0.7499, 4), (0.75, 9), (1 - 2**-53, 9)]:
        got = inverse_cdf_two_level(probs, torch.tensor([[u]], dtype=torch.float64), block=4)
        assert got.item() == token, (u, got)


def test_two_level_draws_fit_the_distribution():
    torch.manual_seed(0)
    vocab = 6_000
    probs = torch.zeros(vocab)
    support = torch.tensor([3, 700, 701, 2_999, 5_999])
    probs[support] = torch.tensor([0.3, 0.05, 0.25, 0.15, 0.25])
    n = 20_000
    u = torch.rand(n, 1, dtype=torch.float64)
    draws = inverse_cdf_two_level(probs.expand(n, vocab), u)
    counts = torch.bincount(draws, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0
    expected = probs[support].double() * n
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    assert chi2 < 18.5  # chi-square, 4 degrees of freedom, p = 0.001


def test_block_size_is_a_power_of_two_near_the_square_root():
    assert block_size_for(151_936) == 512
    assert block_size_for(8_192) == 128
    assert block_size_for(100) == 64


def test_block_sums_sliced_equal_one_call_bit_for_bit(monkeypatch):
    """The float64 block sums are taken a slice of blocks at a time (no (R, V) float64 copy): with slices forced
    down to one and to three blocks, the sums equal one ``sum(dtype=float64)`` over every block, bit for bit."""
    import posttrain.core.categorical as categorical

    probs = torch.rand(5, 1000, generator=torch.Generator().manual_seed(0))
    block, full = 64, 1000 // 64
    whole = probs[:, : full * block].unflatten(1, (full, block)).sum(-1, dtype=torch.float64)
    tail = probs[:, full * block :].sum(-1, dtype=torch.float64)
    for entries in (64, 3 * 64, 10**6):
        monkeypatch.setattr(categorical, "_SUM_SLICE_ENTRIES", entries)
        sums = categorical._block_sums_float64(probs, block, full)
        assert sums.shape == (5, full + 1) and sums.dtype == torch.float64
        assert torch.equal(sums[:, :full], whole) and torch.equal(sums[:, full], tail)
