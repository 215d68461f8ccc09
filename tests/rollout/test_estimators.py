"""GRPO's and RLOO's advantage estimators on hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from posttrain.rollout.estimators import GroupRelativeEstimator, LeaveOneOutEstimator


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def test_group_relative_sum_then_normalize():
    # Two functions, weights (1, 0.5): r = [1+0.5, 0+1, 2+0, 4+0] = [1.5, 1, 2, 4], groups of 2.
    # Group 1: mean 1.25, std sqrt(0.125) = 0.35355; group 2: mean 3, std sqrt(2) = 1.41421.
    per_func = torch.tensor([[1.0, 1.0], [0.0, 2.0], [2.0, 0.0], [4.0, 0.0]])
    out = GroupRelativeEstimator("group")(per_func, torch.tensor([1.0, 0.5]), 2)
    assert out.rewards.tolist() == [1.5, 1.0, 2.0, 4.0]
    expected = [0.25 / (0.353553 + 1e-4), -0.25 / (0.353553 + 1e-4), -1 / (1.414214 + 1e-4), 1 / (1.414214 + 1e-4)]
    assert out.advantages.tolist() == pytest.approx(expected, rel=1e-5)
    none = GroupRelativeEstimator("none")(per_func, torch.tensor([1.0, 0.5]), 2)
    assert none.advantages.tolist() == pytest.approx([0.25, -0.25, -1.0, 1.0])


def test_group_relative_unscorable_row_gets_zero_advantage():
    per_func = torch.tensor([[float("nan")], [1.0], [3.0], [1.0]])
    out = GroupRelativeEstimator("none")(per_func, torch.ones(1), 2)
    assert torch.isnan(out.rewards[0])
    assert out.advantages.tolist() == [0.0, 0.0, 1.0, -1.0]


def test_group_relative_normalize_then_sum_is_gdpo():
    per_func = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    out = GroupRelativeEstimator(multi_objective_aggregation="normalize_then_sum")(per_func, torch.ones(2), 2)
    # Each function differs by 1 inside every group: std = 0.7071, z = ±0.5 / (0.7071 + 1e-4) per function.
    z = 0.5 / (0.70710678 + 1e-4)
    summed = torch.tensor([-z + z, z - z, -z - z, z + z])
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    assert out.advantages.tolist() == pytest.approx(expected.tolist(), rel=1e-4, abs=1e-6)


def test_leave_one_out_folds_kl_into_the_reward():
    # G = 3, one prompt. Per-sequence KL = Σ_t m·(old − ref) = [1, 0, -1 + 0 (masked)] → rewards − 0.5·KL.
    batch = {
        "completion_mask": torch.tensor([[1, 1], [1, 1], [1, 0]]),
        "old_per_token_logps": torch.tensor([[0.5, 0.5], [0.0, 0.0], [-1.0, 9.0]]),
        "ref_per_token_logps": torch.zeros(3, 2),
    }
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    out = LeaveOneOutEstimator(beta=0.5)(rewards, torch.ones(1), 3, batch=batch, gather=_identity)
    r = [1.0 - 0.5, 2.0, 3.0 + 0.5]  # [0.5, 2, 3.5]
    baselines = [(2 + 3.5) / 2, (0.5 + 3.5) / 2, (0.5 + 2) / 2]
    assert out.advantages.tolist() == pytest.approx([a - b for a, b in zip(r, baselines)])
    assert out.rewards.tolist() == [1.0, 2.0, 3.0]  # logged reward is before the KL penalty
    assert out.metrics["kl"] == pytest.approx((0.5 + 0.5 + 0 + 0 - 1.0) / 5)


def test_leave_one_out_clip_and_normalize():
    rewards = torch.tensor([[5.0], [0.0], [-5.0], [1.0]])
    est = LeaveOneOutEstimator(beta=0.0, reward_clip_range=(-1.0, 1.0), normalize_advantages=True)
    out = est(rewards, torch.ones(1), 2, batch={}, gather=_identity)
    raw = torch.tensor([1.0, -1.0, -2.0, 2.0])  # clipped [1, 0, -1, 1] → A = r_i − r_other
    expected = (raw - raw.mean()) / (raw.std() + 1e-4)
    assert out.advantages.tolist() == pytest.approx(expected.tolist(), rel=1e-5)
    assert not est.needs_ref_logps and est.needs_old_logps


def test_leave_one_out_zero_std_is_measured_after_the_kl_penalty_and_clipping():
    """frac_reward_zero_std (TRL 1.16): a group with equal task rewards but different KL is not zero-std; a group
    whose rewards differ only above the clip range is."""
    batch = {
        "completion_mask": torch.ones(4, 1, dtype=torch.long),
        "old_per_token_logps": torch.tensor([[0.2], [0.0], [0.0], [0.0]]),
        "ref_per_token_logps": torch.zeros(4, 1),
    }
    rewards = torch.tensor([[1.0], [1.0], [3.0], [5.0]])
    out = LeaveOneOutEstimator(beta=0.5, reward_clip_range=(-2.0, 2.0))(
        rewards, torch.ones(1), 2, batch=batch, gather=_identity
    )
    # group 0: [1 − 0.1, 1] → std ≈ 0.0707; group 1: clipped [2, 2] → std 0
    assert out.std.tolist() == pytest.approx([0.1 / 2**0.5] * 2 + [0.0] * 2, abs=1e-6)  # one per row
    assert out.rewards.tolist() == [1.0, 1.0, 3.0, 5.0]

