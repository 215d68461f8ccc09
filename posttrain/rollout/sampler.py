"""Prompt sampling for online RL: groups of repeated prompts and the generation-batch arithmetic.

``RepeatSampler`` yields each prompt index ``num_generations`` times in a row, so that a group of G completions of
the same prompt stays contiguous (and can be split across processes, since rewards are gathered before the group
statistics). Each chunk of prompts is repeated ``steps_per_generation × num_iterations`` times so the dataloader
stays in step with the trainer, which generates once per chunk and replays the buffered completions for the other
micro-steps (TRL's scheme).

``resolve_generation_batch`` implements TRL's ``generation_batch_size`` / ``steps_per_generation`` rules with TRL's
error messages. ``RepeatIterableDataset`` does the same grouping for ``datasets.IterableDataset`` streams.

Deliberate difference from TRL: the permutation of an epoch is seeded with ``seed + epoch`` (``set_epoch``), not
drawn from one generator that advances across epochs, so a run resumed in a later epoch sees the same prompts as
an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, Sampler


class RepeatSampler(Sampler[int]):
    """Sampler that repeats each index ``mini_repeat_count`` times and each chunk ``repeat_count`` times (TRL's).

    Args:
        data_source: Sized dataset to sample from.
        mini_repeat_count: Consecutive repeats of each index (the number of generations G).
        batch_size: Unique indices per chunk (``generation_batch_size // G``).
        repeat_count: Times each whole chunk is replayed (``steps_per_generation × num_iterations``).
        shuffle: Shuffle the indices each epoch.
        seed: Seed of the shuffle (the permutation of epoch ``e`` uses ``seed + e``).
        drop_last: Drop an incomplete last chunk (TRL's GRPO: it would break the group/batch arithmetic). False keeps
            it, as the plain Trainer dataloader of TRL's Online DPO, A2PO and GKD does; only with ``repeat_count``
            1, since replays of a short chunk would straddle the dataloader's fixed-size batches.

    Example (``mini_repeat_count=2, batch_size=3, repeat_count=2``, no shuffle, 6 rows)::

        0 0 1 1 2 2 | 0 0 1 1 2 2 | 3 3 4 4 5 5 | 3 3 4 4 5 5
    """

    def __init__(
        self,
        data_source: Sized,
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = True,
    ):
        if mini_repeat_count < 1 or batch_size < 1 or repeat_count < 1:
            raise ValueError(
                f"RepeatSampler needs positive counts, got mini_repeat_count={mini_repeat_count}, "
                f"batch_size={batch_size}, repeat_count={repeat_count}."
            )
        _check_drop_last(drop_last, repeat_count)
        self.drop_last = drop_last
        self.data_source = data_source
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.num_samples = len(data_source)
        self.shuffle = shuffle
        self.seed = 0 if seed is None else int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` (called by the Trainer/accelerate at each epoch)."""
        self.epoch = int(epoch)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        chunks = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for chunk in chunks:
            if len(chunk) < self.batch_size and self.drop_last:  # would break the group/batch arithmetic
                continue
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(self.mini_repeat_count):
                        yield index

    def __len__(self) -> int:
        kept = (self.num_samples // self.batch_size) * self.batch_size if self.drop_last else self.num_samples
        return kept * self.mini_repeat_count * self.repeat_count


def _check_drop_last(drop_last: bool, repeat_count: int) -> None:
    if not drop_last and repeat_count != 1:
        raise ValueError(
            f"Keeping a short last chunk (drop_last=False) needs repeat_count=1, got {repeat_count}: its replays would "
            "straddle the dataloader's fixed-size batches."
        )


class RepeatIterableDataset(IterableDataset):
    """``RepeatSampler``'s order for a stream: read ``batch_size`` rows, replay them ``repeat_count`` times with
    each row repeated ``mini_repeat_count`` times. An incomplete last chunk is dropped unless ``drop_last`` is False.

    ``datasets.IterableDataset`` streams are shuffled with their own buffered shuffle (``buffer_size`` rows) when
    ``shuffle`` is set. Use with ``dataloader_num_workers=0`` (several workers would each replay the stream).
    """

    def __init__(
        self,
        dataset: Iterable[dict[str, Any]],
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int | None = None,
        buffer_size: int = 1000,
        drop_last: bool = True,
    ):
        _check_drop_last(drop_last, repeat_count)
        self.drop_last = drop_last
        self.dataset = dataset
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.shuffle = shuffle
        self.seed = 0 if seed is None else int(seed)
        self.buffer_size = buffer_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _stream(self) -> Iterable[dict[str, Any]]:
        dataset = self.dataset
        if self.shuffle and hasattr(dataset, "shuffle"):
            dataset = dataset.shuffle(seed=self.seed + self.epoch, buffer_size=self.buffer_size)
        return dataset

    def __iter__(self) -> Iterator[dict[str, Any]]:
        chunk: list[dict[str, Any]] = []
        for row in self._stream():
            chunk.append(row)
            if len(chunk) == self.batch_size:
                yield from self._replay(chunk)
                chunk = []
        if chunk and not self.drop_last:
            yield from self._replay(chunk)

    def _replay(self, chunk: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for _ in range(self.repeat_count):
            for item in chunk:
                for _ in range(self.mini_repeat_count):
                    yield item


def repeat_iterable_dataset(
    dataset: Iterable[dict[str, Any]],
    mini_repeat_count: int,
    batch_size: int = 1,
    repeat_count: int = 1,
    shuffle: bool = True,
    seed: int | None = None,
    buffer_size: int = 1000,
    drop_last: bool = True,
) -> RepeatIterableDataset:
    """TRL's ``repeat_iterable_dataset``: a stream with ``RepeatSampler``'s grouping (see ``RepeatIterableDataset``)."""
    return RepeatIterableDataset(
        dataset,
        mini_repeat_count,
        batch_size,
        repeat_count,
        shuffle=shuffle,
        seed=seed,
        buffer_size=buffer_size,
        drop_last=drop_last,
    )


@dataclass(frozen=True)
class GenerationBatchPlan:
    """Resolved batch arithmetic for one process group.

    Attributes:
        generation_batch_size: Completions generated per round, over all processes.
        steps_per_generation: Micro-steps served by one round (per process).
        prompts_per_generation: Unique prompts per round (``generation_batch_size // num_generations``).
        local_rows: Rows (completions) per process per round (``per_device_train_batch_size × steps_per_generation``).
    """

    generation_batch_size: int
    steps_per_generation: int
    prompts_per_generation: int
    local_rows: int


def resolve_generation_batch(
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    num_generations: int,
    world_size: int = 1,
    generation_batch_size: int | None = None,
    steps_per_generation: int | None = None,
    trainer_name: str = "GRPO",
) -> GenerationBatchPlan:
    """Apply TRL's rules for ``generation_batch_size`` and ``steps_per_generation`` (features.md §B1.2).

    With ``P`` processes and ``b = per_device_train_batch_size``:

    - neither set: ``steps_per_generation = gradient_accumulation_steps``, ``generation_batch_size = b·P·spg``;
    - only ``generation_batch_size``: it must be divisible by ``b·P``; ``spg = generation_batch_size / (b·P)``;
    - only ``steps_per_generation``: ``generation_batch_size = b·P·spg``;
    - both: error. Always: ``generation_batch_size`` divisible by ``num_generations`` and ``num_generations ≥ 2``.
    """
    global_batch = per_device_train_batch_size * world_size
    if generation_batch_size is not None and steps_per_generation is not None:
        raise ValueError(
            "'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time"
        )
    if generation_batch_size is None and steps_per_generation is None:
        steps_per_generation = gradient_accumulation_steps
    if generation_batch_size is None:
        if steps_per_generation < 1:
            raise ValueError(f"steps_per_generation must be >= 1, got {steps_per_generation}.")
        generation_batch_size = global_batch * steps_per_generation
    else:
        if generation_batch_size % global_batch != 0:
            raise ValueError(
                f"generation_batch_size ({generation_batch_size}) must be divisible by the global batch size "
                f"({global_batch})."
            )
        steps_per_generation = generation_batch_size // global_batch
    if num_generations is None or num_generations < 2:
        raise ValueError(
            f"{trainer_name} requires at least 2 generations per prompt to calculate the advantages. You provided "
            f"{num_generations}, which is less than the minimum required."
        )
    if generation_batch_size % num_generations != 0:
        raise ValueError(
            f"generation_batch_size ({generation_batch_size}) must be divisible by num_generations "
            f"({num_generations})."
        )
    return GenerationBatchPlan(
        generation_batch_size=generation_batch_size,
        steps_per_generation=steps_per_generation,
        prompts_per_generation=generation_batch_size // num_generations,
        local_rows=per_device_train_batch_size * steps_per_generation,
    )


def check_eval_batch(per_device_eval_batch_size: int, world_size: int, num_generations_eval: int) -> None:
    """TRL's eval rule: the global eval batch must hold whole groups of ``num_generations_eval`` completions."""
    if (per_device_eval_batch_size * world_size) % num_generations_eval != 0:
        raise ValueError(
            f"The global eval batch size ({per_device_eval_batch_size} * {world_size}) must be divisible by the "
            f"number of generations used for evaluation ({num_generations_eval})."
        )
