"""Generic checks every trainer runs before its first step (trainer-specific checks live in the trainers).

Each check raises a ``ValueError`` (``TypeError`` for a wrong type) that names the option or dataset and says what
to change, instead of letting the problem surface later as a deep traceback from inside torch or the data loader:

- ``check_output_dir_writable`` — output_dir can be created and written (not under a file, not read-only);
- ``check_train_dataset`` — a train dataset is present and, when sized, not empty;
- ``check_batch_arithmetic`` — batch sizes and accumulation are positive, and ``dataloader_drop_last`` does not
  drop every row;
- ``check_tokenizer`` — the tokenizer can pad (has a pad token or an EOS to pad with).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any


def check_output_dir_writable(output_dir: str | os.PathLike | None) -> None:
    """Create ``output_dir`` if needed and write a probe file into it; raise ValueError naming it if that fails."""
    if output_dir is None:
        raise ValueError("output_dir is None: set output_dir to the folder where checkpoints and logs should go.")
    path = os.fspath(output_dir)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except OSError as err:
        raise ValueError(
            f"output_dir={path!r} is not writable ({type(err).__name__}: {err.strerror or err}). Choose a folder "
            "you can write to (checkpoints, metrics.jsonl and the final model go there)."
        ) from err


def _sized_length(dataset: Any) -> int | None:
    if dataset is None or not hasattr(dataset, "__len__"):
        return None
    try:
        return len(dataset)
    except TypeError:  # e.g. IterableDataset subclasses that define __len__ but raise
        return None


def check_single_split(dataset: Any, arg_name: str = "train_dataset") -> None:
    """A ``DatasetDict`` (or any dict of splits) where one split is expected gets a TypeError naming the fix."""
    if isinstance(dataset, dict):
        splits = ", ".join(map(repr, dataset))
        example = next(iter(dataset), "train")
        raise TypeError(
            f"{arg_name} is a dict of splits ({splits}); pass one split, e.g. {arg_name}=dataset[{example!r}]."
        )


def check_text_only(dataset: Any, trainer_name: str, arg_name: str = "train_dataset") -> None:
    """Trainers without vision-language support refuse image columns instead of silently training on text alone."""
    columns = set(getattr(dataset, "column_names", None) or [])
    found = sorted(columns & {"image", "images"})
    if found:
        raise ValueError(
            f"{arg_name} has the image column(s) {found}, but posttrain's {trainer_name} trains text-only models: the "
            "images would be ignored. Drop them (dataset.remove_columns(...)) to train on the text alone; "
            "vision-language training is available in SFTTrainer, DPOTrainer and KTOTrainer."
        )


def check_train_dataset(dataset: Any, trainer_name: str = "Trainer") -> None:
    """Raise ValueError if training has no data: no dataset, or a sized dataset with zero rows."""
    if dataset is None:
        raise ValueError(f"{trainer_name}.train() needs a train_dataset: pass train_dataset=... when building it.")
    if isinstance(dataset, dict):
        splits = ", ".join(map(repr, dataset))
        raise TypeError(
            f"train_dataset is a dict of splits ({splits}); pass one split, e.g. train_dataset=dataset['train']."
        )
    length = _sized_length(dataset)
    if length == 0:
        raise ValueError(
            f"train_dataset is empty (0 rows) for {trainer_name}. If it had rows before, preprocessing removed them "
            "all (e.g. every row was longer than max_length / max_prompt_length, or filtered as malformed): check "
            "the dataset and those length limits."
        )


def check_batch_arithmetic(args: Any, train_dataset: Any = None) -> None:
    """Positive batch sizes and accumulation; a drop-last data loader must keep at least one batch."""
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, name, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    length = _sized_length(train_dataset)
    world = max(int(getattr(args, "world_size", 1) or 1), 1)
    per_step = int(getattr(args, "per_device_train_batch_size", 1)) * world
    if length and getattr(args, "dataloader_drop_last", False) and length < per_step:
        raise ValueError(
            f"dataloader_drop_last=True with {length} training rows and per_device_train_batch_size × processes = "
            f"{per_step}: every batch would be dropped. Lower per_device_train_batch_size, add rows, or set "
            "dataloader_drop_last=False."
        )


def check_tokenizer(processing_class: Any) -> None:
    """A tokenizer used for batching must have a pad token, or an EOS token that can stand in for it."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)  # processors wrap a tokenizer
    if tokenizer is None or not hasattr(tokenizer, "pad_token_id"):
        return
    if tokenizer.pad_token_id is None and getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}) has neither a pad token nor an EOS token, so batches cannot "
            "be padded. Set one, e.g. tokenizer.pad_token = '<|pad|>' (add it with tokenizer.add_special_tokens "
            "if it is new), before building the trainer."
        )
