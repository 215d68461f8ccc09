"""TRL's rollout metric names and values, hand-computed."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.rollout.metrics import clip_ratio_metrics, completion_length_metrics, reward_metrics


def test_completion_length_metrics():
    # lengths 2, 4, 6, 8; the last one hit the cap (not terminated).
    out = completion_length_metrics(torch.tensor([2, 4, 6, 8]), torch.tensor([True, True, True, False]))
    assert out["completions/mean_length"] == 5.0
    assert (out["completions/min_length"], out["completions/max_length"]) == (2.0, 8.0)
    assert out["completions/mean_terminated_length"] == 4.0  # (2 + 4 + 6) / 3
    assert out["completions/max_terminated_length"] == 6.0
    assert out["completions/clipped_ratio"] == 0.25


def test_completion_length_metrics_when_nothing_terminated():
    out = completion_length_metrics(torch.tensor([3, 3]), torch.tensor([False, False]))
    assert out["completions/mean_terminated_length"] == 0.0 and out["completions/clipped_ratio"] == 1.0


def test_reward_metrics_ignore_none():
    # f: [1, NaN, 3, 5] -> mean 3, std sqrt(((1-3)^2 + 0 + (5-3)^2) / 2) = 2; g: all 1 -> std 0.
    per_func = torch.tensor([[1.0, 1.0], [float("nan"), 1.0], [3.0, 1.0], [5.0, 1.0]])
    rewards = torch.tensor([2.0, 1.0, 4.0, 6.0])
    std = torch.tensor([0.0, 0.0, 1.0, 1.0])
    out = reward_metrics(per_func, ["f", "g"], rewards, std)
    assert out["rewards/f/mean"] == pytest.approx(3.0) and out["rewards/f/std"] == pytest.approx(2.0)
    assert out["rewards/g/std"] == 0.0
    assert out["reward"] == pytest.approx(3.25)
    assert out["reward_std"] == pytest.approx(math.sqrt((1.5625 + 5.0625 + 0.5625 + 7.5625) / 3))
    assert out["frac_reward_zero_std"] == 0.5


def test_clip_ratio_metrics_reduce_over_processes():
    out = clip_ratio_metrics(torch.tensor([0.1, 0.3]), torch.tensor([0.0, 0.2]), torch.tensor([0.1, 0.5]))
    assert out["clip_ratio/low_mean"] == pytest.approx(0.2) and out["clip_ratio/low_min"] == pytest.approx(0.1)
    assert out["clip_ratio/high_mean"] == pytest.approx(0.1) and out["clip_ratio/high_max"] == pytest.approx(0.2)
    assert out["clip_ratio/region_mean"] == pytest.approx(0.3)


def test_clip_ratio_min_max_over_per_sequence_values():
    out = clip_ratio_metrics(
        torch.tensor([0.375]), torch.tensor([0.25]), torch.tensor([0.625]),
        low_per_sequence=torch.tensor([0.0, 0.75, float("nan")]), high_per_sequence=torch.tensor([1.0, 0.0, 0.0]),
    )  # fmt: skip
    assert out["clip_ratio/low_mean"] == pytest.approx(0.375) and out["clip_ratio/low_min"] == 0.0
    assert out["clip_ratio/high_mean"] == pytest.approx(0.25) and out["clip_ratio/high_max"] == 1.0
