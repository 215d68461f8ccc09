"""Supervised fine-tuning: ``SFTConfig`` and ``SFTTrainer`` with TRL's fields, defaults, data pipeline and metrics.

The data pipeline (TRL's, features.md §C4) turns any SFT dataset into ``input_ids`` + ``labels`` rows:
formatting_func → tokenize (language modelling text/messages, ShareGPT conversations, prompt-completion standard or
conversational, per-row ``tools``/``chat_template_kwargs``; pre-tokenized rows pass through) → labels (-100 outside
the completion / assistant tokens) → truncate → drop rows with nothing to learn → pack (bfd, bfd_split, wrapped).

The loss is the token-level negative log-likelihood summed over label tokens and divided by ``num_items_in_batch``
(the label-token count of the whole accumulated batch, from ``transformers.Trainer``), so gradient accumulation is
exact: ``per_device_train_batch_size=1 × gradient_accumulation_steps=4`` ≡ ``4 × 1``. With the default
``loss_type="chunked_nll"`` the per-token log-probs come from :func:`posttrain.models.forward.forward_token_stats`:
no ``(B, T, V)`` logits are built; ``"nll"`` uses the model's full logits (same value); ``"dft"`` weights each
token by its detached probability (Dynamic Fine-Tuning, https://huggingface.co/papers/2508.05629).

Deliberate differences from TRL:

* padding-free batches work with ``sdpa`` and ``eager`` attention too: the collator emits a 4-D block-diagonal mask,
  adapted per attention implementation (TRL requires FlashAttention);
* ``completion_only_loss=None`` also turns on for pre-tokenized rows that carry a ``completion_mask``;
* ``formatting_func`` output replaces the row (other text columns would otherwise take precedence).

Vision-language datasets (an ``image`` or ``images`` column) are not prepared up front (TRL forces
``skip_prepare_dataset``): the raw rows reach ``DataCollatorForVisionLanguageModeling``
(:mod:`posttrain.data.vision_collators`), which renders, processes and pads them per batch with the model's processor. Packing, padding-free batches,
``assistant_only_loss`` and ``formatting_func`` do not apply to them and raise.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from posttrain import legacy
from posttrain.data.collators import DataCollatorForLanguageModeling
from posttrain.data.dataset_ops import configure_streaming
from posttrain.data.formats import is_vision_dataset
from posttrain.models.forward import (
    forward_token_stats,
    prepare_attention_mask,
    token_stats_from_logits,
)
from posttrain.models.loading import load_processor, resolve_router_aux_loss_coef
from posttrain.models.unwrap import unwrap_base_model
from posttrain.registry import Registry
from posttrain.trainers.base import (
    PAD_TO_MULTIPLE_OF_HELP,
    BaseConfig,
    BaseTrainer,
    ConfigAttribute,
    router_aux_loss_coef_attribute,
)

IGNORE_INDEX = -100
_PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")
_TRUNCATION_MODES = ("keep_start", "keep_end")
# Batch keys the collator may emit that are not model inputs.
_NON_MODEL_INPUTS = ("labels", "seq_lengths", "completion_mask", "assistant_masks", "_num_tokens")

# ----------------------------------------------------------------------------------------------------------------
# Loss types: per-token losses over (B, T) log-probs; the trainer sums them over label tokens and normalises.
# ----------------------------------------------------------------------------------------------------------------

SFT_LOSSES: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("SFT loss_type")


@SFT_LOSSES.register("nll")
def nll(logps: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token: ``ℓ_t = −log p_θ(y_t | y_<t)``; ``(B, T) -> (B, T)``."""
    return -logps


SFT_LOSSES.add("chunked_nll", nll)  # same math; the trainer computes the log-probs without full logits


