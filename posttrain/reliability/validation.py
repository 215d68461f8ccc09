"""Generic checks every trainer runs before its first step (trainer-specific checks live in the trainers).

Each check raises a ``ValueError`` (``TypeError`` for a wrong type) that names the option or dataset and says what
to change, instead of letting the problem surface later as a deep traceback from inside torch or the data loader:

- ``check_output_dir_writable`` — output_dir can be created and written (not under a file, not read-only);
- ``check_dataset_type`` / ``check_single_split`` — a ``datasets.Dataset`` (one split), not a list, DataFrame or
  dict of splits;
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


def check_dataset_type(dataset: Any, arg_name: str = "train_dataset") -> None:
    """A Python list or a pandas (or polars) DataFrame where a ``datasets.Dataset`` is expected gets a TypeError that
    says what was passed and how to convert it (``None``, datasets and dicts of them pass)."""
    if dataset is None:
        return
    if isinstance(dataset, (list, tuple)):
        first = type(dataset[0]).__name__ if len(dataset) else None
        what = f"a Python {type(dataset).__name__} of {len(dataset)} rows" + (f" ({first}s)" if first else "")
        raise TypeError(
            f"{arg_name} is {what}, not a datasets.Dataset. Convert it first: "
            f"{arg_name}=datasets.Dataset.from_list(rows) (rows are dicts of column -> value)."
        )
    module = type(dataset).__module__ or ""
    if type(dataset).__name__ == "DataFrame" and module.split(".")[0] in ("pandas", "polars"):
        library = module.split(".")[0]
        fix = "datasets.Dataset.from_pandas(df, preserve_index=False)" if library == "pandas" else (
            "datasets.Dataset.from_polars(df)"
        )
        raise TypeError(
            f"{arg_name} is a {library} DataFrame ({len(dataset)} rows, columns {list(dataset.columns)}), not a "
            f"datasets.Dataset. Convert it first: {arg_name}={fix}."
        )


def check_single_split(dataset: Any, arg_name: str = "train_dataset") -> None:
    """A ``DatasetDict`` (or any dict of splits) where one split is expected gets a TypeError naming the fix; so do
    a list or a DataFrame (:func:`check_dataset_type`)."""
    check_dataset_type(dataset, arg_name)
    if isinstance(dataset, dict):
        splits = ", ".join(map(repr, dataset))
        example = next(iter(dataset), "train")
        raise TypeError(
            f"{arg_name} is a dict of splits ({splits}); pass one split, e.g. {arg_name}=dataset[{example!r}]."
        )


def check_datasets(train_dataset: Any, eval_dataset: Any = None) -> None:
    """What every trainer checks first: ``train_dataset`` is one ``datasets`` split (not a list, DataFrame or dict of
    splits); ``eval_dataset`` is a dataset or a dict of them."""
    check_single_split(train_dataset, "train_dataset")
    check_not_empty(train_dataset, "train_dataset")
    splits = eval_dataset.items() if isinstance(eval_dataset, dict) else [(None, eval_dataset)]
    for name, split in splits:
        arg = "eval_dataset" if name is None else f"eval_dataset[{name!r}]"
        check_dataset_type(split, arg)
        check_not_empty(split, arg)


def check_not_empty(dataset: Any, arg_name: str) -> None:
    """Raise ValueError when a sized dataset has 0 rows, naming ``arg_name`` (streams pass: they have no length)."""
    if _sized_length(dataset) == 0:
        columns = getattr(dataset, "column_names", None)
        raise ValueError(
            f"{arg_name} has 0 rows{f' (columns {columns})' if columns else ''}: there is nothing to "
            f"{'train' if arg_name == 'train_dataset' else 'evaluate'} on. Check the split and any filter or "
            f"select applied before{'' if arg_name == 'train_dataset' else f', or pass {arg_name}=None'}."
        )


def check_text_only(dataset: Any, trainer_name: str, arg_name: str = "train_dataset") -> None:
    """Trainers without vision-language support refuse image columns instead of silently training on text alone."""
    columns = set(getattr(dataset, "column_names", None) or [])
    found = sorted(columns & {"image", "images"})
    if found:
        raise ValueError(
            f"{arg_name} has the image column(s) {found}, but posttrain's {trainer_name} trains text-only models: the "
            "images would be ignored. Drop them (dataset.remove_columns(...)) to train on the text alone; "
            "vision-language training is available in SFTTrainer, DPOTrainer, KTOTrainer, GRPOTrainer and RLOOTrainer."
        )


TRAIN_DATASET_REQUIRED = "`train_dataset` is required"  # TRL's phrase; users and TRL's tests match on it


def require_train_dataset(dataset: Any, trainer_name: str) -> None:
    """Raise at construction, as TRL does, when no ``train_dataset`` is given (ValueError, TRL's phrase first).

    Evaluation-only runs pass a train dataset too (TRL's trainers need one); ``evaluate(eval_dataset=...)`` then
    prepares any evaluation set it is given."""
    if dataset is None:
        raise ValueError(
            f"{TRAIN_DATASET_REQUIRED}: {trainer_name} prepares and trains on it. Pass train_dataset=... (a Dataset "
            "or IterableDataset); to only evaluate, pass one too and call trainer.evaluate(eval_dataset=...)."
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


def _is_empty(value: Any) -> bool:
    """An empty completion: ``""`` / whitespace, no token ids, or messages whose contents are all empty."""
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, (list, tuple)):
        if not value:
            return True
        if all(isinstance(m, dict) for m in value):
            return all(_is_empty(m.get("content")) and not m.get("tool_calls") for m in value)
    return False


def check_preference_pairs(dataset: Any, trainer_name: str, split: str = "train") -> None:
    """Warn about preference rows that teach nothing — ``chosen == rejected``, or an empty chosen / rejected side —
    with their counts and first row indices; raise ValueError when every row is such a row.

    Works on raw (``chosen``/``rejected``) and pre-tokenized (``chosen_ids``/``rejected_ids``) rows of a sized
    dataset; streaming datasets are not scanned.
    """
    import warnings

    if _sized_length(dataset) is None or not hasattr(dataset, "column_names"):
        return
    columns = dataset.column_names
    keys = next((k for k in (("chosen", "rejected"), ("chosen_ids", "rejected_ids")) if set(k) <= set(columns)), None)
    if keys is None:
        return
    chosen, rejected = dataset[keys[0]], dataset[keys[1]]
    n = len(chosen)
    if n == 0:
        return
    same = [i for i in range(n) if chosen[i] == rejected[i]]
    empty_chosen = [i for i in range(n) if _is_empty(chosen[i])]
    empty_rejected = [i for i in range(n) if _is_empty(rejected[i])]
    bad = set(same) | set(empty_chosen) | set(empty_rejected)
    if not bad:
        return

    def part(label: str, rows: list[int]) -> str | None:
        if not rows:
            return None
        shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        return f"{len(rows)} of {n} rows have {label} (rows {shown})"

    parts = [
        part(f"{keys[0]} == {keys[1]}", same),
        part(f"an empty {keys[0]}", empty_chosen),
        part(f"an empty {keys[1]}", empty_rejected),
    ]
    summary = "; ".join(p for p in parts if p)
    if len(bad) == n:
        raise ValueError(
            f"Every row of the {split} dataset for {trainer_name} is an unusable preference pair: {summary}. A pair "
            f"needs two different, non-empty completions; check how `{keys[0]}` and `{keys[1]}` were built (e.g. the "
            "same column mapped twice)."
        )
    warnings.warn(
        f"{trainer_name}: {summary} in the {split} dataset. Such pairs carry no preference signal (identical sides "
        "have zero margin; an empty side compares against nothing); drop them with dataset.filter(...) if they are "
        "mistakes.",
        UserWarning,
        stacklevel=3,
    )


ALLOW_NEGATIVE_BETA_HELP = (
    "posttrain: accept a negative beta (it reverses the objective: DPO then prefers the rejected side, GRPO/RLOO "
    "reward moving away from the reference). Without it a negative beta is refused as a likely sign slip."
)


def check_beta(config: Any, meaning: str) -> None:
    """Refuse ``beta < 0`` unless ``config.allow_negative_beta`` (TRL accepts it silently; it is almost always a
    typo that trains the opposite of what was meant)."""
    beta = getattr(config, "beta", None)
    if beta is None or beta >= 0 or getattr(config, "allow_negative_beta", False):
        return
    raise ValueError(
        f"beta={beta} is negative: {meaning}. Use beta >= 0, or set allow_negative_beta=True if you mean it."
    )


def check_liger_peft_head(model: Any, args: Any) -> None:
    """Refuse ``use_liger_kernel=True`` with a PEFT adapter on ``lm_head`` (ValueError, TRL's phrase first).

    Liger's fused kernels read ``lm_head.weight`` directly, so the adapter on the head would never be trained.
    Without Liger, posttrain trains such an adapter through the model's logits, so only this combination is refused
    (TRL refuses an adapter on ``lm_head`` whatever the kernel)."""
    if not getattr(args, "use_liger_kernel", False):
        return
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if callable(get_output_embeddings) else None
    if head is None:
        return
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no peft: no adapter
        return
    if isinstance(head, BaseTunerLayer):
        raise ValueError(
            "Applying a PEFT adapter to `lm_head` is not supported: with use_liger_kernel=True the fused kernels "
            "compute the loss from `lm_head.weight` directly, so the adapter would never be trained. Remove "
            "'lm_head' from the adapter's `target_modules`, or set use_liger_kernel=False (posttrain then trains "
            "the adapter through the model's logits)."
        )
