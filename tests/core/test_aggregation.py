"""Hand-computed checks for posttrain.core.aggregation.

Shared example: L = [[1, 2, 3], [4, 5, 6]], m = [[1, 1, 0], [1, 0, 0]] -> valid values 1, 2 | 4 (Σ L·m = 7,
lengths 2 and 1, B = 2).
"""

from __future__ import annotations

import pytest
import torch

from posttrain.core.aggregation import (
    AGGREGATIONS,
    constant_norm,
    length_weighted,
    seq_mean_token_mean,
    sequence_mean,
    token_mean_global,
    token_mean_local,
)

L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_seq_mean_token_mean():
    """mean(3/2, 4/1) = 2.75."""
    assert seq_mean_token_mean(L, M).item() == pytest.approx(2.75)


def test_token_mean_local():
    """7 / 3."""
    assert token_mean_local(L, M).item() == pytest.approx(7 / 3)


def test_constant_norm():
    """7 / (B · max_completion_length) = 7 / (2 · 4) = 0.875; missing constant -> error naming it."""
    assert constant_norm(L, M, max_completion_length=4).item() == pytest.approx(0.875)
    with pytest.raises(ValueError, match="max_completion_length"):
        constant_norm(L, M)


def test_token_mean_global():
    """7 / (6 / 2) = 7/3 with 6 tokens over 2 processes; a tensor count works; a zero count gives Σ = 0 not NaN."""
    assert token_mean_global(L, M, num_items_in_batch=6, num_processes=2).item() == pytest.approx(7 / 3)
    assert token_mean_global(L, M, num_items_in_batch=torch.tensor(14)).item() == pytest.approx(0.5)
    assert token_mean_global(L, torch.zeros_like(M), num_items_in_batch=0).item() == 0.0
    with pytest.raises(ValueError, match="num_items_in_batch"):
        token_mean_global(L, M)


def test_token_mean_global_is_split_invariant():
    """Summing the per-micro-batch losses (rows split 1 + 1) gives the global token mean 7/3 — no GA division."""
    total = token_mean_global(L[:1], M[:1], num_items_in_batch=3) + token_mean_global(
        L[1:], M[1:], num_items_in_batch=3
    )
    assert total.item() == pytest.approx(7 / 3)


def test_length_weighted():
    """(B, 1) loss [[1], [2]] with lengths [2, 1]: mean(1·2, 2·1) = 2.
    (B, T) loss (TRL 1.16: mean over sequences of the masked token sums): mean(1 + 2, 4) = 3.5."""
    assert length_weighted(torch.tensor([[1.0], [2.0]]), M).item() == pytest.approx(2.0)
    assert length_weighted(L, M).item() == pytest.approx(3.5)


def test_sequence_mean():
    """(B, 1) [[1], [2]] -> 1.5; a per-token loss is rejected with a hint."""
    assert sequence_mean(torch.tensor([[1.0], [2.0]]), M).item() == 1.5
    with pytest.raises(ValueError, match="sequence_sum"):
        sequence_mean(L, M)


def test_masked_nan_does_not_leak_and_empty_rows():
    """NaN/inf at masked positions change nothing; an empty row counts as 0 in seq_mean_token_mean: mean(1.5, 0)."""
    dirty = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), float("nan")]])
    for name in ["seq_mean_token_mean", "token_mean_local", "length_weighted"]:
        fn = AGGREGATIONS.get(name)
        assert fn(dirty, M).item() == pytest.approx(fn(L, M).item())
    assert seq_mean_token_mean(L, torch.tensor([[1, 1, 0], [0, 0, 0]])).item() == pytest.approx(0.75)
    assert token_mean_local(L, torch.zeros_like(M)).item() == 0.0


def test_sequence_loss_broadcasts_in_token_aggregations():
    """A (B, 1) loss [[1], [2]] in seq_mean_token_mean is each sequence's value: mean(1, 2) = 1.5;
    in token_mean_local it counts per token: (1 + 1 + 2)/3 = 4/3."""
    seq = torch.tensor([[1.0], [2.0]])
    assert seq_mean_token_mean(seq, M).item() == pytest.approx(1.5)
    assert token_mean_local(seq, M).item() == pytest.approx(4 / 3)


def test_gradients_only_reach_valid_positions():
    """d(token_mean_local)/dL = m / Σm = [[1/3, 1/3, 0], [1/3, 0, 0]]."""
    loss = L.clone().requires_grad_()
    token_mean_local(loss, M).backward()
    torch.testing.assert_close(loss.grad, M.float() / 3)


def test_registry_names():
    assert AGGREGATIONS.names() == [
        "constant_norm",
        "length_weighted",
        "seq_mean_token_mean",
        "sequence_mean",
        "token_mean_global",
        "token_mean_local",
    ]
    with pytest.raises(ValueError, match="Valid names"):
        AGGREGATIONS.get("mean")
