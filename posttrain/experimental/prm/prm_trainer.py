"""PRMTrainer: process reward models (https://huggingface.co/papers/2211.14275) with TRL's API.

A stepwise-supervision row (``prompt``, ``completions``: the steps, ``labels``: one bool per step) becomes one
token sequence ``[bos] prompt step_1 sep step_2 sep ...``; each step's label sits on the last token of its
``step_i + step_separator`` (the separator) and every other position is ``-100``. With ``train_on_last_step_only``
only the final step is labelled in the training set (evaluation keeps every label, as TRL). The model is a token
classifier with two labels (``AutoModelForTokenClassification``; a hub id / path is loaded as one with
``num_labels=2``) and the loss is :func:`posttrain.core.process_reward.step_label_loss` — cross-entropy at the
labelled positions. Evaluation reports ``accuracy`` over labelled steps (TRL's ``compute_accuracy``).

TRL removed this trainer from recent releases; its behaviour here follows the last one that shipped it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import chain
from typing import Any

import numpy as np
import torch

from posttrain.core.process_reward import IGNORE_INDEX, step_label_loss
from posttrain.data.dataset_ops import map_dataset, prepare_splits
from posttrain.data.formats import STEPWISE_SUPERVISION, DataFormatError, column_names, validate_format
from posttrain.distributed import sum_over_processes
from posttrain.experimental.prm.prm_config import PRMConfig
from posttrain.models.loading import disable_dropout_in_model, resolve_processing_class
from posttrain.reliability.validation import check_single_split, check_text_only
from posttrain.trainers.base import BaseTrainer

__all__ = ["PRMTrainer", "compute_accuracy", "tokenize_stepwise_row"]


def compute_accuracy(eval_pred: Any) -> dict[str, float]:
    """TRL's default PRM metric: argmax accuracy over the labelled positions of ``(B, T, C)`` predictions."""
    predictions, labels = eval_pred
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    keep = labels != IGNORE_INDEX
    if predictions.ndim == 3:
        predictions = predictions.argmax(axis=-1)
    return {"accuracy": float((predictions[keep] == labels[keep]).mean()) if keep.any() else float("nan")}


def tokenize_stepwise_row(
    features: Mapping[str, Any],
    tokenizer: Any,
    step_separator: str,
    max_length: int | None,
    max_completion_length: int | None,
    train_on_last_step_only: bool,
    is_eval: bool,
    row_index: int | None = None,
) -> dict[str, list[int]]:
    """``{"input_ids", "labels"}`` of one stepwise-supervision row (TRL's ``PRMTrainer.tokenize_row``)."""
    steps, step_labels = features["completions"], features["labels"]
    if not isinstance(steps, (list, tuple)) or not isinstance(step_labels, (list, tuple)):
        raise DataFormatError("'completions' and 'labels' must be lists (one entry per step).", row=row_index)
    if len(steps) != len(step_labels):
        raise DataFormatError(
            f"{len(steps)} steps in 'completions' but {len(step_labels)} entries in 'labels'; give one label per step.",
            row=row_index,
            column="labels",
        )
    if not steps:
        raise DataFormatError("the row has no steps; 'completions' needs at least one.", row=row_index)
    prompt_ids = tokenizer(features["prompt"], add_special_tokens=False)["input_ids"]
    steps_ids = [tokenizer(step, add_special_tokens=False)["input_ids"] for step in steps]
    if train_on_last_step_only and not is_eval:
        labels = [IGNORE_INDEX] * (len(step_labels) - 1) + [int(step_labels[-1])]
    else:
        labels = [int(label) for label in step_labels]
    separator_ids = tokenizer.encode(step_separator, add_special_tokens=False)
    steps_ids = [ids + separator_ids for ids in steps_ids]
    token_labels = [[IGNORE_INDEX] * (len(ids) - 1) + [label] for ids, label in zip(steps_ids, labels)]
    completion_ids = list(chain(*steps_ids))
    completion_labels = list(chain(*token_labels))
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids
    if max_completion_length is not None:
        completion_ids = completion_ids[:max_completion_length]
        completion_labels = completion_labels[:max_completion_length]
    input_ids = prompt_ids + completion_ids
    all_labels = [IGNORE_INDEX] * len(prompt_ids) + completion_labels
    if max_length is not None:
        input_ids, all_labels = input_ids[:max_length], all_labels[:max_length]
    return {"input_ids": input_ids, "labels": all_labels}


class _TokenizeStepwise:
    """Picklable ``map`` function with the row index for error messages."""

    def __init__(self, tokenizer: Any, args: PRMConfig, is_eval: bool):
        self.tokenizer = tokenizer
        self.kwargs = dict(
            step_separator=args.step_separator,
            max_length=args.max_length,
            max_completion_length=args.max_completion_length,
            train_on_last_step_only=args.train_on_last_step_only,
            is_eval=is_eval,
        )

    def __call__(self, row: Mapping[str, Any], index: int) -> dict[str, list[int]]:
        return tokenize_stepwise_row(row, self.tokenizer, row_index=index, **self.kwargs)


