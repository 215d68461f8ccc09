"""Sequence packing for SFT: ``pack_dataset`` (TRL's strategies, computed in Arrow) and position-id helpers.

Strategies (``SFTConfig.packing_strategy``):

- ``"bfd"``: truncate each row to ``seq_length``, then Best-Fit-Decreasing bin packing: rows sorted by length
  (longest first) go into the open block with the *least* room that still fits them, or a new block. Row
  boundaries are kept and recorded in a ``seq_lengths`` column; only tokens beyond ``seq_length`` in a row are lost.
- ``"bfd_split"``: split rows longer than ``seq_length`` into ``seq_length`` chunks first (no token is lost), then BFD.
- ``"wrapped"``: concatenate all rows and cut every ``seq_length`` tokens (boundaries are not kept, no
  ``seq_lengths``; the last block may be shorter).

Like TRL, packing runs per ``map`` batch (``map_kwargs={"batch_size": ...}``, default 1000 rows): blocks never mix rows
from two batches. All list columns (``input_ids``, ``labels``, masks, ...) are packed together and must have the
same length in each row; empty rows are dropped. BFD uses a segment tree over "room left" so each placement costs
O(log seq_length).
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from posttrain.data.formats import DataFormatError

PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")


class PackingColumnsError(DataFormatError, TypeError):
    """A column that is not a list column was given to ``pack_dataset``: a ``TypeError`` as in TRL (whose message
    starts the same way) and a :class:`DataFormatError` as posttrain's other dataset errors."""

    def __reduce__(self):
        return type(self), (self.problem,)


# ----------------------------------------------------------------------------------------------------------------
# Bin packing


class _RoomTree:
    """Counts of open blocks by remaining room (0..capacity), with "smallest room >= n" queries in O(log capacity)."""

    def __init__(self, capacity: int):
        self.size = 1
        while self.size < capacity + 1:
            self.size *= 2
        self.counts = [0] * (2 * self.size)

    def add(self, room: int, delta: int) -> None:
        i = room + self.size
        while i:
            self.counts[i] += delta
            i //= 2

    def smallest_at_least(self, n: int) -> int | None:
        i = n + self.size
        if self.counts[i] > 0:
            return n
        # climb until a right sibling holds a block (it covers only rooms > n), then descend to its leftmost one
        while i > 1:
            if i % 2 == 0 and self.counts[i + 1] > 0:
                i += 1
                break
            i //= 2
        else:
            return None
        while i < self.size:
            i = 2 * i if self.counts[2 * i] > 0 else 2 * i + 1
        return i - self.size


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Assign items to bins of size ``capacity`` by Best-Fit Decreasing.

    Items are taken longest first (ties: original order); each goes to the open bin with the least remaining room
    that fits it (among bins with equal room, the one that reached that room first, as TRL), else to a new bin.
    Returns, per bin in creation order, the item indices in placement order.
    Every item must satisfy ``1 <= length <= capacity``.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    tree = _RoomTree(capacity)
    bins: list[list[int]] = []
    by_room: dict[int, deque[int]] = {}
    for item in order:
        n = lengths[item]
        if not 1 <= n <= capacity:
            raise ValueError(f"Item {item} has length {n}; lengths must be in [1, {capacity}].")
        room = tree.smallest_at_least(n)
        if room is None:
            bins.append([item])
            b, new_room = len(bins) - 1, capacity - n
        else:
            b = by_room[room].popleft()
            tree.add(room, -1)
            bins[b].append(item)
            new_room = room - n
        if new_room > 0:
            by_room.setdefault(new_room, deque()).append(b)
            tree.add(new_room, +1)
    return bins


# ----------------------------------------------------------------------------------------------------------------
# Arrow packing


def _list_columns(table: Any) -> tuple[list[str], list[str]]:
    import pyarrow as pa

    lists, others = [], []
    for name, col in zip(table.column_names, table.columns):
        (lists if pa.types.is_list(col.type) or pa.types.is_large_list(col.type) else others).append(name)
    return lists, others


