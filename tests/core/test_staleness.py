"""Token-level version lag (core/staleness.py), hand-computed."""

import pytest
import torch

from posttrain.core.staleness import version_lag_stats


def test_lag_distribution_hand_computed():
    # row 0: 3 tokens from version 5, 2 from version 6 (a continued completion), 1 padding column
    # row 1: 2 tokens from version 6, then padding
    versions = torch.tensor([[5, 5, 5, 6, 6, -1], [6, 6, -1, -1, -1, -1]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    stats = version_lag_stats(versions, valid, step=7)
    # lags: 2,2,2,1,1 and 1,1 -> 7 tokens, mean (6 + 4) / 7
    assert stats["tokens"] == 7
    assert stats["max"] == 2 and stats["min"] == 1
    assert stats["mean"] == pytest.approx(10 / 7)
    assert stats["frac"] == {1: pytest.approx(4 / 7), 2: pytest.approx(3 / 7)}


def test_no_valid_token_and_shape_check():
    stats = version_lag_stats(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.bool), step=4)
    assert stats == {"mean": 0.0, "max": 0, "min": 0, "tokens": 0, "frac": {}}
    with pytest.raises(ValueError, match="differ"):
        version_lag_stats(torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.bool), step=0)
