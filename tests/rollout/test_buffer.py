"""Generation buffer: shuffle/split keep rows aligned, padding trimmed per micro-batch, generation schedule, resume."""

from __future__ import annotations

import pytest
import torch

from posttrain.rollout.buffer import (
    RolloutBuffer,
    shuffle_sequence_dict,
    split_short_round,
    split_tensor_dict,
    trim_padding,
)


def _batch(n: int = 4) -> dict:
    # Row i: prompt of i+1 tokens (left-padded to 4), completion of i+1 tokens (right-padded to 4).
    prompt_mask = torch.tensor([[0] * (3 - i) + [1] * (i + 1) for i in range(n)])
    completion_mask = torch.tensor([[1] * (i + 1) + [0] * (3 - i) for i in range(n)])
    return {
        "prompt_ids": prompt_mask * (torch.arange(n).unsqueeze(1) + 10),
        "prompt_mask": prompt_mask,
        "completion_ids": completion_mask * (torch.arange(n).unsqueeze(1) + 20),
        "completion_mask": completion_mask,
        "completion_lengths": completion_mask.sum(1),
        "advantages": torch.arange(n, dtype=torch.float32),
        "texts": [f"row{i}" for i in range(n)],
        "num_items_in_batch": torch.tensor(10),
    }


def test_shuffle_keeps_rows_aligned_and_scalars_untouched():
    batch = _batch()
    shuffled = shuffle_sequence_dict(batch, torch.Generator().manual_seed(0))
    order = shuffled["advantages"].long().tolist()
    assert sorted(order) == [0, 1, 2, 3] and order != [0, 1, 2, 3]
    assert shuffled["texts"] == [f"row{i}" for i in order]
    assert torch.equal(shuffled["completion_ids"], batch["completion_ids"][order])
    assert shuffled["num_items_in_batch"] is batch["num_items_in_batch"]


def test_split_then_trim_drops_columns_that_are_padding_everywhere():
    first, second = split_tensor_dict(_batch(), 2)
    assert first["texts"] == ["row0", "row1"] and second["texts"] == ["row2", "row3"]
    trimmed = trim_padding(first)  # rows 0-1: prompts of 1-2 tokens, completions of 1-2 tokens
    assert trimmed["prompt_ids"].tolist() == [[0, 10], [11, 11]]
    assert trimmed["completion_ids"].tolist() == [[20, 0], [21, 21]]
    assert trimmed["completion_mask"].shape == (2, 2) and trimmed["num_items_in_batch"] == 10
    # keep_sampling_mask's per-token (C, K) ids are trimmed along the completion dimension like the rest
    first["sampling_mask_ids"] = torch.zeros(2, first["completion_ids"].shape[1], 16, dtype=torch.int32)
    assert trim_padding(first)["sampling_mask_ids"].shape == (2, 2, 16)


def test_buffer_generates_once_per_round_and_replays_micro_batches():
    buffer = RolloutBuffer(steps_per_generation=2, num_iterations=2, seed=0)
    served, generations = [], 0
    for _ in range(8):
        if buffer.needs_generation():
            generations += 1
            buffer.fill(_batch(), shuffle=False)
        served.append(buffer.next()["texts"])
    assert generations == 2  # 8 micro-steps / (2 steps × 2 iterations)
    assert served[:4] == [["row0", "row1"], ["row2", "row3"]] * 2


def test_a_short_round_is_split_by_micro_batch_size_and_served_over_fewer_steps(tmp_path):
    # GKD's epoch end: rounds of 2 micro-batches × 2 rows; a short round of 3 rows is micro-batches of 2 and 1 rows,
    # served over 2 micro-steps, and one of 1 row over a single micro-step; full rounds split as before
    buffer = RolloutBuffer(steps_per_generation=2, num_iterations=1, seed=0)
    served, fills = [], []
    for rows in (4, 3, 1, 4):
        assert buffer.needs_generation()
        buffer.fill(_batch(rows), shuffle=False, micro_batch_size=2)
        fills.append(buffer.step)
        while True:
            served.append(buffer.next()["texts"])
            if buffer.needs_generation():
                break
    assert served == [
        ["row0", "row1"], ["row2", "row3"],
        ["row0", "row1"], ["row2"],
        ["row0"],
        ["row0", "row1"], ["row2", "row3"],
    ]  # fmt: skip
    assert fills == [0, 2, 4, 6]  # every round starts at a round boundary of the step counter
    assert all(int(mb["num_items_in_batch"]) == 10 for mb in buffer.micro_batches)  # the round's count, copied
    # mid short round the micro-batches are kept for a resume; after its last micro-step they are not
    buffer.fill(_batch(3), shuffle=False, micro_batch_size=2)
    buffer.next()
    buffer.save(tmp_path / "mid.pt")
    resumed = RolloutBuffer(steps_per_generation=2, num_iterations=1, seed=0)
    resumed.load(tmp_path / "mid.pt")
    assert not resumed.needs_generation() and resumed.next()["texts"] == ["row2"] and resumed.needs_generation()
    buffer.next()
    buffer.save(tmp_path / "done.pt")
    assert torch.load(tmp_path / "done.pt", weights_only=True)["micro_batches"] is None


