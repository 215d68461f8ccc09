"""Dataset operations every trainer shares, for map-style ``Dataset`` and streaming ``IterableDataset`` alike.

- :func:`is_iterable_dataset`, :func:`configure_streaming`: what a stream is, and the one streaming set-up of the
  trainers (``max_steps`` required, no dataloader workers, no batch dispatch);
- :func:`map_dataset`, :func:`tokenize_dataset`, :func:`filter_dataset`: ``map`` / ``filter`` with
  ``dataset_num_proc`` and a progress description where the dataset takes them;
- :class:`PromptFits`, :func:`prepare_splits`, :func:`check_precompute_supported`: length filtering, named
  evaluation sets, and the refusal to precompute reference columns on a stream.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "PromptFits",
    "check_precompute_supported",
    "configure_streaming",
    "filter_dataset",
    "is_iterable_dataset",
    "map_dataset",
    "prepare_splits",
    "tokenize_dataset",
]


def is_iterable_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a stream: a ``datasets.IterableDataset`` (no length, no ``num_proc``, no columns) or
    any ``torch.utils.data.IterableDataset``."""
    import datasets
    import torch

    return isinstance(dataset, (datasets.IterableDataset, torch.utils.data.IterableDataset))


def map_dataset(dataset: Any, fn: Callable, args: Any, desc: str, **kwargs) -> Any:
    """``dataset.map`` with ``dataset_num_proc`` and a progress description (not for IterableDataset)."""
    if not is_iterable_dataset(dataset):
        kwargs.update(num_proc=getattr(args, "dataset_num_proc", None), desc=desc)
    return dataset.map(fn, **kwargs)


def tokenize_dataset(dataset: Any, tokenize_fn: Callable, tokenizer: Any, args: Any, name: str, *, add_eos: bool):
    """Tokenize every row with ``tokenize_fn(row, tokenizer, add_eos=..., row_index=i)`` (data errors name the row);
    per-row ``tools`` / ``chat_template_kwargs`` columns are read by the tokenize functions."""
    from posttrain.data.tokenization import map_with_row_index

    kwargs = {} if is_iterable_dataset(dataset) else {"num_proc": args.dataset_num_proc, "desc": f"Tokenizing {name}"}
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    return map_with_row_index(dataset, tokenize_fn, fn_kwargs={"tokenizer": tok, "add_eos": add_eos}, **kwargs)


def filter_dataset(dataset: Any, fn: Callable, args: Any, desc: str) -> Any:
    """``dataset.filter`` with ``dataset_num_proc`` and a progress description (not for IterableDataset)."""
    kwargs = (
        {} if is_iterable_dataset(dataset) else {"num_proc": getattr(args, "dataset_num_proc", None), "desc": desc}
    )
    return dataset.filter(fn, **kwargs)


class PromptFits:
    """Picklable filter: keep rows whose prompt leaves room for at least one completion token."""

    def __init__(self, max_length: int):
        self.max_length = max_length

    def __call__(self, row: Mapping[str, Any]) -> bool:
        from posttrain.data.tokenization import prompt_overflows

        return not prompt_overflows(len(row["prompt_ids"]), self.max_length)


def configure_streaming(args: Any, train_dataset: Any) -> bool:
    """The one streaming set-up of every trainer: returns whether ``train_dataset`` is a stream (an
    ``IterableDataset``, which has no length) and prepares ``args`` for it.

    A stream needs ``max_steps`` (raised here, before any model loads), is read in the main process
    (``dataloader_num_workers`` forced to 0: workers would each replay the whole stream) and cannot be dispatched
    from the main process as a whole batch of columns (``accelerator_config.dispatch_batches=False``, as TRL), each
    with a warning when it changes the user's setting.
    """
    if train_dataset is None or not is_iterable_dataset(train_dataset):
        return False
    if args.max_steps is None or args.max_steps <= 0:
        raise ValueError(  # HF Trainer's phrase (what TRL raises, at train()), then why and the fix
            "args.max_steps must be set to a positive value if dataloader does not have a length, was "
            f"{args.max_steps}: a streaming (IterableDataset) train_dataset has no length; set max_steps to a "
            "positive number."
        )
    if args.dataloader_num_workers:
        warnings.warn("IterableDataset training forces dataloader_num_workers=0.", UserWarning, stacklevel=3)
        args.dataloader_num_workers = 0
    if getattr(args.accelerator_config, "dispatch_batches", None) is not False:
        warnings.warn(
            "The train dataset is an IterableDataset: setting accelerator_config.dispatch_batches=False so each "
            "process reads its own batches.",
            UserWarning,
            stacklevel=3,
        )
        args.accelerator_config.dispatch_batches = False
    return True


def _splits(dataset: Any) -> list[Any]:
    if dataset is None:
        return []
    return list(dataset.values()) if isinstance(dataset, dict) else [dataset]


def check_precompute_supported(args: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """``precompute_ref_log_probs`` stores the reference log-probs as dataset columns: refuse an IterableDataset."""
    if args.precompute_ref_log_probs and any(
        is_iterable_dataset(d) for d in _splits(train_dataset) + _splits(eval_dataset)
    ):
        raise ValueError(
            "precompute_ref_log_probs=True is not supported with an IterableDataset (train or eval): the "
            "reference log-probs are stored as dataset columns. Use a map-style Dataset or set it to False."
        )


def prepare_splits(dataset: Any, prepare: Callable[[Any, str], Any], name: str) -> Any:
    """``prepare(dataset, name)``; a dict of datasets (named evaluation sets) becomes the dict of
    ``prepare(split, f"{name}/{key}")``."""
    if isinstance(dataset, dict):
        return {key: prepare(split, f"{name}/{key}") for key, split in dataset.items()}
    return prepare(dataset, name)
