"""Hand-computed checks for posttrain.core.masking."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.masking import (
    completion_mask_from_eos,
    masked_batch_mean,
    masked_mean,
    masked_std,
    masked_sum,
    masked_var,
    nanmax,
    nanmin,
    nanstd,
)

NAN = float("nan")
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN]])
M = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_sum_and_mean_ignore_masked_nan():
    """Valid entries 1, 2 | 4: total 7, row sums [3, 4], row means [1.5, 4], overall mean 7/3. The NaN is masked."""
    assert masked_sum(X, M).item() == 7.0
    assert masked_sum(X, M, dim=-1).tolist() == [3.0, 4.0]
    assert masked_mean(X, M, dim=-1).tolist() == [1.5, 4.0]
    assert masked_mean(X, M).item() == pytest.approx(7 / 3)


def test_masked_mean_empty_mask_is_zero_not_nan():
    """A row with no valid entry averages to 0; an all-zero mask too."""
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_mean(X, mask, dim=-1).tolist() == [1.5, 0.0]
    assert masked_mean(X, torch.zeros_like(mask)).item() == 0.0


def test_masked_mean_broadcasts_sequence_values():
    """x (B,1) = [[2],[4]] counted once per valid token: (2 + 2 + 4) / 3 = 8/3."""
    x = torch.tensor([[2.0], [4.0]])
    assert masked_mean(x, M).item() == pytest.approx(8 / 3)


def test_masked_mean_gradient_is_finite_and_zero_on_masked_positions():
    """An inf at a masked position must not poison the gradient: d mean / d x = m / Σm = [1/3, 1/3, 0 | 1/3, 0, 0]."""
    x = torch.tensor([[1.0, 2.0, float("inf")], [4.0, 5.0, 6.0]], requires_grad=True)
    masked_mean(x, M).backward()
    expected = torch.tensor([[1, 1, 0], [1, 0, 0]]) / 3
    torch.testing.assert_close(x.grad, expected.float())


def test_masked_var_and_std():
    """Valid values 1, 2, 3 (mean 2, squared deviations 1, 0, 1): biased var 2/3, unbiased 2/2 = 1, std 1."""
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(2 / 3)
    assert masked_var(x, mask).item() == pytest.approx(1.0)
    assert masked_std(x, mask).item() == pytest.approx(1.0)
    # per row: row 0 values 1, 2 -> unbiased var 0.5; row 1 single value -> undefined (NaN)
    per_row = masked_var(x, mask, dim=-1)
    assert per_row[0].item() == pytest.approx(0.5)
    assert math.isnan(per_row[1].item())


def test_masked_var_undefined_cases_are_nan():
    """n = 1 unbiased -> NaN (Bessel undefined), n = 1 biased -> 0, n = 0 -> NaN."""
    x = torch.tensor([5.0, 6.0])
    one = torch.tensor([1, 0])
    assert math.isnan(masked_var(x, one).item())
    assert masked_var(x, one, unbiased=False).item() == 0.0
    assert math.isnan(masked_var(x, torch.zeros(2)).item())


def test_masked_batch_mean_sequence_vs_token_shapes():
    """(B,1) indicators average over sequences: mean(1, 0) = 0.5; (B,T) over valid tokens: 1 / 3."""
    assert masked_batch_mean(torch.tensor([[1.0], [0.0]]), M).item() == 0.5
    tokens = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    assert masked_batch_mean(tokens, M).item() == pytest.approx(1 / 3)


def test_nanstd_bessel_and_nan_cases():
    """[1, NaN, 3]: mean 2, mean squared deviation 1, n = 2 -> var 1·2/1 = 2, std √2. n ≤ 1 -> NaN (as TRL)."""
    assert nanstd(torch.tensor([1.0, NAN, 3.0])).item() == pytest.approx(math.sqrt(2))
    values = torch.tensor([0.5, 1.5, 4.0, -2.0])
    assert nanstd(values).item() == pytest.approx(values.std().item())
    assert math.isnan(nanstd(torch.tensor([5.0, NAN])).item())
    assert math.isnan(nanstd(torch.tensor([NAN, NAN])).item())


def test_nanmin_nanmax():
    """[NaN, 3, -1] -> min -1, max 3; all NaN (or empty) -> NaN."""
    t = torch.tensor([NAN, 3.0, -1.0])
    assert nanmin(t).item() == -1.0
    assert nanmax(t).item() == 3.0
    assert math.isnan(nanmin(torch.tensor([NAN, NAN])).item())
    assert math.isnan(nanmax(torch.tensor([])).item())


def test_completion_mask_from_eos():
    """Keep up to and including the first EOS (258); a row with no EOS is all ones; later EOS are cut."""
    ids = torch.tensor([[5, 258, 7, 258], [1, 2, 3, 4], [258, 0, 0, 0]])
    mask = completion_mask_from_eos(ids, 258)
    assert mask.dtype == torch.long
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_completion_mask_from_eos_several_eos_ids():
    """With EOS ids {256, 258} the first of either ends the completion."""
    ids = torch.tensor([[5, 256, 258, 1], [7, 7, 258, 256]])
    assert completion_mask_from_eos(ids, [258, 256]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]


def test_completion_mask_from_eos_errors():
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        completion_mask_from_eos(torch.tensor([1, 2]), 2)
    with pytest.raises(ValueError, match="eos_token_id"):
        completion_mask_from_eos(torch.tensor([[1, 2]]), [])