def _gather_indices(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.repeat(starts - offsets, lengths) + np.arange(total)


def _make_list_array(offsets: np.ndarray, values: Any, list_type: Any) -> Any:
    import pyarrow as pa

    if pa.types.is_large_list(list_type):
        return pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), values, type=list_type)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values, type=list_type)


def _pack_table(table: Any, indices: list[int], seq_length: int, strategy: str) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    lists, others = _list_columns(table)
    if others:
        raise PackingColumnsError(
            f"Packing requires all columns to be lists of lists. pack_dataset packs list columns only, but the "
            f"dataset also has {others}. Remove them first, e.g. "
            f"dataset.select_columns({lists}) or dataset.remove_columns({others})."
        )
    if not lists:
        raise DataFormatError("pack_dataset found no list columns to pack (expected e.g. 'input_ids').")
    cols = {name: table.column(name).combine_chunks() for name in lists}
    lengths = pc.fill_null(pc.list_value_length(cols[lists[0]]), 0).to_numpy().astype(np.int64)
    for name in lists[1:]:
        other = pc.fill_null(pc.list_value_length(cols[name]), 0).to_numpy()
        bad = np.nonzero(other != lengths)[0]
        if len(bad):
            i = int(bad[0])
            raise DataFormatError(
                f"All columns must have values of the same length: {name!r} has {int(other[i])} items but "
                f"{lists[0]!r} has {int(lengths[i])}; every list column of a row must have the same length to be "
                "packed.",
                row=indices[i],
                column=name,
            )
    values = {name: pc.list_flatten(cols[name]) for name in lists}
    row_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)

    if strategy == "wrapped":
        total = int(lengths.sum())
        offsets = np.append(np.arange(0, total, seq_length), total) if total else np.zeros(1, dtype=np.int64)
        arrays = [_make_list_array(offsets, values[name], cols[name].type) for name in lists]
        return pa.Table.from_arrays(arrays, names=lists)

    # chunks: (row, start within row, length)
    if strategy == "bfd":
        rows = np.nonzero(lengths > 0)[0]
        chunk_rows, chunk_starts, chunk_lens = (
            rows,
            np.zeros(len(rows), dtype=np.int64),
            np.minimum(lengths[rows], seq_length),
        )
    else:  # bfd_split
        n_chunks = np.where(lengths > 0, -(-lengths // seq_length), 0)
        chunk_rows = np.repeat(np.arange(len(lengths)), n_chunks)
        first = np.concatenate([[0], np.cumsum(n_chunks)[:-1]])
        k = np.arange(len(chunk_rows)) - np.repeat(first, n_chunks)  # chunk number within its row
        chunk_starts = k * seq_length
        chunk_lens = np.minimum(lengths[chunk_rows] - chunk_starts, seq_length)
    bins = best_fit_decreasing(chunk_lens.tolist(), seq_length)
    order = np.array([c for b in bins for c in b], dtype=np.int64)
    per_bin = np.array([sum(int(chunk_lens[c]) for c in b) for b in bins], dtype=np.int64)
    take = _gather_indices(row_starts[chunk_rows[order]] + chunk_starts[order], chunk_lens[order])
    take_arr = pa.array(take, type=pa.int64())
    offsets = np.concatenate([[0], np.cumsum(per_bin)]).astype(np.int64)
    arrays = [_make_list_array(offsets, values[name].take(take_arr), cols[name].type) for name in lists]
    seq_offsets = np.concatenate([[0], np.cumsum([len(b) for b in bins])]).astype(np.int64)
    seq_lengths = pa.ListArray.from_arrays(
        pa.array(seq_offsets, type=pa.int32()), pa.array(chunk_lens[order], type=pa.int32())
    )
    return pa.Table.from_arrays([*arrays, seq_lengths], names=[*lists, "seq_lengths"])


def pack_dataset(
    dataset: Any,
    seq_length: int,
    strategy: Literal["bfd", "bfd_split", "wrapped"] = "bfd",
    map_kwargs: dict[str, Any] | None = None,
) -> Any:
    """Pack rows of token lists into blocks of at most ``seq_length`` tokens.

    Args:
        dataset: ``datasets.Dataset`` / ``DatasetDict`` / ``IterableDataset`` whose columns are all lists of equal
            per-row length (e.g. ``input_ids``, ``labels``, ``completion_mask``).
        seq_length: Block size (SFT's ``max_length``).
        strategy: ``"bfd"``, ``"bfd_split"`` or ``"wrapped"`` (module docstring). ``"bfd-requeue"`` is accepted as
            the old name of ``"bfd_split"`` with a warning.
        map_kwargs: Extra ``dataset.map`` arguments (``batch_size``, ``num_proc``, ``desc``...).

    Returns:
        The packed dataset, in the input's format; BFD strategies add ``seq_lengths`` (list of int per block).

    Example:
        >>> ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]})
        >>> pack_dataset(ds, 5)[:]
        {'input_ids': [[6, 7, 8, 9], [1, 2, 3, 4, 5]], 'seq_lengths': [[4], [3, 2]]}
    """
    import datasets

    if strategy == "bfd-requeue":
        warnings.warn("packing_strategy 'bfd-requeue' was renamed 'bfd_split'.", FutureWarning, stacklevel=2)
        strategy = "bfd_split"
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(
            f"Invalid packing strategy '{strategy}', must be one of {PACKING_STRATEGIES}. (posttrain also accepts "
            "'bfd-requeue', the old name of 'bfd_split'.)"
        )
    if not isinstance(seq_length, (int, np.integer)) or seq_length < 1:
        raise ValueError(f"seq_length must be a positive int, got {seq_length!r} (set max_length when packing).")
    map_kwargs = dict(map_kwargs or {})
    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return type(dataset)({k: pack_dataset(v, seq_length, strategy, map_kwargs) for k, v in dataset.items()})
    fn_kwargs = {"seq_length": int(seq_length), "strategy": strategy}
    if isinstance(dataset, datasets.Dataset):
        fmt = dataset.format
        packed = dataset.with_format("arrow").map(
            _pack_table, batched=True, with_indices=True, fn_kwargs=fn_kwargs, **map_kwargs
        )
        columns = fmt["columns"]
        if columns is not None and strategy != "wrapped" and "seq_lengths" not in columns:
            columns = [*columns, "seq_lengths"]
        return packed.with_format(
            fmt["type"], columns=columns, output_all_columns=fmt["output_all_columns"], **fmt["format_kwargs"]
        )
    # IterableDataset: same function on Arrow batches, then back to the input's format (as TRL: "torch" stays "torch")
    formatting = getattr(dataset, "_formatting", None)
    format_type = formatting.format_type if formatting is not None else None
    return (
        dataset.with_format("arrow")
        .map(_pack_table, batched=True, with_indices=True, fn_kwargs=fn_kwargs, **map_kwargs)
        .with_format(format_type)
    )


# ----------------------------------------------------------------------------------------------------------------
# Position ids


def position_ids_from_seq_lengths(seq_lengths: Sequence[int]) -> list[int]:
    """Position ids restarting at 0 at the start of every packed sequence: ``[3, 2] -> [0, 1, 2, 0, 1]``."""
    return [p for n in seq_lengths for p in range(int(n))]


def seq_lengths_from_position_ids(position_ids: Sequence[int]) -> list[int]:
    """Inverse of ``position_ids_from_seq_lengths``: a sequence starts wherever the position id is 0."""
    lengths: list[int] = []
    for p in position_ids:
        if p == 0 or not lengths:
            lengths.append(1)
        else:
            lengths[-1] += 1
    return lengths