@SFT_LOSSES.register("dft")
def dft(logps: torch.Tensor) -> torch.Tensor:
    """Dynamic Fine-Tuning per token: ``ℓ_t = −sg(p_t) · log p_t`` with ``p_t = exp(log p_t)`` detached.

    Rescales each token's NLL gradient by its probability (Wu et al. 2025, "On the Generalization of SFT",
    https://huggingface.co/papers/2508.05629). ``(B, T) -> (B, T)``.
    """
    return -logps.detach().exp() * logps


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class SFTConfig(BaseConfig):
    """Configuration for :class:`SFTTrainer`: ``transformers.TrainingArguments`` plus TRL's SFT fields.

    Every field is documented in its ``help`` metadata (shown by ``posttrain sft --help``).
    """

    learning_rate: float = field(default=2e-5, metadata={"help": "Initial AdamW learning rate (TRL's SFT default)."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code from the hub when `model` is a string."}
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the MoE router load-balancing loss added to the loss (MoE models only; 0 disables "
            "it). Logged as `aux_loss`. None: the model's own `router_aux_loss_coef`."
        },
    )
    chat_template_path: str | None = field(
        default=None,
        metadata={
            "help": "A `.jinja`/`.j2` file whose chat template replaces the tokenizer's, or a tokenizer path/id whose "
            "template (and special tokens) are cloned with `clone_chat_template`."
        },
    )
    dataset_text_field: str = field(
        default="text", metadata={"help": "Column holding the text of standard language-modelling datasets."}
    )
    dataset_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Dataset preparation options. Only key: `skip_prepare_dataset` (True: the dataset is used as "
            "given, it must already hold `input_ids` and `labels`)."
        },
    )
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Processes used to tokenize/pack the dataset (`dataset.map(num_proc=...)`)."}
    )
    eos_token: str | None = field(
        default=None,
        metadata={"help": "Token appended to standard text and completions; defaults to the tokenizer's EOS token."},
    )
    pad_token: str | None = field(
        default=None,
        metadata={"help": "Deprecated: set `tokenizer.pad_token` instead. Token used for padding."},
    )
    max_length: int | None = field(
        default=1024,
        metadata={
            "help": "Maximum tokenized length: longer sequences are truncated (`truncation_mode`); with packing, the "
            "block length. None: no truncation."
        },
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata={"help": "How to truncate: `keep_start` (keep the first tokens) or `keep_end` (deprecated)."},
    )
    shuffle_dataset: bool = field(
        default=False, metadata={"help": "Shuffle the prepared dataset (before packing, so blocks mix sources)."}
    )
    packing: bool = field(
        default=False, metadata={"help": "Pack several sequences into each `max_length` block (less padding)."}
    )
    packing_strategy: str = field(
        default="bfd",
        metadata={
            "help": "`bfd`: best-fit-decreasing bins, sequences kept whole (longer ones truncated); `bfd_split`: "
            "long sequences split into `max_length` chunks first (no token lost); `wrapped`: concatenate and cut "
            "every `max_length` tokens. With `bfd`/`bfd_split` each packed sequence attends only to itself."
        },
    )
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Concatenate each batch into one row without padding; `position_ids` restart per sequence and a "
            "block-diagonal attention mask keeps sequences apart (FlashAttention: position_ids alone). Implied by "
            "`bfd`/`bfd_split` packing with FlashAttention; with other attention implementations packed blocks stay "
            "separate rows, each with its own block-diagonal mask (same result, cheaper attention)."
        },
    )
    pad_to_multiple_of: int | str | None = field(default="auto", metadata={"help": PAD_TO_MULTIPLE_OF_HELP})
    eval_packing: bool | None = field(
        default=None, metadata={"help": "Pack the evaluation dataset; None: same as `packing`."}
    )
    completion_only_loss: bool | None = field(
        default=None,
        metadata={
            "help": "Train only on completion tokens of prompt-completion data. None: on for prompt-completion "
            "datasets (and pre-tokenized rows with a `completion_mask`)."
        },
    )
    assistant_only_loss: bool = field(
        default=False,
        # no percent sign in help texts: transformers.HfArgumentParser's --help %-formats them
        metadata={
            "help": "Train only on assistant turns of conversational data (needs a chat template with "
            "`generation` block markers; a known family's training template is swapped in when missing)."
        },
    )
    loss_type: str | None = field(
        default=None,
        metadata={
            "help": f"One of {', '.join(SFT_LOSSES)}: `nll` (cross-entropy from full logits), `chunked_nll` (same "
            "value without full-vocabulary logits), `dft` (Dynamic Fine-Tuning). None: `chunked_nll` (`nll` with "
            "`use_liger_kernel`).",
            "choices": list(SFT_LOSSES),
        },
    )
    activation_offloading: bool = field(
        default=False,
        metadata={"help": "Keep saved activations on the CPU between forward and backward (less accelerator memory)."},
    )

    def __post_init__(self):
        if isinstance(self.dataset_kwargs, str):
            try:
                self.dataset_kwargs = json.loads(self.dataset_kwargs)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"dataset_kwargs must be a dict or a JSON object, got {self.dataset_kwargs!r}."
                ) from err
        self.packing_strategy = legacy.packing_strategy(self.packing_strategy, type(self).__name__)  # TRL 0.19 "ffd"
        if self.packing_strategy == "bfd-requeue":
            warnings.warn("packing_strategy='bfd-requeue' was renamed 'bfd_split'.", FutureWarning, stacklevel=2)
            self.packing_strategy = "bfd_split"
        if self.packing_strategy not in _PACKING_STRATEGIES:
            raise ValueError(
                f"packing_strategy={self.packing_strategy!r} is not valid. Use one of {', '.join(_PACKING_STRATEGIES)}."
            )
        if self.truncation_mode not in _TRUNCATION_MODES:
            raise ValueError(f"truncation_mode={self.truncation_mode!r} is not valid. Use 'keep_start' or 'keep_end'.")
        if self.truncation_mode == "keep_end":
            warnings.warn(
                "truncation_mode='keep_end' is deprecated (it cuts the start of prompts); use 'keep_start'.",
                FutureWarning,
                stacklevel=2,
            )
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be a positive int or None, got {self.max_length}.")
        if self.packing and self.max_length is None:
            raise ValueError("packing=True needs a block length: set max_length (e.g. 1024) or packing=False.")
        if self.loss_type is None:
            self.loss_type = "nll" if self.use_liger_kernel else "chunked_nll"
        if isinstance(self.loss_type, str):
            SFT_LOSSES.get(self.loss_type)  # unknown names raise, listing the valid ones
            if self.loss_type == "chunked_nll" and self.use_liger_kernel:
                raise ValueError("loss_type='chunked_nll' cannot be combined with use_liger_kernel=True; use 'nll'.")
        if self.pad_token is not None:
            warnings.warn(
                "SFTConfig.pad_token is deprecated; set `tokenizer.pad_token` before passing the tokenizer.",
                FutureWarning,
                stacklevel=2,
            )
        super().__post_init__()