class PRMTrainer(BaseTrainer):
    """Trainer for process reward models (TRL's ``trl.experimental.prm.PRMTrainer`` signature).

    Args:
        model: An ``AutoModelForTokenClassification`` (two labels), or a hub id / path loaded as one with
            ``num_labels=2`` (``args.model_init_kwargs`` apply).
        args: ``PRMConfig``; None → ``PRMConfig(f"{model_name}-PRM")``.
        data_collator: Defaults to ``transformers.DataCollatorForTokenClassification`` (labels padded with -100).
        train_dataset: Stepwise-supervision dataset (``prompt``, ``completions``, ``labels``), or pre-tokenized
            ``input_ids`` + ``labels``.
        eval_dataset: Same format, or a dict of them.
        processing_class: Tokenizer; None loads it from the model's path.
        model_init: Builds the model when ``model`` is None (called once).
        compute_metrics: Defaults to :func:`compute_accuracy`.
        callbacks, optimizers, preprocess_logits_for_metrics: As ``transformers.Trainer``.
        peft_config: A ``peft.PeftConfig`` to wrap ``model`` with.
    """

    _tag_names = ["trl", "prm"]

    def __init__(
        self,
        model: str | torch.nn.Module | None = None,
        args: PRMConfig | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable[[], torch.nn.Module] | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        preprocess_logits_for_metrics: Callable | None = None,
        peft_config: Any = None,
    ):
        if model is None:
            if model_init is None:
                raise ValueError("PRMTrainer needs a model (a token-classification model, or a hub id / path).")
            model = model_init()  # built once here; hyper-parameter search re-initialisation is not supported
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        args = self.resolve_args(args, model, PRMConfig, "PRM")
        processing_class = resolve_processing_class(model, processing_class, trust_remote_code=args.trust_remote_code)
        model = _load_token_classifier(model, args)
        if peft_config is not None:
            from posttrain.models.peft_utils import prepare_peft_model

            model = prepare_peft_model(model, peft_config, gradient_checkpointing=bool(args.gradient_checkpointing))
        if args.disable_dropout:
            disable_dropout_in_model(model)
        tok = getattr(processing_class, "tokenizer", processing_class)
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = tok.pad_token_id
        if data_collator is None:
            from transformers import DataCollatorForTokenClassification

            data_collator = DataCollatorForTokenClassification(tok)
        check_single_split(train_dataset, "train_dataset")
        check_text_only(train_dataset, "PRMTrainer")
        train_dataset = self._prepare_dataset(train_dataset, tok, args, "train", is_eval=False)

        def prepare_eval(dataset: Any, name: str) -> Any:
            return self._prepare_dataset(dataset, tok, args, name, is_eval=True)

        self._eval_preparer = prepare_eval  # evaluate(eval_dataset=...) prepares its argument the same way
        eval_dataset = prepare_splits(eval_dataset, prepare_eval, "eval")
        super().__init__(
            model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class,
            compute_metrics=compute_metrics if compute_metrics is not None else compute_accuracy,
            callbacks=callbacks, optimizers=optimizers, preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )  # fmt: skip
        self.model_accepts_loss_kwargs = False  # the loss is a mean over the micro-batch's labelled steps

    def _prepare_dataset(self, dataset: Any, tok: Any, args: PRMConfig, name: str, *, is_eval: bool) -> Any:
        """Validate the stepwise-supervision format (or pre-tokenized ``input_ids`` + ``labels``) and tokenize."""
        if dataset is None:
            return None
        names = column_names(dataset)
        if "input_ids" in names:
            if "labels" not in names:
                raise DataFormatError(
                    f"The {name} dataset is pre-tokenized (input_ids) but has no 'labels' column; PRMTrainer needs "
                    "per-token labels (-100 except on each step's separator token)."
                )
            return dataset
        validate_format(dataset, [STEPWISE_SUPERVISION], trainer="PRMTrainer")
        import datasets

        # Keep the labels integer (-100 / 0 / 1); map would otherwise infer bool from the source column.
        features = datasets.Features(
            {
                "input_ids": datasets.Sequence(datasets.Value("int64")),
                "labels": datasets.Sequence(datasets.Value("int64")),
            }
        )
        kwargs: dict[str, Any] = {"with_indices": True, "remove_columns": names}
        if not _is_iterable(dataset):
            kwargs["features"] = features
        return map_dataset(
            dataset, _TokenizeStepwise(tok, args, is_eval), args, f"Tokenizing {name} dataset", **kwargs
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        outputs = model(**model_inputs, use_cache=False)
        # The mean over the labelled positions of every process's batch (DDP averages the processes' losses).
        num_labels = None
        if self.accelerator.num_processes > 1:
            local = (labels != IGNORE_INDEX).sum().float().reshape(1)
            num_labels = sum_over_processes(self.accelerator, local).reshape(()) / self.accelerator.num_processes
        loss = step_label_loss(outputs.logits, labels, num_labels=num_labels)
        return (loss, outputs) if return_outputs else loss


def _is_iterable(dataset: Any) -> bool:
    import datasets

    return isinstance(dataset, datasets.IterableDataset)


def _load_token_classifier(model: Any, args: PRMConfig) -> torch.nn.Module:
    """A hub id / path becomes an ``AutoModelForTokenClassification`` (``num_labels=2`` unless given); objects are
    used as they are."""
    if not isinstance(model, str):
        return model
    from transformers import AutoModelForTokenClassification

    from posttrain import legacy
    from posttrain.models.loading import resolve_dtype

    kwargs = legacy.model_init_kwargs(args.model_init_kwargs)  # transformers 4's `torch_dtype` → `dtype`
    kwargs.setdefault("num_labels", 2)
    kwargs["dtype"] = resolve_dtype(kwargs.get("dtype"))
    if args.trust_remote_code:
        kwargs.setdefault("trust_remote_code", True)
    return AutoModelForTokenClassification.from_pretrained(model, **kwargs)
