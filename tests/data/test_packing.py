"""Packing (posttrain.data.packing): BFD bin packing, Arrow pack_dataset strategies, position ids.

Tokens are made unique (row * 1000 + position) so that property tests can check that nothing is lost,
duplicated or reordered inside a sequence.
"""

import pytest
from datasets import Dataset
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.data.formats import DataFormatError
from posttrain.data.packing import (
    best_fit_decreasing,
    pack_dataset,
    position_ids_from_seq_lengths,
    seq_lengths_from_position_ids,
)

SETTINGS = settings(max_examples=40, deadline=None)


def make_dataset(lengths):
    ids = [[r * 1000 + p for p in range(n)] for r, n in enumerate(lengths)]
    return Dataset.from_dict({"input_ids": ids, "labels": [[-t for t in row] for row in ids]})


def split_docs(block, seq_lengths):
    docs, start = [], 0
    for n in seq_lengths:
        docs.append(block[start : start + n])
        start += n
    assert start == len(block)
    return docs


def reference_bfd_loads(lengths, capacity):
    """Plain O(n * bins) best-fit decreasing, for comparison."""
    rooms = []
    for n in sorted(lengths, reverse=True):
        fits = [i for i, room in enumerate(rooms) if room >= n]
        if fits:
            best = min(fits, key=lambda i: rooms[i])
            rooms[best] -= n
        else:
            rooms.append(capacity - n)
    return sorted(capacity - r for r in rooms)


@SETTINGS
@given(st.integers(1, 40).flatmap(lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), max_size=60))))
def test_best_fit_decreasing_matches_reference(case):
    capacity, lengths = case
    bins = best_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every item exactly once
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert all(load <= capacity for load in loads)
    assert sorted(loads) == reference_bfd_loads(lengths, capacity)


def test_best_fit_decreasing_rejects_bad_lengths():
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 4\]"):
        best_fit_decreasing([2, 5], 4)
    assert best_fit_decreasing([], 4) == []


@SETTINGS
@given(st.lists(st.integers(0, 30), min_size=1, max_size=25), st.integers(1, 12), st.integers(1, 30))
def test_bfd_split_loses_and_duplicates_nothing(lengths, seq_length, batch_size):
    ds = make_dataset(lengths)
    packed = pack_dataset(ds, seq_length, "bfd_split", map_kwargs={"batch_size": batch_size})
    original = sorted(t for row in ds["input_ids"] for t in row)
    got = [t for block in packed["input_ids"] for t in block]
    assert sorted(got) == original
    for block, labels, seq_lengths in zip(packed["input_ids"], packed["labels"], packed["seq_lengths"]):
        assert 0 < len(block) <= seq_length
        assert labels == [-t for t in block]  # columns move together
        for doc in split_docs(block, seq_lengths):
            # each piece is a contiguous run of one row, starting at a multiple of seq_length
            assert len({t // 1000 for t in doc}) == 1
            assert doc == list(range(doc[0], doc[0] + len(doc)))
            assert (doc[0] % 1000) % seq_length == 0


@SETTINGS
@given(st.lists(st.integers(0, 30), min_size=1, max_size=25), st.integers(1, 12))
def test_bfd_drops_only_overflow(lengths, seq_length):
    packed = pack_dataset(make_dataset(lengths), seq_length, "bfd")
    docs = sorted(
        doc for block, sl in zip(packed["input_ids"], packed["seq_lengths"]) for doc in split_docs(block, sl)
    )
    expected = sorted([r * 1000 + p for p in range(min(n, seq_length))] for r, n in enumerate(lengths) if n > 0)
    assert docs == expected  # every non-empty row once, truncated to seq_length, boundaries kept
    assert all(len(block) <= seq_length for block in packed["input_ids"])


@SETTINGS
@given(st.lists(st.integers(0, 30), min_size=1, max_size=25), st.integers(1, 12))
def test_wrapped_concatenates_and_cuts(lengths, seq_length):
    ds = make_dataset(lengths)
    packed = pack_dataset(ds, seq_length, "wrapped", map_kwargs={"batch_size": 1000})
    assert "seq_lengths" not in packed.column_names
    blocks = packed["input_ids"]
    assert [t for b in blocks for t in b] == [t for row in ds["input_ids"] for t in row]
    assert all(len(b) == seq_length for b in blocks[:-1])
    assert not blocks or 0 < len(blocks[-1]) <= seq_length


@SETTINGS
@given(st.lists(st.integers(1, 8), max_size=20))
def test_position_ids_restart_at_each_boundary(seq_lengths):
    positions = position_ids_from_seq_lengths(seq_lengths)
    assert len(positions) == sum(seq_lengths)
    starts = {sum(seq_lengths[:i]) for i in range(len(seq_lengths))}
    assert {i for i, p in enumerate(positions) if p == 0} == starts
    assert all(positions[i] == positions[i - 1] + 1 for i in range(1, len(positions)) if i not in starts)
    assert seq_lengths_from_position_ids(positions) == seq_lengths


def test_pack_dataset_example_and_format_restored():
    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]})
    assert pack_dataset(ds, 5)[:] == {"input_ids": [[6, 7, 8, 9], [1, 2, 3, 4, 5]], "seq_lengths": [[4], [3, 2]]}
    torch_ds = ds.with_format("torch", columns=["input_ids"])
    packed = pack_dataset(torch_ds, 5)
    assert packed.format["type"] == "torch" and packed.format["columns"] == ["input_ids", "seq_lengths"]
    assert packed[1]["seq_lengths"].tolist() == [3, 2]


