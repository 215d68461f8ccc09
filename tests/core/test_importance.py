"""Hand-computed checks for posttrain.core.importance (rollout IS correction, off-policy mask, entropy mask)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.importance import (
    entropy_quantile_mask,
    entropy_threshold,
    off_policy_sequence_mask,
    rollout_importance_weights,
    truncated_log_kept_mass,
)

# Δ = old − sampling on valid tokens: [0.5, 0] (row 0), [−1, 0.2] (row 1); the third column is padding.
OLD = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -0.3, -9.0]])
SAMPLING = torch.tensor([[-1.5, -2.0, 0.0], [-2.0, -0.5, 0.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 0]])
E = math.exp


def test_token_truncate():
    """ρ_t = e^Δ = [[e^.5 = 1.648721, 1, 1 (pad)], [e^-1 = 0.367879, e^.2 = 1.221403, 1]]; clamp to [0.5, 1.5]
    -> [[1.5, 1, 1], [0.5, 1.221403, 1]]. Stats over valid tokens: |Δ| mean (0.5 + 0 + 1 + 0.2)/4 = 0.425, max 1;
    ratio min 0.5, max 1.5, mean (1.5 + 1 + 0.5 + 1.221403)/4 = 1.055351."""
    ratio, stats = rollout_importance_weights(OLD, SAMPLING, MASK, mode="token_truncate", clip_min=0.5, clip_max=1.5)
    torch.testing.assert_close(ratio, torch.tensor([[1.5, 1.0, 1.0], [0.5, E(0.2), 1.0]]))
    assert stats["sampling_logp_difference/mean"].item() == pytest.approx(0.425)
    assert stats["sampling_logp_difference/max"].item() == pytest.approx(1.0)
    assert stats["importance_sampling_ratio/min"].item() == pytest.approx(0.5)
    assert stats["importance_sampling_ratio/max"].item() == pytest.approx(1.5)
    assert stats["importance_sampling_ratio/mean"].item() == pytest.approx((1.5 + 1 + 0.5 + E(0.2)) / 4)


def test_token_mask():
    """Same ratios, mask outside [0.5, 1.5]: e^.5 -> 0 and e^-1 -> 0, others kept."""
    ratio, _ = rollout_importance_weights(OLD, SAMPLING, MASK, mode="token_mask", clip_min=0.5, clip_max=1.5)
    torch.testing.assert_close(ratio, torch.tensor([[0.0, 1.0, 1.0], [0.0, E(0.2), 1.0]]))


def test_sequence_modes():
    """ρ_i = exp(ΣΔ) = [e^0.5 = 1.648721, e^-0.8 = 0.449329], shape (B, 1). truncate (C_max 1.5) -> [1.5, 0.449329];
    mask (default C_max 3) keeps both; mask with C_min 0.5 drops row 1 -> [1.648721, 0]. Stats over sequences."""
    trunc, stats = rollout_importance_weights(OLD, SAMPLING, MASK, mode="sequence_truncate", clip_max=1.5)
    assert trunc.shape == (2, 1)
    torch.testing.assert_close(trunc, torch.tensor([[1.5], [E(-0.8)]]))
    assert stats["importance_sampling_ratio/mean"].item() == pytest.approx((1.5 + E(-0.8)) / 2)
    kept, _ = rollout_importance_weights(OLD, SAMPLING, MASK)  # TRL default: sequence_mask, C_max = 3
    torch.testing.assert_close(kept, torch.tensor([[E(0.5)], [E(-0.8)]]))
    dropped, _ = rollout_importance_weights(OLD, SAMPLING, MASK, mode="sequence_mask", clip_min=0.5)
    torch.testing.assert_close(dropped, torch.tensor([[E(0.5)], [0.0]]))


def test_rollout_empty_mask_stats_are_zero():
    """No valid token: token-mode stats are 0 (as TRL logs them), ratios are all 1."""
    ratio, stats = rollout_importance_weights(OLD, SAMPLING, torch.zeros_like(MASK), mode="token_truncate")
    assert ratio.eq(1).all()
    assert all(v.item() == 0.0 for v in stats.values())


def test_truncated_log_kept_mass_by_hand():
    """Scores log[0.5, 0.3, 0.2] (probabilities 0.5, 0.3, 0.2); top-2 keeps the first two: S = 0.8, log S =
    −0.223144. Nothing truncated: log S = 0. Row-wise on (B, V)."""
    full = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)], [0.0, 0.0, 0.0]])
    kept = full.clone()
    kept[0, 2] = -math.inf
    torch.testing.assert_close(truncated_log_kept_mass(full, kept), torch.tensor([math.log(0.8), 0.0]))
    # log softmax(kept) + log S = log softmax(full) on every kept token
    fixed = torch.log_softmax(kept, -1) + truncated_log_kept_mass(full, kept)[:, None]
    torch.testing.assert_close(fixed[0, :2], torch.log_softmax(full, -1)[0, :2])


def test_kept_mass_correction_by_hand():
    """Trainer (full softmax) p = 0.5 and 0.3 on two tokens; a top-2 sampler over [0.5, 0.3, 0.2] records the
    renormalised 0.5/0.8 = 0.625 and 0.3/0.8 = 0.375 with log S = log 0.8 on both. Uncorrected ρ = 0.8 on both
    tokens (the bias); corrected ρ = 1 exactly. ε = 0.1: both uncorrected ratios (0.8) are outside [0.9, 1.1]."""
    old = torch.tensor([[math.log(0.5), math.log(0.3)]])
    sampling = torch.tensor([[math.log(0.625), math.log(0.375)]])
    kept = torch.full((1, 2), math.log(0.8))
    mask = torch.ones(1, 2)
    uncorrected, before = rollout_importance_weights(old, sampling, mask, mode="token_truncate")
    torch.testing.assert_close(uncorrected, torch.full((1, 2), 0.8))
    assert before["raw_importance_sampling_ratio/frac_outside"].item() == 1.0
    ratio, stats = rollout_importance_weights(
        old, sampling, mask, mode="token_truncate", sampling_log_kept_mass=kept
    )
    torch.testing.assert_close(ratio, torch.ones(1, 2))
    assert stats["importance_sampling_ratio/mean"].item() == pytest.approx(1.0)
    assert stats["raw_importance_sampling_ratio/frac_outside"].item() == 0.0
    assert stats["sampling_logp_difference/max"].item() == pytest.approx(0.0, abs=1e-6)
    assert stats["uncorrected_importance_sampling_ratio/mean"].item() == pytest.approx(0.8)
    assert stats["uncorrected_importance_sampling_ratio/min"].item() == pytest.approx(0.8)
    assert stats["uncorrected_importance_sampling_ratio/frac_outside"].item() == 1.0
    assert stats["log_kept_mass/mean"].item() == pytest.approx(math.log(0.8))
    # sequence mode: the uncorrected sequence ratio is 0.8² = 0.64, corrected 1
    seq, _ = rollout_importance_weights(old, sampling, mask, mode="sequence_mask", sampling_log_kept_mass=kept)
    torch.testing.assert_close(seq, torch.ones(1, 1))
    with pytest.raises(ValueError, match="one log kept mass per sampled token"):
        rollout_importance_weights(old, sampling, mask, sampling_log_kept_mass=kept[:, :1])


def test_raw_ratio_and_frac_modified_by_hand():
    """OLD/SAMPLING above, token_truncate to [0.5, 1.5]: raw ratios e^.5, 1, e^-1, e^.2 = 1.6487, 1, 0.3679, 1.2214;
    min e^-1, max e^.5, mean 1.059502; outside [0.9, 1.1]: 3 of 4; the clip changed 2 of 4."""
    _, stats = rollout_importance_weights(OLD, SAMPLING, MASK, mode="token_truncate", clip_min=0.5, clip_max=1.5)
    assert stats["raw_importance_sampling_ratio/min"].item() == pytest.approx(E(-1))
    assert stats["raw_importance_sampling_ratio/max"].item() == pytest.approx(E(0.5))
    assert stats["raw_importance_sampling_ratio/mean"].item() == pytest.approx((E(0.5) + 1 + E(-1) + E(0.2)) / 4)
    assert stats["raw_importance_sampling_ratio/frac_outside"].item() == pytest.approx(0.75)
    assert stats["frac_modified_importance_sampling_ratio"].item() == pytest.approx(0.5)
    assert "uncorrected_importance_sampling_ratio/mean" not in stats  # no kept mass recorded: nothing to compare


def test_rollout_errors():
    with pytest.raises(ValueError, match="Valid modes: token_truncate, token_mask, sequence_truncate, sequence_mask"):
        rollout_importance_weights(OLD, SAMPLING, MASK, mode="token")
    with pytest.raises(ValueError, match="clip_min .* must be smaller"):
        rollout_importance_weights(OLD, SAMPLING, MASK, clip_min=3.0, clip_max=2.0)
    with pytest.raises(ValueError, match="needs at least one"):
        rollout_importance_weights(OLD, SAMPLING, MASK, mode="token_truncate", clip_max=None)


def test_off_policy_sequence_mask():
    """mean_t(sampling − logp) over valid tokens: row 0 [0.5, 0.5] -> 0.5, row 1 -> 0.5, row 2 [0.05, (pad 9)]
    -> 0.05 (the padding is excluded). δ = 0.1, A = [1, −1, −1]: keep row 0 (A ≥ 0), drop row 1 (0.5 > δ), keep row 2 (0.05 ≤ δ)."""
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    sampling = torch.tensor([[-0.5, -0.5], [-0.5, -0.5], [-0.95, 8.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    keep = off_policy_sequence_mask(torch.tensor([1.0, -1.0, -1.0]), sampling, logp, mask, 0.1)
    assert keep.tolist() == [[1.0], [0.0], [1.0]]
    assert not keep.requires_grad
    keep_2d = off_policy_sequence_mask(torch.tensor([[1.0], [-1.0], [0.0]]), sampling, logp, mask, 0.1)
    assert keep_2d.tolist() == [[1.0], [0.0], [1.0]]


def test_entropy_threshold_linear_quantile():
    """[5, 1, 4, 2, 3]: ρ = 0.5 -> quantile 0.5 = 3; ρ = 0.2 -> quantile 0.8, position 0.8·4 = 3.2 -> 4 + 0.2·1 = 4.2;
    ρ = 1 -> the minimum 1; no valid token -> +inf. Matches torch.quantile on random data."""
    values = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0])
    assert entropy_threshold(values, 0.5).item() == pytest.approx(3.0)
    assert entropy_threshold(values, 0.2).item() == pytest.approx(4.2)
    assert entropy_threshold(values, 1.0).item() == 1.0
    assert entropy_threshold(torch.tensor([]), 0.2).item() == math.inf
    rand = torch.rand(101)
    for rho in (0.05, 0.2, 0.37, 0.9):
        assert entropy_threshold(rand, rho).item() == pytest.approx(torch.quantile(rand, 1 - rho).item(), abs=1e-6)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        entropy_threshold(values, 0.0)


def test_entropy_quantile_mask():
    """Valid entropies [1, 5, 9, 3, 7] (100 is padding), ρ = 0.4: quantile 0.6 of [1, 3, 5, 7, 9] is at position 2.4
    -> 5 + 0.4·2 = 5.8; keep 9 and 7. A precomputed (gathered) threshold 4 keeps 5, 9 and 7."""
    entropy = torch.tensor([[1.0, 5.0, 9.0], [3.0, 7.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert entropy_quantile_mask(entropy, mask, 0.4).tolist() == [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    assert entropy_quantile_mask(entropy, mask, 0.4, threshold=4.0).tolist() == [[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]
    assert entropy_quantile_mask(entropy, mask, 1.0).tolist() == mask.float().tolist()
    assert entropy_quantile_mask(entropy, torch.zeros_like(mask), 0.4).sum().item() == 0.0