# ----------------------------------------------------------------------------------------------------------------
# Dataset preparation
# ----------------------------------------------------------------------------------------------------------------


class _Formatted:
    """Picklable ``formatting_func`` wrapper writing the formatted text into ``text_field``."""

    def __init__(self, fn: Callable[[dict], str], text_field: str):
        self.fn, self.text_field = fn, text_field

    def __call__(self, example: dict, idx: int) -> dict:
        text = self.fn(example)
        if not isinstance(text, str):
            raise ValueError(
                f"Row {idx}: formatting_func must return one string per example, got {type(text).__name__}. "
                "(Batched formatting functions returning lists are not supported.)"
            )
        return {self.text_field: text}


def _build_labels(example: dict, completion_only_loss: bool) -> dict:
    from posttrain.data.tokenization import build_labels

    completion = example.get("completion_mask") if completion_only_loss else None
    return {"labels": build_labels(example["input_ids"], completion, example.get("assistant_masks"))}


def _truncate(example: dict, max_length: int, mode: str) -> dict:
    from posttrain.data.tokenization import truncate_sequence

    return {k: truncate_sequence(example[k], max_length, mode) for k in ("input_ids", "labels")}


def _has_targets(example: dict) -> bool:
    # position 0 is never predicted, so a row needs a label after it
    return any(label != IGNORE_INDEX for label in example["labels"][1:])


def _columns(dataset) -> list[str]:
    from posttrain.data.formats import column_names

    return column_names(dataset)


