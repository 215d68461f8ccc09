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
    with pytest.raises(DataFormatError, match=r"also has \['text'\].*select_columns"):
        pack_dataset(Dataset.from_dict({"input_ids": [[1]], "text": ["a"]}), 4)
    bad = Dataset.from_dict({"input_ids": [[1], [1, 2], [3]], "labels": [[1], [1], [3]]})
    with pytest.raises(DataFormatError, match=r"Row 1, column 'labels': has 1 items but 'input_ids' has 2"):
        pack_dataset(bad, 4, map_kwargs={"batch_size": 1})
    ok = Dataset.from_dict({"input_ids": [[1, 2, 3]]})
    with pytest.raises(ValueError, match="Unknown packing strategy 'ffd'"):
        pack_dataset(ok, 4, "ffd")
    with pytest.raises(ValueError, match="seq_length must be a positive int"):
        pack_dataset(ok, 0)
    with pytest.warns(FutureWarning, match="renamed 'bfd_split'"):
        assert pack_dataset(ok, 2, "bfd-requeue")["seq_lengths"] == [[2], [1]]
