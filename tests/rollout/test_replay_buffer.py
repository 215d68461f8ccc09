"""rollout.replay_buffer: the heap keeps the best groups, sampling follows the scores, zero-std groups are swapped
for stored ones (widening the batch when a stored group is longer)."""

from __future__ import annotations

import torch

from posttrain.rollout.replay_buffer import ReplayBuffer, replace_zero_std_groups, slice_group

PAD = 0


def _batch():
    # two groups of G = 2: group 0 varies (advantages ±1), group 1 does not (advantages 0)
    return {
        "prompt_ids": torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]),
        "completion_ids": torch.tensor([[11, 12, 0], [13, 0, 0], [14, 15, 16], [17, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]),
        "completion_lengths": torch.tensor([2, 1, 3, 1]),
        "old_per_token_logps": torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0], [-4.0, -5.0, -6.0], [-7.0, 0, 0]]),
        "advantages": torch.tensor([1.0, -1.0, 0.0, 0.0]),
        "num_items_in_batch": torch.tensor(7),
    }


def test_heap_keeps_the_highest_scores_and_samples_by_score():
    buffer = ReplayBuffer(2, seed=0)
    buffer.add([1.0, 5.0, 3.0, 3.0], [{"g": 1}, {"g": 5}, {"g": 3}, {"g": 33}])  # equal scores do not compare dicts
    assert sorted(item[0] for item in buffer.heap) == [3.0, 5.0] and len(buffer) == 2
    zero = ReplayBuffer(3, seed=0)
    zero.add([0.0, 2.0], [{"g": 0}, {"g": 2}])
    assert [s["g"] for s in zero.sample(4)] == [2, 2, 2, 2]  # P ∝ score; more draws than groups: with replacement
    assert ReplayBuffer(3).sample(2) == []


def test_slice_group_trims_left_padded_prompts_and_right_padded_completions():
    group = slice_group(_batch(), 0, 2)
    assert group["prompt_ids"].tolist() == [[5, 6], [5, 6]]
    assert group["completion_ids"].tolist() == [[11, 12], [13, 0]]
    assert group["old_per_token_logps"].tolist() == [[-1.0, -2.0], [-3.0, 0.0]]
    assert group["advantages"].tolist() == [1.0, -1.0]


def test_zero_std_group_replaced_from_the_buffer():
    buffer = ReplayBuffer(4, seed=0)
    long_group = {
        "prompt_ids": torch.tensor([[1, 2, 3, 4]] * 2),
        "prompt_mask": torch.ones(2, 4, dtype=torch.long),
        "completion_ids": torch.tensor([[21, 22, 23, 24], [25, 0, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]),
        "completion_lengths": torch.tensor([4, 1]),
        "old_per_token_logps": torch.tensor([[-0.5] * 4, [-0.25, 0, 0, 0]]),
        "advantages": torch.tensor([0.75, -0.75]),
    }
    buffer.add([100.0], [long_group])
    out, replaced = replace_zero_std_groups(
        _batch(), torch.tensor([1.0, 0.0]), buffer, num_generations=2, pad_token_id=PAD
    )
    assert replaced == 1
    # group 0 (score Σ|A|·std = 2) was stored; group 1 was replaced by the higher-scoring long group
    assert len(buffer) == 2 and sorted(item[0] for item in buffer.heap) == [2.0, 100.0]
    assert out["prompt_ids"].tolist() == [[0, 0, 5, 6], [0, 0, 5, 6], [1, 2, 3, 4], [1, 2, 3, 4]]
    assert out["prompt_mask"].tolist()[0] == [0, 0, 1, 1]
    assert out["completion_ids"].tolist() == [[11, 12, 0, 0], [13, 0, 0, 0], [21, 22, 23, 24], [25, 0, 0, 0]]
    assert out["completion_mask"][2:].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert out["old_per_token_logps"][2].tolist() == [-0.5] * 4 and out["old_per_token_logps"][0, 3] == 0
    assert out["advantages"].tolist() == [1.0, -1.0, 0.75, -0.75]
    assert out["completion_lengths"].tolist() == [2, 1, 4, 1]


def test_empty_buffer_or_no_zero_std_group_leaves_the_batch():
    batch = _batch()
    out, replaced = replace_zero_std_groups(
        batch, torch.tensor([0.0, 0.0]), ReplayBuffer(4), num_generations=2, pad_token_id=PAD
    )
    assert replaced == 0 and out is batch


def test_sampling_mask_is_sliced_and_widened_with_the_unknown_support():
    """keep_sampling_mask's (B, C, K) ids and (B, C) thresholds follow the completions: trimmed with the group and
    padded, when a stored group is longer, with −1 ids and a −inf threshold (the full softmax)."""
    batch = _batch()
    batch["sampling_mask_ids"] = torch.arange(4 * 3 * 2, dtype=torch.int32).reshape(4, 3, 2)
    batch["sampling_mask_threshold"] = torch.full((4, 3), 0.5)
    group = slice_group(batch, 0, 2)
    assert group["sampling_mask_ids"].shape == (2, 2, 2) and group["sampling_mask_threshold"].shape == (2, 2)
    buffer = ReplayBuffer(4, seed=0)
    long_group = {
        "prompt_ids": torch.tensor([[1, 2, 3, 4]] * 2),
        "prompt_mask": torch.ones(2, 4, dtype=torch.long),
        "completion_ids": torch.tensor([[21, 22, 23, 24], [25, 0, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]),
        "completion_lengths": torch.tensor([4, 1]),
        "old_per_token_logps": torch.zeros(2, 4),
        "sampling_mask_ids": torch.full((2, 4, 2), 7, dtype=torch.int32),
        "sampling_mask_threshold": torch.full((2, 4), 1.5),
        "advantages": torch.tensor([0.75, -0.75]),
    }
    buffer.add([100.0], [long_group])
    out, replaced = replace_zero_std_groups(batch, torch.tensor([1.0, 0.0]), buffer, num_generations=2, pad_token_id=PAD)
    assert replaced == 1
    assert out["sampling_mask_ids"].shape == (4, 4, 2) and out["sampling_mask_threshold"].shape == (4, 4)
    assert (out["sampling_mask_ids"][:2, 3] == -1).all() and (out["sampling_mask_threshold"][:2, 3] == -INF).all()
    assert (out["sampling_mask_ids"][2:] == 7).all() and (out["sampling_mask_threshold"][2:] == 1.5).all()
    assert torch.equal(out["sampling_mask_ids"][:2, :3], batch["sampling_mask_ids"][:2])


INF = float("inf")