def _map(dataset, fn, *, num_proc=None, desc=None, **kwargs):
    import datasets

    if isinstance(dataset, datasets.Dataset):
        kwargs.update(num_proc=num_proc, desc=desc)
    return dataset.map(fn, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------------------


class SFTTrainer(BaseTrainer):
    """Supervised fine-tuning trainer with TRL's API.

    Args:
        model: Hub id / local path (loaded with ``args.model_init_kwargs``, float32 by default), a
            ``PreTrainedModel``, or a ``peft.PeftModel``.
        args: ``SFTConfig`` (a plain ``TrainingArguments`` is converted; None → defaults with
            ``output_dir=f"{model_name}-SFT"``).
        data_collator: Defaults to ``DataCollatorForLanguageModeling`` (right padding, or padding-free).
        train_dataset: Any SFT dataset (see module docstring); required.
        eval_dataset: Dataset or dict of datasets, prepared the same way (packing per ``eval_packing``).
        processing_class: Tokenizer; None → loaded from the model's path (pad token falls back to EOS).
        compute_loss_func: Optional ``(outputs, labels, num_items_in_batch) -> loss`` replacing the built-in loss
            (the model then runs with full logits).
        compute_metrics, callbacks, optimizers, optimizer_cls_and_kwargs, preprocess_logits_for_metrics: As in
            ``transformers.Trainer``.
        peft_config: A ``peft.PeftConfig`` (e.g. ``LoraConfig``) to wrap the model with.
        formatting_func: ``example -> str`` producing the training text (standard language modelling).
        quantization_config: e.g. ``BitsAndBytesConfig`` for QLoRA when ``model`` is a string (needs bitsandbytes).
    """

    _tag_names = ["posttrain", "sft"]
    router_aux_loss_coef = ConfigAttribute(read=router_aux_loss_coef_attribute)  # TRL's attribute
    # Tokens per chunk of the chunked log-prob path (TRL's chunked_nll uses 256): scratch is ~2 × 256 × V floats.
    chunk_size: int = 256

    def __init__(
        self,
        model: str | torch.nn.Module,
        args: SFTConfig | TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        optimizer_cls_and_kwargs: tuple | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
        quantization_config: Any = None,
        peft_config: Any = None,
        formatting_func: Callable[[dict], str] | None = None,
    ):
        from posttrain.models.loading import model_name, resolve_model, resolve_processing_class
        from posttrain.reliability.validation import check_datasets, check_liger_peft_head, require_train_dataset

        args = self.resolve_args(args, model, SFTConfig, "SFT")
        require_train_dataset(train_dataset, "SFTTrainer")
        check_datasets(train_dataset, eval_dataset)
        configure_streaming(args, train_dataset)  # a stream: max_steps required, no workers, no batch dispatch
        quantized = quantization_config is not None or "quantization_config" in (args.model_init_kwargs or {})
        if quantized and importlib.util.find_spec("bitsandbytes") is None:
            raise ImportError(
                "A quantization_config (QLoRA) needs the `bitsandbytes` package, which is not installed. Run "
                "`pip install bitsandbytes` (CUDA only), or train without quantization."
            )
        model_id = model if isinstance(model, str) else None
        self._vision = is_vision_dataset(train_dataset)
        if self._vision:
            self._validate_vision(args, formatting_func)
            if processing_class is None:
                processing_class = load_processor(model_id or model)
        model = resolve_model(model, args, quantization_config=quantization_config)
        processing_class = resolve_processing_class(model_id or model, processing_class)
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self._set_special_tokens(tokenizer, args)

        added_token_ids: list[int] = []
        if args.chat_template_path is not None:
            from posttrain.data.chat_templates import apply_chat_template_path

            model, tokenizer, added_token_ids = apply_chat_template_path(model, tokenizer, args.chat_template_path)
        if args.assistant_only_loss:
            self._ensure_training_template(tokenizer)
        model = self._wrap_peft(model, peft_config, added_token_ids, args)
        check_liger_peft_head(model, args)
        self.aux_loss_enabled = self._enable_router_aux_loss(model, args)

        self.padding_free = self._resolve_padding_free(model, args)
        self._validate(args, data_collator, formatting_func)
        if formatting_func is not None and (
            args.completion_only_loss or self._infer_completion_only_loss(args, train_dataset, check=False)
        ):
            raise ValueError(
                "completion_only_loss=True cannot be used with a formatting_func: the formatted text has no prompt/"
                "completion boundary. Use a prompt-completion dataset instead, or set completion_only_loss=False."
            )
        self.completion_only_loss = self._infer_completion_only_loss(args, train_dataset)

        if data_collator is None:
            data_collator = self._default_collator(model, processing_class if self._vision else tokenizer, args)
        # vision rows are processed per batch by the collator (TRL forces skip_prepare_dataset for them)
        skip_prepare = self._vision or bool((args.dataset_kwargs or {}).get("skip_prepare_dataset", False))
        train_dataset = self._prepare_dataset(
            train_dataset, tokenizer, args, args.packing, formatting_func, "train", skip_prepare
        )
        eval_packing = args.packing if args.eval_packing is None else args.eval_packing

        def prepare_eval(dataset: Any, name: str) -> Any:
            return self._prepare_dataset(dataset, tokenizer, args, eval_packing, formatting_func, name, skip_prepare)

        self._eval_preparer = prepare_eval  # evaluate(eval_dataset=...) prepares its argument the same way
        if isinstance(eval_dataset, dict):
            eval_dataset = {key: prepare_eval(ds, key) for key, ds in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = prepare_eval(eval_dataset, "eval")

        self.loss_type = args.loss_type
        self._loss_fn = SFT_LOSSES.get(args.loss_type)
        self._total_train_tokens = 0
        self._model_name = model_name(model_id or model)
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        # The loss is normalised by num_items_in_batch here (not by the model), so the Trainer must count label tokens
        # for every model and must not divide the loss by the accumulation steps again.
        self.model_accepts_loss_kwargs = True

    # -- setup ---------------------------------------------------------------------------------------------------
    @staticmethod
    def _set_special_tokens(tokenizer: Any, args: SFTConfig) -> None:
        for name in ("eos_token", "pad_token"):
            token = getattr(args, name)
            if token is None:
                continue
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or (tokenizer.unk_token_id is not None and token_id == tokenizer.unk_token_id):
                raise ValueError(
                    f"SFTConfig.{name}={token!r} is not in the tokenizer's vocabulary. Use an existing token, or add "
                    "it first (`tokenizer.add_special_tokens(...)` and `model.resize_token_embeddings(...)`)."
                )
            setattr(tokenizer, name, token)

    @staticmethod
    def _ensure_training_template(tokenizer: Any) -> None:
        """assistant_only_loss needs `{% generation %}` markers: swap in the family's training template if missing."""
        from posttrain.data.chat_templates import (
            get_chat_template,
            get_training_chat_template,
            has_generation_markers,
        )

        if not has_generation_markers(get_chat_template(tokenizer)):
            training = get_training_chat_template(tokenizer)
            if training is not None:
                tokenizer.chat_template = training

    @staticmethod
    def _wrap_peft(model: Any, peft_config: Any, added_token_ids: list[int], args: SFTConfig) -> Any:
        if peft_config is None:
            return model
        from posttrain.models.peft_utils import prepare_peft_model

        quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
        if quantized:
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
        if added_token_ids and hasattr(peft_config, "trainable_token_indices"):
            # New template tokens (clone_chat_template) must be learnable: train just their embedding rows.
            peft_config.trainable_token_indices = {"embed_tokens": list(added_token_ids)}
            tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
            if not tied:
                peft_config.modules_to_save = [*(peft_config.modules_to_save or []), "lm_head"]
        model = prepare_peft_model(model, peft_config, gradient_checkpointing=args.gradient_checkpointing)
        if quantized:  # QLoRA: adapters in bf16, as TRL does
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(torch.bfloat16)
        return model

    @staticmethod
    def _enable_router_aux_loss(model: Any, args: SFTConfig) -> bool:
        """MoE models: ask the model for its load-balancing loss (added as ``router_aux_loss_coef · aux_loss``)."""
        config = getattr(unwrap_base_model(model), "config", None)
        resolve_router_aux_loss_coef(args, model)  # None → the model's own coefficient (TRL)
        if config is None or not hasattr(config, "output_router_logits") or args.router_aux_loss_coef == 0:
            return False
        config.output_router_logits = True
        config.router_aux_loss_coef = args.router_aux_loss_coef
        return True

    @staticmethod
    def _resolve_padding_free(model: Any, args: SFTConfig) -> bool:
        """Whether the collator flattens each batch into one row.

        TRL forces padding-free batches for bfd/bfd_split packing because FlashAttention's variable-length kernel
        then attends each sequence alone at linear cost. Other attention implementations get a block-diagonal
        (L, L) mask instead, whose cost grows with the square of the row: there, packed blocks stay separate rows
        (each with its own block-diagonal mask), which is equivalent and B times cheaper. An explicit
        ``padding_free=True`` is always honoured.
        """
        if args.padding_free:
            return True
        if not args.packing or args.packing_strategy == "wrapped":
            return False
        impl = str(getattr(getattr(unwrap_base_model(model), "config", None), "_attn_implementation", None) or "")
        return "flash" in impl

    def _validate(self, args: SFTConfig, data_collator: Any, formatting_func: Any) -> None:
        if (args.padding_free or (args.packing and args.packing_strategy != "wrapped")) and data_collator is not None:
            raise ValueError(
                "padding_free=True (or bfd/bfd_split packing) needs posttrain's DataCollatorForLanguageModeling; "
                "leave data_collator=None or set padding_free=False."
            )
        if args.padding_free and not args.packing and args.max_length is not None:
            raise ValueError(
                "When `padding_free=True` without packing, `max_length` is not enforced. Either enable packing (e.g. "
                "packing=True, packing_strategy='bfd'), provide already truncated inputs, or set max_length=None."
            )
        if args.padding_free and args.per_device_train_batch_size == 1 and not args.packing:
            warnings.warn(
                "padding_free=True with per_device_train_batch_size=1 removes no padding (one sequence per batch); "
                "use a larger batch size.",
                stacklevel=3,
            )
        if args.padding_free and args.packing and args.packing_strategy == "wrapped":
            warnings.warn(
                "padding_free=True with packing_strategy='wrapped': wrapped blocks have no sequence boundaries, so "
                "each block is attended as one sequence.",
                stacklevel=3,
            )

    @staticmethod
    def _validate_vision(args: SFTConfig, formatting_func: Any) -> None:
        """Options that vision-language datasets (processed per batch, never tokenized up front) cannot honour."""
        for option, value in (
            ("packing", args.packing), ("padding_free", args.padding_free),
            ("assistant_only_loss", args.assistant_only_loss), ("chat_template_path", args.chat_template_path),
        ):  # fmt: skip
            if value:
                raise ValueError(
                    f"{option}={value!r} is not supported for vision-language datasets (an `image`/`images` column): "
                    f"their rows are processed per batch by the vision collator. Unset {option}."
                )
        if args.truncation_mode != "keep_start":
            raise ValueError(
                f"truncation_mode={args.truncation_mode!r} is not supported for vision-language datasets (cutting the "
                "start would drop image tokens); use 'keep_start'."
            )
        if formatting_func is not None:
            raise ValueError(
                "formatting_func is not supported for vision-language datasets (their rows are used as given); "
                "format the rows with dataset.map(...) into `messages` or `prompt`/`completion` first."
            )

    @staticmethod
    def _infer_completion_only_loss(args: SFTConfig, dataset: Any, check: bool = True) -> bool:
        columns = set(_columns(dataset))
        has_completion = {"prompt", "completion"} <= columns or "completion_mask" in columns
        if check and args.completion_only_loss and columns and not has_completion:
            # TRL would train on every token here; an explicit True means the user expects a masked prompt.
            data = "conversational `messages`" if "messages" in columns else f"columns {sorted(columns)}"
            fix = (
                "use assistant_only_loss=True to train on the assistant turns only, or "
                if "messages" in columns or "conversations" in columns
                else ""
            )
            raise ValueError(
                f"completion_only_loss=True needs prompt-completion data (`prompt` and `completion` columns, or "
                f"pre-tokenized rows with a `completion_mask`), but the train dataset has {data}: there is no "
                f"prompt to mask, so every token would be trained on. Split the rows into prompt/completion, {fix}"
                "or set completion_only_loss=None to train on the whole text."
            )
        if args.completion_only_loss is not None:
            return bool(args.completion_only_loss)
        return has_completion

    def _default_collator(self, model: Any, tokenizer: Any, args: SFTConfig):
        if self._vision:
            from posttrain.data.vision_collators import DataCollatorForVisionLanguageModeling

            return DataCollatorForVisionLanguageModeling(
                processor=tokenizer,
                max_length=args.max_length,
                completion_only_loss=self.completion_only_loss,
                pad_to_multiple_of=args.pad_to_multiple_of,
                dataset_text_field=args.dataset_text_field,
            )
        impl = str(getattr(getattr(unwrap_base_model(model), "config", None), "_attn_implementation", None) or "")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return _TokenCountingCollator(
            pad_token_id=pad_id,
            completion_only_loss=self.completion_only_loss,
            padding_free=self.padding_free,
            pad_to_multiple_of=args.pad_to_multiple_of,
            # FlashAttention reads sequence boundaries from position_ids and takes no 4-D mask.
            block_diagonal_mask="flash" not in impl,
            # posttrain's choices where the public collator's defaults reproduce TRL's output: rows carry
            # assistant_masks only when the dataset asked for them; position ids always; the model derives
            # variable-length boundaries from position_ids.
            assistant_only_loss=True,
            return_position_ids=True,
            return_varlen_kwargs=False,
        )

    # -- data ----------------------------------------------------------------------------------------------------
    def _prepare_dataset(
        self,
        dataset: Any,
        tokenizer: Any,
        args: SFTConfig,
        packing: bool,
        formatting_func: Callable | None,
        name: str,
        skip_prepare: bool,
    ) -> Any:
        """Raw rows → ``input_ids`` + ``labels`` (+ ``seq_lengths`` when packed), TRL's §C4 pipeline."""
        from posttrain.data.formats import (
            LANGUAGE_MODELING,
            PROMPT_COMPLETION,
            TOKENIZED_LANGUAGE_MODELING,
            validate_format,
        )
        from posttrain.data.tokenization import map_with_row_index, tokenize_lm, tokenize_prompt_completion

        columns = _columns(dataset)
        if skip_prepare:
            if "labels" not in columns and ({"completion_mask", "assistant_masks"} & set(columns)):
                raise ValueError(
                    f"The {name} dataset skips preparation and has mask columns but no 'labels': the masks would be "
                    "ignored. Build `labels` (-100 on tokens not to train on) or let SFTTrainer prepare the dataset."
                )
            return dataset
        # after skip_prepare, as TRL: a transform that returns trainer-ready rows is fine when nothing is prepared
        fmt_info = getattr(dataset, "format", None) or {}
        if fmt_info.get("type") == "custom":
            raise ValueError(  # TRL's phrase first
                "SFTTrainer cannot prepare a dataset that uses `Dataset.with_transform()`: the "
                f"{name} dataset uses `with_transform`/`set_transform`, and preparing it would bake the transform's "
                "output into the tokenized columns. Apply a deterministic transform with `dataset.map(...)`, or set "
                "dataset_kwargs={'skip_prepare_dataset': True} and make the transform return input_ids and labels."
            )
        if {"image", "images"} & set(columns):
            raise ValueError(
                f"The {name} dataset has image columns but the train dataset has none: vision-language SFT is chosen "
                "by the train dataset. Give the train dataset its `image`/`images` column too, or drop it here."
            )
        map_kwargs = {"num_proc": args.dataset_num_proc}
        with args.main_process_first(desc=f"preparing the {name} dataset"):
            if formatting_func is not None:
                if "input_ids" in columns:
                    warnings.warn("formatting_func is ignored: the dataset is already tokenized.", stacklevel=3)
                else:
                    dataset = _map(
                        dataset, _Formatted(formatting_func, args.dataset_text_field), with_indices=True,
                        remove_columns=columns, desc=f"formatting the {name} dataset", **map_kwargs,
                    )  # fmt: skip
                    columns = _columns(dataset)
            fmt = validate_format(
                dataset, [LANGUAGE_MODELING, PROMPT_COMPLETION, TOKENIZED_LANGUAGE_MODELING], trainer="SFTTrainer",
                text_field=args.dataset_text_field,
            )  # fmt: skip
            if args.assistant_only_loss and not fmt.is_tokenized and not fmt.conversational:
                raise ValueError(
                    f"assistant_only_loss=True only applies to conversational data, but the {name} dataset is {fmt}. "
                    "Use messages / prompt-completion messages, or set assistant_only_loss=False."
                )
            if not fmt.is_tokenized:
                tokenize = tokenize_prompt_completion if fmt.type == PROMPT_COMPLETION else tokenize_lm
                fn_kwargs = {"tokenizer": tokenizer, "assistant_only_loss": args.assistant_only_loss}
                if tokenize is tokenize_lm:
                    fn_kwargs["dataset_text_field"] = args.dataset_text_field
                dataset = map_with_row_index(
                    dataset, tokenize, fn_kwargs=fn_kwargs, remove_columns=columns,
                    **self._map_kwargs(dataset, f"tokenizing the {name} dataset", map_kwargs),
                )  # fmt: skip
                columns = _columns(dataset)
            if "labels" not in columns:
                dataset = _map(
                    dataset, _build_labels, fn_kwargs={"completion_only_loss": self.completion_only_loss},
                    desc=f"building labels for the {name} dataset", **map_kwargs,
                )  # fmt: skip
            keep = [c for c in ("input_ids", "labels", "seq_lengths") if c in _columns(dataset)]
            dataset = dataset.select_columns(keep)
            if args.max_length is not None and not packing:
                dataset = _map(
                    dataset, _truncate, fn_kwargs={"max_length": args.max_length, "mode": args.truncation_mode},
                    desc=f"truncating the {name} dataset", **map_kwargs,
                )  # fmt: skip
            dataset = self._filter(dataset, name, args)
            if args.shuffle_dataset:
                dataset = dataset.shuffle(seed=args.seed)
            if packing:
                from posttrain.data.packing import pack_dataset

                pack_kwargs = {"desc": f"packing the {name} dataset", "num_proc": args.dataset_num_proc}
                import datasets

                if not isinstance(dataset, datasets.Dataset):
                    pack_kwargs = {}
                dataset = pack_dataset(
                    dataset.select_columns(["input_ids", "labels"]), args.max_length, args.packing_strategy,
                    map_kwargs=pack_kwargs,
                )  # fmt: skip
        return dataset

    @staticmethod
    def _map_kwargs(dataset: Any, desc: str, map_kwargs: dict) -> dict:
        import datasets

        return {"desc": desc, **map_kwargs} if isinstance(dataset, datasets.Dataset) else {}

    @staticmethod
    def _filter(dataset: Any, name: str, args: SFTConfig) -> Any:
        """Drop rows with no label token to learn from (all prompt, or truncated before the completion)."""
        import datasets

        if not isinstance(dataset, datasets.Dataset):
            return dataset.filter(_has_targets)
        before = len(dataset)
        dataset = dataset.filter(_has_targets, num_proc=args.dataset_num_proc, desc=f"filtering the {name} dataset")
        if len(dataset) == 0:
            raise ValueError(
                f"No row of the {name} dataset has a token to train on after masking and truncation (max_length="
                f"{args.max_length}). Increase max_length, or check completion_only_loss / assistant_only_loss."
            )
        if len(dataset) < before:
            warnings.warn(
                f"Dropped {before - len(dataset)} of {before} rows of the {name} dataset: no label token left after "
                "masking and truncation.",
                stacklevel=4,
            )
        return dataset

    def _set_signature_columns_if_needed(self) -> None:
        # The collator consumes these columns; the default rule (model.forward's arguments) would drop seq_lengths.
        if self._signature_columns is None:
            self._signature_columns = ["input_ids", "labels", "seq_lengths", "completion_mask", "assistant_masks"]
            if self._vision:  # raw rows go to the vision collator: keep what it reads
                self._signature_columns += [
                    "messages", "prompt", "completion", "image", "images", self.args.dataset_text_field
                ]  # fmt: skip

    # -- metrics -------------------------------------------------------------------------------------------------
    def _track_num_input_tokens(self, inputs: dict) -> None:
        """``state.num_input_tokens_seen``, counting tokens — not entries of a block-diagonal attention mask.

        ``transformers.Trainer`` counts ``attention_mask.sum()`` for ``include_num_input_tokens_seen="non_padding"``
        and ``input_ids.numel()`` for ``"all"``. Packed batches here carry a 4-D ``(B, 1, L, L)`` mask, whose sum is
        the number of attended (query, key) pairs, ~L/2 times the tokens. TRL flattens a BFD-packed batch into one
        padding-free row (no mask: transformers counts its ``input_ids`` that are not the pad id, or all of them);
        posttrain keeps the packed sequences in separate rows padded to the longest (without FlashAttention), whose
        real tokens the default collator counts (``_num_tokens``): that count is what TRL's flat row holds, under
        either setting. A padding-free row (no padding between sequences) counts as in transformers.
        """
        mask = inputs.get("attention_mask")
        mode = self.args.include_num_input_tokens_seen
        if mode not in ("all", "non_padding") or mask is None or mask.dim() == 2:
            return super()._track_num_input_tokens(inputs)
        input_ids = inputs["input_ids"]
        if "_num_tokens" in inputs and not getattr(self, "padding_free", False):
            tokens = inputs["_num_tokens"].sum()
        elif mode == "all":
            tokens = torch.tensor(input_ids.numel())
        else:
            tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
            pad_id = getattr(tokenizer, "pad_token_id", None)
            tokens = (input_ids != pad_id).sum() if pad_id is not None else torch.tensor(input_ids.numel())
        tokens = torch.as_tensor(tokens, device=self.args.device, dtype=torch.int64).reshape(1)
        self.state.num_input_tokens_seen += int(self.accelerator.gather(tokens).sum().item())

    # -- loss ----------------------------------------------------------------------------------------------------
    def compute_loss_context_manager(self):
        stack = super().compute_loss_context_manager()
        if self.args.activation_offloading and self.model is not None and self.model.training:
            # Tensors saved for backward live on the CPU until backward needs them (TRL's activation_offloading).
            stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()))
        return stack

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Σ per-token loss over label tokens / ``num_items_in_batch`` (+ ``router_aux_loss_coef · aux_loss``).

        ``inputs``: ``input_ids`` (B, T), ``labels`` (B, T) with -100 at ignored positions, ``attention_mask``
        (B, T) or (1, 1, L, L), optional ``position_ids``. The model runs with full logits only when a
        ``compute_loss_func`` needs them, or in evaluation when ``compute_metrics`` needs them.
        """
        mode = "train" if model.training else "eval"
        labels = inputs["labels"]
        model_inputs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_INPUTS}
        full_logits = self.compute_loss_func is not None or (return_outputs and self.compute_metrics is not None)
        if full_logits:
            model_inputs["attention_mask"] = prepare_attention_mask(model, model_inputs.get("attention_mask"))
            outputs = model(**model_inputs, use_cache=False)
            stats = token_stats_from_logits(
                outputs.logits, inputs["input_ids"], labels=labels, compute_entropy=True, compute_accuracy=True,
                chunk_size=self.chunk_size,
            )  # fmt: skip
            stats.aux_loss = getattr(outputs, "aux_loss", None)
        else:
            input_ids, attention_mask = model_inputs.pop("input_ids"), model_inputs.pop("attention_mask", None)
            stats = forward_token_stats(
                model, input_ids, attention_mask, labels=labels, compute_entropy=True, compute_accuracy=True,
                chunk_size=self.chunk_size, chunked=self.loss_type != "nll", length_buckets=True, **model_inputs,
            )  # fmt: skip
            outputs = None
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
            loss = self._normalise(loss, None, num_items_in_batch)
        else:
            loss = self._normalise((self._loss_fn(stats.logps) * stats.mask).sum(), stats.mask, num_items_in_batch)
        if self.aux_loss_enabled and stats.aux_loss is not None:
            aux = self.args.router_aux_loss_coef * stats.aux_loss
            # with num_items_in_batch the Trainer does not divide by the accumulation steps; do it for the aux term
            if num_items_in_batch is not None and model.training:
                aux = aux / self.current_gradient_accumulation_steps
            loss = loss + aux
            self.record_metric("aux_loss", stats.aux_loss, mode)
        self._record_token_metrics(inputs, stats, mode)
        if not return_outputs:
            return loss
        return loss, (outputs if outputs is not None else {"loss": loss})

    def _normalise(self, total: torch.Tensor, mask: torch.Tensor | None, num_items_in_batch: Any) -> torch.Tensor:
        """``total / num_items_in_batch`` (exact under gradient accumulation), else the mean over this batch's tokens.

        ``mask=None``: ``total`` is already a loss (user ``compute_loss_func``); only the cross-process factor applies.
        """
        if num_items_in_batch is None:
            return total if mask is None else total / mask.sum().clamp(min=1)
        loss = total if mask is None else total / num_items_in_batch
        if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
            # num_items_in_batch counts all processes while DDP averages gradients: scale back, as Trainer does
            loss = loss * self.accelerator.num_processes
        return loss

    def _record_token_metrics(self, inputs: dict, stats: Any, mode: str) -> None:
        """TRL's SFT metrics: entropy and mean_token_accuracy over label tokens, num_tokens (train, cumulative)."""
        mask = stats.mask
        with torch.no_grad():
            sums = torch.stack(
                [(stats.entropy * mask).sum().float(), (stats.correct & mask).sum().float(), mask.sum().float()]
            ).to(self.accelerator.device)
            # gather, not gather_for_metrics: at the end of an epoch the latter trims to the last batch's row count
            # (a vector of sums is not one value per row)
            sums = self.accelerator.gather(sums).reshape(-1, 3).sum(0)
            count = sums[2].clamp(min=1)
            self.record_metric("entropy", (sums[0] / count).item(), mode)
            self.record_metric("mean_token_accuracy", (sums[1] / count).item(), mode)
            if mode == "train":
                attention_mask = inputs.get("attention_mask")
                if "_num_tokens" in inputs:  # the default collator's count of each row's real tokens
                    n_tokens = inputs["_num_tokens"].sum()
                elif attention_mask is not None and attention_mask.dim() == 2:
                    n_tokens = attention_mask.sum()
                else:  # padding-free: one row, every position is a token
                    n_tokens = torch.tensor(inputs["input_ids"].numel())
                n_tokens = self.accelerator.gather(n_tokens.reshape(1).to(self.accelerator.device)).sum()
                self._total_train_tokens += int(n_tokens.item())
                self.record_metric("num_tokens", float(self._total_train_tokens), "train", replace=True)


class _TokenCountingCollator(DataCollatorForLanguageModeling):
    """The default SFT collator, plus ``_num_tokens`` ``(rows,)``: each row's real tokens, for TRL's ``num_tokens``.

    TRL counts ``attention_mask.sum()``, or a padding-free row's whole length; posttrain keeps packed sequences in
    separate rows (padded, with 4-D masks), whose padding must not count.
    """

    def __call__(self, examples):
        out = super().__call__(examples)
        if out["input_ids"].shape[0] == len(examples):
            out["_num_tokens"] = torch.tensor([len(ex["input_ids"]) for ex in examples])
        else:  # padding-free: one row, its whole length (TRL's position_ids.size(1))
            out["_num_tokens"] = torch.tensor([out["input_ids"].shape[1]])
        return out