def test_a_short_round_cannot_be_replayed():
    buffer = RolloutBuffer(steps_per_generation=2, num_iterations=2, seed=0)
    with pytest.raises(ValueError, match="num_iterations=1"):
        buffer.fill(_batch(3), micro_batch_size=2)
    buffer.fill(_batch(4), micro_batch_size=2)  # a full round is replayed as usual
    assert len(buffer.micro_batches) == 2


def test_split_short_round_keeps_order_and_copies_scalars():
    parts = split_short_round(_batch(4), 3)
    assert [p["texts"] for p in parts] == [["row0", "row1", "row2"], ["row3"]]
    assert all(int(p["num_items_in_batch"]) == 10 for p in parts)
    with pytest.raises(ValueError, match="positive"):
        split_short_round(_batch(), 0)


def test_buffer_state_round_trip_mid_round(tmp_path):
    buffer = RolloutBuffer(steps_per_generation=2, num_iterations=1, seed=0)
    buffer.fill(_batch())
    first = buffer.next()
    buffer.save(tmp_path / "buffer.pt")
    resumed = RolloutBuffer(steps_per_generation=2, num_iterations=1, seed=123)
    resumed.load(tmp_path / "buffer.pt")
    assert not resumed.needs_generation()
    expected = buffer.next()
    got = resumed.next()
    assert got["texts"] == expected["texts"] and got["texts"] != first["texts"]
    assert torch.equal(got["completion_ids"], expected["completion_ids"])
    # At a round boundary only the step and the RNG are stored: the next micro-step regenerates.
    buffer.save(tmp_path / "boundary.pt")
    assert torch.load(tmp_path / "boundary.pt", weights_only=True)["micro_batches"] is None


def test_global_rng_buffer_round_trips_and_ignores_a_saved_generator(tmp_path):
    """``seed=None`` (the trainers' buffer) draws the shuffle from the global torch RNG, as TRL; its state holds no
    generator (the checkpoint's RNG state covers it) and loading a seeded buffer's state keeps the global RNG."""
    buffer = RolloutBuffer(steps_per_generation=2, num_iterations=1, seed=None)
    torch.manual_seed(5)
    buffer.fill(_batch())
    torch.manual_seed(5)
    assert [int(a) for mb in buffer.micro_batches for a in mb["advantages"]] == torch.randperm(4).tolist()
    buffer.next()
    buffer.save(tmp_path / "global.pt")
    assert torch.load(tmp_path / "global.pt", weights_only=True)["generator"] is None
    resumed = RolloutBuffer(steps_per_generation=2, num_iterations=1, seed=None)
    resumed.load(tmp_path / "global.pt")
    assert resumed.next()["texts"] == buffer.next()["texts"]
    seeded = RolloutBuffer(steps_per_generation=2, num_iterations=1, seed=0)
    seeded.fill(_batch())
    seeded.save(tmp_path / "seeded.pt")
    resumed.load(tmp_path / "seeded.pt")  # an older checkpoint's generator state is not needed
    assert resumed.generator is None


def test_token_budget_packs_cut_in_order_and_set_oversize_rows_apart():
    from posttrain.rollout.buffer import token_budget_packs

    assert token_budget_packs([3, 4, 2, 9, 5, 1], 7) == ([[0, 1], [2, 4], [5]], [3])
    assert token_budget_packs([7, 7], 7) == ([[0], [1]], [])
    assert token_budget_packs([8], 7) == ([], [0])


def test_select_rows_keeps_scalars():
    from posttrain.rollout.buffer import select_rows

    out = select_rows(_batch(), torch.tensor([2, 0]))
    assert out["texts"] == ["row2", "row0"] and out["advantages"].tolist() == [2.0, 0.0]
    assert int(out["num_items_in_batch"]) == 10