def test_pack_dataset_per_batch_and_iterable():
    ds = Dataset.from_dict({"input_ids": [[1, 2], [3, 4], [5, 6], [7, 8]]})
    assert len(pack_dataset(ds, 4)) == 2
    assert len(pack_dataset(ds, 4, map_kwargs={"batch_size": 1})) == 4  # blocks never mix map batches
    it = pack_dataset(ds.to_iterable_dataset(), 4, "bfd_split")
    assert [row["seq_lengths"] for row in it] == [[2, 2], [2, 2]]


def test_pack_dataset_errors():
    # TRL's exception types and phrases first (TypeError / ValueError), then posttrain's fix
    with pytest.raises(TypeError, match=r"^Packing requires all columns to be lists of lists\..*also has \['text'\]"):
        pack_dataset(Dataset.from_dict({"input_ids": [[1]], "text": ["a"]}), 4)
    with pytest.raises(DataFormatError, match=r"also has \['text'\].*select_columns"):
        pack_dataset(Dataset.from_dict({"input_ids": [[1]], "text": ["a"]}), 4)
    bad = Dataset.from_dict({"input_ids": [[1], [1, 2], [3]], "labels": [[1], [1], [3]]})
    with pytest.raises(
        DataFormatError,
        match=r"Row 1, column 'labels': All columns must have values of the same length: 'labels' has 1 items but "
        r"'input_ids' has 2",
    ):
        pack_dataset(bad, 4, map_kwargs={"batch_size": 1})
    ok = Dataset.from_dict({"input_ids": [[1, 2, 3]]})
    with pytest.raises(ValueError, match=r"^Invalid packing strategy 'ffd', must be one of \('bfd', 'bfd_split'"):
        pack_dataset(ok, 4, "ffd")
    with pytest.raises(ValueError, match="seq_length must be a positive int"):
        pack_dataset(ok, 0)
    with pytest.warns(FutureWarning, match="renamed 'bfd_split'"):
        assert pack_dataset(ok, 2, "bfd-requeue")["seq_lengths"] == [[2], [1]]


def test_pack_dataset_matches_trl_outputs():
    """TRL 1.16's outputs (its pack_dataset docstring, checked by running TRL): equal-room bins are filled first come,
    first served, so bfd_split puts the overflow token 5 after [8, 9, 10] and 11 after [6, 7]."""
    ds = Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]],
            "attention_mask": [[1, 1, 1, 0, 0], [1, 0], [1, 1, 0], [1]],
        }
    )
    assert pack_dataset(ds, 4, "bfd")[:] == {
        "input_ids": [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]],
        "attention_mask": [[1, 1, 1, 0], [1, 1, 0, 1], [1, 0]],
        "seq_lengths": [[4], [3, 1], [2]],
    }
    assert pack_dataset(ds, 4, "bfd_split")[:] == {
        "input_ids": [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, 11]],
        "attention_mask": [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1]],
        "seq_lengths": [[4], [3, 1], [2, 1]],
    }
    # two bins with room 1: the first one opened ([16, 17, 18], the earlier row's chunk among equal lengths) takes
    # the next item (TRL's first come, first served; the last-opened bin would give [8, 9, 10, 5])
    ties = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [12, 13, 14, 15, 16, 17, 18], [8, 9, 10], [6, 7]]})
    assert pack_dataset(ties, 4, "bfd_split")["input_ids"] == [
        [1, 2, 3, 4], [12, 13, 14, 15], [16, 17, 18, 5], [8, 9, 10], [6, 7],
    ]  # fmt: skip


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_pack_iterable_dataset_keeps_trl_format(strategy):
    """An IterableDataset packs like a Dataset (same rows, ``seq_lengths`` for BFD) and keeps its format type."""
    ds = Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]],
            "labels": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]],
        }
    )
    expected = pack_dataset(ds, 4, strategy).to_list()
    plain = pack_dataset(ds.to_iterable_dataset(), 4, strategy)
    assert list(plain) == expected
    assert list(next(iter(plain))) == (["input_ids", "labels"] + (["seq_lengths"] if strategy != "wrapped" else []))
    torch_rows = pack_dataset(ds.to_iterable_dataset().with_format("torch"), 4, strategy)
    assert torch_rows._formatting is not None and torch_rows._formatting.format_type == "torch"
    assert [{k: v.tolist() for k, v in row.items()} for row in torch_rows] == expected
