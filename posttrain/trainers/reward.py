"""RewardConfig and RewardTrainer: a Bradley–Terry reward model on preference pairs (features.md §B6/§C3).

The model is a sequence classifier with one label (``AutoModelForSequenceClassification(num_labels=1)``); its score
at the last non-pad token is the reward. Each batch stacks the chosen and rejected sequences into one ``(2B, L)``
forward pass, and the loss is

    L = −mean log σ(r_c − r_r − m) + η · mean((r_c + r_r)²)

with m the optional ``margin`` column (Llama 2) and η = ``center_rewards_coefficient`` (off by default).

Data: preference rows with an implicit (recommended) or explicit prompt — the prompt is prepended to chosen and
rejected before tokenizing — standard (EOS appended) or conversational (the chat template over the whole
conversation), or pre-tokenized ``chosen_ids`` / ``rejected_ids`` (legacy ``chosen_input_ids`` /
``rejected_input_ids`` are renamed with a FutureWarning). As in TRL, pairs longer than ``max_length`` are dropped,
not truncated: a truncated pair could lose exactly the tokens that make one answer better.

Metrics (TRL's names): ``accuracy`` (r_c > r_r), ``margin`` (mean r_c − r_r), ``min_reward``, ``mean_reward``,
``max_reward``, ``num_tokens``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from posttrain.core.preference import bradley_terry_loss
from posttrain.data.dataset_ops import configure_streaming, filter_dataset, prepare_splits, tokenize_dataset
from posttrain.distributed import gather_mean
from posttrain.models.forward import sequence_scores
from posttrain.models.loading import disable_dropout_in_model, resolve_model, resolve_processing_class
from posttrain.reliability.validation import (
    check_datasets,
    check_preference_pairs,
    check_text_only,
    require_train_dataset,
)
from posttrain.trainers.base import BaseConfig
from posttrain.trainers.preference import (
    PreferenceTrainer,
    activation_offloading_context,
    resolve_pad_token,
    shared_field,
)

__all__ = ["RewardConfig", "RewardTrainer"]


@dataclass
class RewardConfig(BaseConfig):
    """Configuration for :class:`RewardTrainer` (TRL's ``RewardConfig`` fields and defaults).

    Everything else is ``transformers.TrainingArguments`` with TRL's overrides (``logging_steps=10``,
    ``gradient_checkpointing=True``, ``bf16`` automatic, ``learning_rate=1e-4``).
    """

    learning_rate: float = field(default=1e-4, metadata={"help": "Initial AdamW learning rate."})
    chat_template_path: str | None = field(
        default=None,
        metadata={
            "help": "A .jinja chat template file to use, or a tokenizer path whose chat template (and special tokens) "
            "is cloned into the model's tokenizer."
        },
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the model."})
    trust_remote_code: bool = shared_field("trust_remote_code")
    dataset_num_proc: int | None = shared_field("dataset_num_proc")
    eos_token: str | None = field(
        default=None, metadata={"help": "Override the tokenizer's EOS token (appended to standard sequences)."}
    )
    max_length: int | None = field(
        default=1024,
        metadata={
            "help": "Pairs whose chosen or rejected sequence is longer are dropped (not truncated). None: keep all."
        },
    )
    pad_to_multiple_of: int | str | None = shared_field("pad_to_multiple_of")
    center_rewards_coefficient: float | None = field(
        default=None,
        metadata={"help": "η of the auxiliary loss η·mean((r_c + r_r)²) pushing rewards to zero mean (e.g. 0.01)."},
    )
    activation_offloading: bool = shared_field("activation_offloading")
    pad_token: str | None = shared_field("pad_token")


class _PairFits:
    """Picklable filter: keep pairs whose chosen and rejected sequences both fit in ``max_length``."""

    def __init__(self, max_length: int):
        self.max_length = max_length

    def __call__(self, row: Mapping[str, Any]) -> bool:
        return len(row["chosen_ids"]) <= self.max_length and len(row["rejected_ids"]) <= self.max_length


class RewardTrainer(PreferenceTrainer):
    """Trainer for Bradley–Terry reward models.

    Args:
        model: Hub id / local path (loaded as a sequence classifier with ``num_labels=1``), or a model whose
            ``config.num_labels == 1`` (PEFT-wrapped allowed).
        args: ``RewardConfig``; a plain ``TrainingArguments`` is converted; None →
            ``RewardConfig(f"{model_name}-Reward")``.
        data_collator: Defaults to ``DataCollatorForRewardPreference``.
        train_dataset: Preference data (implicit or explicit prompt, optional ``margin``) or pre-tokenized
            ``chosen_ids`` / ``rejected_ids``.
        eval_dataset: Same formats, or a dict of them.
        processing_class: Tokenizer; None loads it from the model's path.
        compute_metrics: Receives per-pair ``(r_c, r_r)`` predictions and zero labels (index of the chosen column).
        callbacks, optimizers, optimizer_cls_and_kwargs, preprocess_logits_for_metrics: As ``transformers.Trainer``.
        quantization_config: A ``transformers`` quantization config used when ``model`` is a string.
        peft_config: A ``peft.PeftConfig`` (use ``task_type="SEQ_CLS"`` so the score head is trained too).
    """

    _tag_names = ["trl", "reward-trainer"]
    _signature_columns_extra = ("chosen_ids", "rejected_ids", "margin")
    _pair_output_keys = ("rewards_chosen", "rewards_rejected")

    def __init__(
        self,
        model: str | torch.nn.Module,
        args: RewardConfig | TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        optimizer_cls_and_kwargs: tuple | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
        quantization_config: Any = None,
        peft_config: Any = None,
    ):
        from posttrain.models.peft_utils import prepare_peft_model

        args = self.resolve_args(args, model, RewardConfig, "Reward")
        require_train_dataset(train_dataset, "RewardTrainer")
        check_datasets(train_dataset, eval_dataset)
        reward_model = resolve_model(
            model, args, task="sequence-classification", quantization_config=quantization_config
        )
        num_labels = getattr(getattr(reward_model, "config", None), "num_labels", None)
        if num_labels != 1:
            raise ValueError(  # TRL's phrase first
                f"The model has `num_labels={num_labels}`, but reward models require `num_labels=1` to output a "
                "single scalar reward per sequence. Load it with "
                "AutoModelForSequenceClassification.from_pretrained(..., num_labels=1), or pass the model's name or "
                "path as a string to have it configured automatically."
            )
        processing_class = resolve_processing_class(
            model, processing_class, trust_remote_code=args.trust_remote_code
        )
        tok = getattr(processing_class, "tokenizer", processing_class)
        if args.eos_token is not None:
            if tok.convert_tokens_to_ids(args.eos_token) in (None, getattr(tok, "unk_token_id", None)):
                raise ValueError(
                    f"eos_token {args.eos_token!r} is not in the tokenizer's vocabulary; choose an existing token."
                )
            tok.eos_token = args.eos_token
        if args.chat_template_path is not None:
            from posttrain.data.chat_templates import apply_chat_template_path

            reward_model, tok, added = apply_chat_template_path(reward_model, tok, args.chat_template_path)
            if added and peft_config is not None and hasattr(peft_config, "trainable_token_indices"):
                # The new special tokens have fresh embedding rows; let PEFT train them (TRL does the same).
                peft_config.trainable_token_indices = {"embed_tokens": list(added)}
        if peft_config is not None:
            reward_model = prepare_peft_model(
                reward_model, peft_config, gradient_checkpointing=bool(args.gradient_checkpointing)
            )
        if args.disable_dropout:
            disable_dropout_in_model(reward_model)
        configure_streaming(args, train_dataset)
        pad_id = resolve_pad_token(tok, args.pad_token)
        # The classifier reads the reward at the last token that is not padding.
        reward_model.config.pad_token_id = pad_id
        if data_collator is None:
            from posttrain.data.collators import DataCollatorForRewardPreference

            data_collator = DataCollatorForRewardPreference(
                pad_token_id=pad_id, pad_to_multiple_of=args.pad_to_multiple_of
            )

        def prepare_eval(dataset: Any, name: str) -> Any:
            return self._prepare_dataset(dataset, tok, args, name)

        self._eval_preparer = prepare_eval  # evaluate(eval_dataset=...) prepares its argument the same way
        eval_dataset = prepare_splits(eval_dataset, prepare_eval, "eval")
        check_text_only(train_dataset, "RewardTrainer")
        train_dataset = self._prepare_dataset(train_dataset, tok, args, "train")
        super().__init__(
            model=reward_model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, compute_metrics=compute_metrics,
            callbacks=callbacks, optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )  # fmt: skip

    # -- data ----------------------------------------------------------------------------------------------------
    def _prepare_dataset(self, dataset: Any, tok: Any, args: RewardConfig, name: str) -> Any:
        """Validate, tokenize whole chosen/rejected sequences, and drop pairs longer than ``max_length``."""
        if dataset is None:
            return None
        from posttrain.data.formats import PREFERENCE, TOKENIZED_PREFERENCE, column_names, validate_format
        from posttrain.data.tokenization import tokenize_reward_pair

        names = column_names(dataset)
        if {"chosen_input_ids", "rejected_input_ids"} <= set(names) and "chosen_ids" not in names:
            warnings.warn(
                "The columns chosen_input_ids / rejected_input_ids are deprecated (as in TRL); rename them to "
                "chosen_ids / rejected_ids. They are renamed for you this time.",
                FutureWarning,
                stacklevel=3,
            )
            dataset = dataset.rename_columns({"chosen_input_ids": "chosen_ids", "rejected_input_ids": "rejected_ids"})
        fmt = validate_format(dataset, [PREFERENCE, TOKENIZED_PREFERENCE], trainer="RewardTrainer")
        check_preference_pairs(dataset, "RewardTrainer", name)
        if fmt.type == PREFERENCE:
            dataset = tokenize_dataset(
                dataset, tokenize_reward_pair, tok, args, f"{name} dataset", add_eos=not fmt.conversational
            )
        if args.max_length is not None:
            dataset = filter_dataset(dataset, _PairFits(args.max_length), args, f"Dropping long pairs ({name})")
        return dataset

    # -- loss ----------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        with activation_offloading_context(self.args.activation_offloading):
            rewards = sequence_scores(model, inputs["input_ids"], inputs["attention_mask"])  # (2B,)
        half = rewards.shape[0] // 2
        chosen, rejected = rewards[:half], rewards[half:]
        loss = bradley_terry_loss(
            chosen, rejected, inputs.get("margin"), center_rewards_coefficient=self.args.center_rewards_coefficient
        )
        self._log_reward_metrics(mode, inputs, chosen.detach(), rejected.detach())
        if return_outputs:
            return loss, {"rewards_chosen": chosen, "rewards_rejected": rejected}
        return loss

    def _log_reward_metrics(self, mode: str, inputs, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        acc = self.accelerator
        record = functools.partial(self.record_metric, mode=mode)
        self._count_train_tokens(inputs, mode)
        # one value per row for gather_for_metrics (it trims the last batch of an epoch to its row count): gather
        # each half on its own, then join them
        all_rewards = torch.cat([acc.gather_for_metrics(chosen), acc.gather_for_metrics(rejected)])
        record("min_reward", all_rewards.min().item())
        record("mean_reward", all_rewards.mean().item())
        record("max_reward", all_rewards.max().item())
        record("accuracy", gather_mean(acc, (chosen > rejected).float()))
        record("margin", gather_mean(acc, chosen - rejected))
