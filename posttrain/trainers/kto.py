"""KTOConfig and KTOTrainer: Kahneman–Tversky Optimization from unpaired desirable / undesirable completions.

Paper: https://huggingface.co/papers/2402.01306. Pipeline (features.md §B5/§C2):

1. Data: unpaired preference rows (``prompt``, ``completion``, ``label``), standard or conversational; paired
   preference data is unpaired automatically (implicit prompts extracted first). Rows are tokenized with
   :func:`posttrain.data.tokenization.tokenize_unpaired` and rows whose prompt alone fills ``max_length`` are
   dropped. The rows keep their order: the default ``train_sampling_strategy`` is ``"sequential"``, so batches are
   consecutive rows, as in TRL (unpairing puts each chunk of 1,000 pairs' desirable rows before its undesirable
   ones, so shuffle paired data yourself if batches should mix both classes).
2. KL baseline (``loss_type="kto"``): each row gets a mismatched completion, ``KL_completion_ids``, by rotating the
   completions by one inside each block of ``per_device_train_batch_size`` rows, so with sequential sampling every
   batch pairs its prompts with its own completions shifted by one. The reference point
   z = max(0, mean(π(y'|x) − π_ref(y'|x))) is averaged over processes and detached (the policy pass on the KL rows
   runs without gradient).
3. Loss: :func:`posttrain.core.preference.kto_loss` with ``desirable_weight`` / ``undesirable_weight``.

Vision-language data (an ``image`` / ``images`` column) keeps its raw rows: :class:`~posttrain.data.vision_collators.
DataCollatorForVisionUnpairedPreference` processes them per batch with the model's processor and builds the KL rows by
the same rotation inside the batch (each KL row keeps its prompt's images); the processor's extra outputs
(``pixel_values``, ...) go to the policy, reference and KL forwards.

Deliberate differences: TRL raises unless ``train_sampling_strategy == "sequential"``. Here the mismatched pairs are
fixed per row in the dataset (per batch for vision data), so any sampler gives valid (mismatched) KL pairs;
``"sequential"`` stays the default. TRL requires vision datasets to be unpaired already; here paired ones are unpaired
as for text (the images are copied to both rows).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import TrainingArguments

from posttrain import legacy
from posttrain.core.preference import KTO_LOSSES, kto_kl_estimate, kto_loss, kto_weight_range_warning
from posttrain.data.dataset_ops import (
    PromptFits,
    check_precompute_supported,
    configure_streaming,
    filter_dataset,
    is_iterable_dataset,
    map_dataset,
    prepare_splits,
    tokenize_dataset,
)
from posttrain.data.formats import is_vision_dataset
from posttrain.distributed import gather_masked_mean
from posttrain.models.loading import load_processor
from posttrain.models.preference_scoring import PreferenceScores, score_preference_completions
from posttrain.models.reference import precompute_reference_columns
from posttrain.reliability.validation import (
    check_datasets,
    check_liger_peft_head,
    check_preference_pairs,
    require_train_dataset,
)
from posttrain.trainers.base import BaseConfig, ConfigAttribute, router_aux_loss_coef_attribute
from posttrain.trainers.preference import (
    PreferenceTrainer,
    activation_offloading_context,
    check_reference_options,
    load_policy_and_reference,
    shared_field,
)

__all__ = ["KTOConfig", "KTOTrainer"]

BATCH_SIZE_ERROR = (
    "Actual (not effective) batch size must be > 1. KTO will not work properly because the KL term will be "
    "equivalent to the implied reward. Set per_device_train_batch_size >= 2 (or use loss_type='apo_zero_unpaired', "
    "which has no KL term)."
)


@dataclass
class KTOConfig(BaseConfig):
    """Configuration for :class:`KTOTrainer` (TRL's ``KTOConfig`` fields and defaults).

    Everything else is ``transformers.TrainingArguments`` with TRL's overrides (``logging_steps=10``,
    ``gradient_checkpointing=True``, ``bf16`` automatic, ``learning_rate=1e-6``,
    ``train_sampling_strategy="sequential"``).
    """

    # older TRL's `max_prompt_length` (cut the prompt only when the row is too long, then the completions) is
    # reproduced for this config: posttrain.legacy
    legacy_pair_prompt_rule: ClassVar[bool] = True

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    train_sampling_strategy: str = field(
        default="sequential",
        metadata={
            "help": "Sampler for training. KTO defaults to 'sequential' so each batch pairs its prompts with its own "
            "rotated completions for the KL estimate (the train set is shuffled once beforehand).",
            "choices": ["random", "sequential", "group_by_length", "batch_rebalance"],
        },
    )
    disable_dropout: bool = shared_field("disable_dropout")
    trust_remote_code: bool = shared_field("trust_remote_code")
    router_aux_loss_coef: float | None = shared_field("router_aux_loss_coef")
    dataset_num_proc: int | None = shared_field("dataset_num_proc")
    max_length: int | None = field(
        default=1024,
        metadata={
            "help": "Maximum length of prompt+completion; longer sequences keep their start, rows whose prompt alone "
            "reaches it are dropped. None: no limit."
        },
    )
    pad_to_multiple_of: int | str | None = shared_field("pad_to_multiple_of")
    precompute_ref_log_probs: bool = shared_field("precompute_ref_log_probs")
    precompute_ref_batch_size: int | None = shared_field("precompute_ref_batch_size")
    loss_type: str = field(
        default="kto",
        metadata={
            "help": f"One of {', '.join(KTO_LOSSES)}: 'kto' has the KL reference point, 'apo_zero_unpaired' is "
            "anchored (no KL term).",
            "choices": list(KTO_LOSSES),
        },
    )
    beta: float = field(default=0.1, metadata={"help": "β: strength of the deviation from the reference."})
    desirable_weight: float = field(
        default=1.0, metadata={"help": "Weight of the desirable losses (counter class imbalance)."}
    )
    undesirable_weight: float = field(
        default=1.0, metadata={"help": "Weight of the undesirable losses (counter class imbalance)."}
    )
    activation_offloading: bool = shared_field("activation_offloading")
    sync_ref_model: bool = shared_field("sync_ref_model")
    ref_model_mixup_alpha: float = shared_field("ref_model_mixup_alpha")
    ref_model_sync_steps: int = shared_field("ref_model_sync_steps")

    def __post_init__(self):
        KTO_LOSSES.get(self.loss_type)  # unknown names: ValueError listing the valid ones
        check_reference_options(self)
        super().__post_init__()


class _RotateCompletions:
    """Batched map: ``KL_completion_ids`` = the block's ``completion_ids`` rotated by one (row i gets row i−1's)."""

    def __call__(self, batch: Mapping[str, list]) -> dict[str, list]:
        completions = list(batch["completion_ids"])
        return {"KL_completion_ids": completions[-1:] + completions[:-1]}


class KTOTrainer(PreferenceTrainer):
    """Trainer for KTO (https://huggingface.co/papers/2402.01306).

    Args:
        model: Hub id / local path, ``PreTrainedModel`` or ``PeftModel``.
        ref_model: Reference policy (model, hub id / path, or None: PEFT adapters disabled, else a frozen copy).
        args: ``KTOConfig``; a plain ``TrainingArguments`` is converted; None → ``KTOConfig(f"{model_name}-KTO")``.
        train_dataset: Unpaired (``prompt``, ``completion``, ``label``) or paired preference data, or pre-tokenized
            ``prompt_ids`` / ``completion_ids`` / ``label``.
        eval_dataset: Same formats, or a dict of them.
        processing_class: Tokenizer (processor for image data); None loads it from the model's path.
        data_collator: Defaults to ``DataCollatorForUnpairedPreference``, or ``DataCollatorForVisionUnpairedPreference``
            with the model's processor when the train dataset has an ``image`` / ``images`` column (raw rows
            processed per batch; no ``precompute_ref_log_probs``).
        callbacks, optimizers, optimizer_cls_and_kwargs, preprocess_logits_for_metrics, compute_metrics: As
            ``transformers.Trainer``.
        peft_config: A ``peft.PeftConfig`` to wrap ``model`` with.
    """

    _tag_names = ["trl", "kto"]

    # TRL's attributes copied from the config, which subclasses written for TRL read (``ConfigAttribute``)
    beta = ConfigAttribute()
    loss_type = ConfigAttribute()
    desirable_weight = ConfigAttribute()
    undesirable_weight = ConfigAttribute()
    precompute_ref_logps = ConfigAttribute("precompute_ref_log_probs")
    calculate_KL = ConfigAttribute("loss_type", lambda trainer, value: value != "apo_zero_unpaired", writable=False)
    router_aux_loss_coef = ConfigAttribute(read=router_aux_loss_coef_attribute)
    _signature_columns_extra = (
        "prompt_ids",
        "completion_ids",
        "label",
        "KL_completion_ids",
        "ref_logps",
        "ref_KL_logps",
    )

    def __init__(
        self,
        model: str | torch.nn.Module,
        ref_model: str | torch.nn.Module | None = None,
        args: KTOConfig | TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        optimizer_cls_and_kwargs: tuple | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
    ):
        args = self.resolve_args(args, model, KTOConfig, "KTO")
        require_train_dataset(train_dataset, "KTOTrainer")
        check_datasets(train_dataset, eval_dataset)
        if args.loss_type == "kto" and args.per_device_train_batch_size <= 1:
            raise ValueError(BATCH_SIZE_ERROR)
        self._vision = is_vision_dataset(train_dataset)
        if self._vision:
            _validate_vision(args)
            if processing_class is None:
                processing_class = load_processor(model)
        processing_class, policy, self.reference = load_policy_and_reference(
            model, ref_model, args, processing_class, peft_config, quantization_config
        )
        check_liger_peft_head(policy, args)
        configure_streaming(args, train_dataset)
        tok = getattr(processing_class, "tokenizer", processing_class)
        if data_collator is None and self._vision:
            from posttrain.data.vision_collators import DataCollatorForVisionUnpairedPreference

            data_collator = DataCollatorForVisionUnpairedPreference(
                processor=processing_class,
                max_length=args.max_length,
                calculate_kl=args.loss_type == "kto",
                pad_to_multiple_of=args.pad_to_multiple_of,
            )
        elif data_collator is None:
            from posttrain.data.collators import DataCollatorForUnpairedPreference

            data_collator = DataCollatorForUnpairedPreference(
                pad_token_id=tok.pad_token_id, pad_to_multiple_of=args.pad_to_multiple_of, max_length=args.max_length
            )
        check_precompute_supported(args, train_dataset, eval_dataset)
        check_datasets(train_dataset, eval_dataset)
        train_dataset = self._prepare_dataset(train_dataset, tok, args, "train", args.per_device_train_batch_size)

        def prepare_eval(dataset: Any, name: str) -> Any:
            return self._prepare_dataset(dataset, tok, args, name, args.per_device_eval_batch_size)

        self._eval_preparer = prepare_eval  # evaluate(eval_dataset=...) prepares its argument the same way
        eval_dataset = prepare_splits(eval_dataset, prepare_eval, "eval")
        self._warn_weight_range(train_dataset, args)
        if self._vision:  # raw rows go to the vision collator: keep what it reads
            self._signature_columns_extra = (*self._signature_columns_extra, *_VISION_COLUMNS)
        super().__init__(
            model=policy, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, compute_metrics=compute_metrics,
            callbacks=callbacks, optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )  # fmt: skip
        self._attach_reference()

    # -- data ----------------------------------------------------------------------------------------------------
    def _prepare_dataset(self, dataset: Any, tok: Any, args: KTOConfig, name: str, block_size: int) -> Any:
        """Validate, unpair, tokenize, drop over-long prompts and add the KL completions (row order kept).

        Vision datasets are only unpaired: the vision collator renders, processes, truncates them and builds their
        KL rows per batch."""
        if dataset is None:
            return None
        if not self._vision and is_vision_dataset(dataset):
            raise ValueError(
                f"The {name} dataset has image columns but the train dataset has none: vision-language KTO is chosen "
                "by the train dataset. Give the train dataset its `image`/`images` column too, or drop it here."
            )
        from posttrain.data.formats import (
            PREFERENCE,
            TOKENIZED_UNPAIRED_PREFERENCE,
            UNPAIRED_PREFERENCE,
            validate_format,
        )
        from posttrain.data.tokenization import tokenize_unpaired
        from posttrain.data.utils import maybe_extract_prompt, unpair_preference_dataset

        accepted = [UNPAIRED_PREFERENCE, PREFERENCE] + ([] if self._vision else [TOKENIZED_UNPAIRED_PREFERENCE])
        fmt = validate_format(dataset, accepted, trainer="KTOTrainer")
        iterable = is_iterable_dataset(dataset)
        if fmt.type == PREFERENCE:
            check_preference_pairs(dataset, "KTOTrainer", name)
            if fmt.implicit_prompt:
                dataset = map_dataset(dataset, maybe_extract_prompt, args, f"Extracting prompts ({name})")
            dataset = unpair_preference_dataset(
                dataset,
                num_proc=None if iterable else args.dataset_num_proc,
                desc=None if iterable else f"Unpairing {name} dataset",
            )
        if fmt.type != TOKENIZED_UNPAIRED_PREFERENCE and not self._vision:
            dataset = tokenize_dataset(
                dataset, tokenize_unpaired, tok, args, f"{name} dataset", add_eos=not fmt.conversational
            )
        if not self._vision:  # TRL 0.x's max_prompt_length rule, when given (before the KL pairs, built from it)
            dataset = legacy.fit_tokenized_rows(dataset, args, name, ("completion",))
        elif getattr(args, "_legacy_pair_rule", None) is not None:
            warnings.warn(  # the vision collator truncates rendered rows; a token cut could drop image tokens
                "max_prompt_length is ignored for vision-language data.", UserWarning, stacklevel=3
            )
        if args.max_length is not None and not self._vision:
            dataset = filter_dataset(dataset, PromptFits(args.max_length), args, f"Dropping long prompts ({name})")
        if args.loss_type == "kto" and not self._vision and "KL_completion_ids" not in (dataset.column_names or []):
            dataset = map_dataset(
                dataset, _RotateCompletions(), args, f"Building KL pairs ({name})", batched=True, batch_size=block_size
            )
        return dataset

    @staticmethod
    def _warn_weight_range(dataset: Any, args: KTOConfig) -> None:
        if dataset is None or is_iterable_dataset(dataset):
            return
        labels = [bool(x) for x in dataset["label"]]
        n_desirable = sum(labels)
        message = kto_weight_range_warning(
            n_desirable, len(labels) - n_desirable, args.desirable_weight, args.undesirable_weight
        )
        if message:
            warnings.warn(message, UserWarning, stacklevel=3)

    # -- reference -----------------------------------------------------------------------------------------------
    def _ref_forward(self, model: torch.nn.Module, inputs: dict[str, Any], prefix: str) -> torch.Tensor:
        with torch.no_grad(), self.reference.activate(model) as ref_model:
            scores = score_preference_completions(
                ref_model,
                inputs[f"{prefix}input_ids"],
                inputs[f"{prefix}attention_mask"],
                inputs[f"{prefix}completion_mask"],
                **_model_inputs(inputs, prefix),
            )
        return scores.sequence_sums().detach()

    def _reference_logps(self, model, inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(ref log-probs of the completions (B,), of the KL completions (B,) or None without a KL term)."""
        need_kl = self.args.loss_type == "kto"
        if "ref_logps" in inputs and (not need_kl or "ref_KL_logps" in inputs):
            return inputs["ref_logps"].float(), inputs["ref_KL_logps"].float() if need_kl else None
        if not self.reference.needs_forward:
            raise ValueError(
                "The batch has no precomputed ref_logps / ref_KL_logps columns but the reference model was freed "
                "after precomputation. Do not pass datasets without the precomputed columns to this trainer."
            )
        ref_logps = self._ref_forward(model, inputs, "")
        ref_kl = self._ref_forward(model, inputs, "KL_") if need_kl else None
        return ref_logps, ref_kl

    def compute_ref_log_probs(self, model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        """TRL's method: the reference log-probs of one collated batch's completions and of its KL completions
        (None without the KL term). ``model`` is taken for TRL's signature; the reference is the trainer's."""
        with torch.no_grad():
            return self._reference_logps(self.model, self._prepare_inputs(inputs))

    def _reference_columns(self) -> tuple[Callable, tuple[str, ...], str]:
        """(batch → ``ref_logps`` (+ ``ref_KL_logps`` with the KL term), the columns it reads, the marker column)."""

        def compute(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
            ref_logps, ref_kl = self._reference_logps(self.model, batch)
            return {"ref_logps": ref_logps} if ref_kl is None else {"ref_logps": ref_logps, "ref_KL_logps": ref_kl}

        return compute, self._signature_columns_extra[:4], "ref_logps"

    def _precompute_reference(self) -> None:
        """Add ``ref_logps`` (and, with the KL term, ``ref_KL_logps``) columns to the datasets, then free the
        reference."""
        compute, input_columns, marker = self._reference_columns()
        precompute_reference_columns(self, compute, input_columns=input_columns, marker_column=marker)

    # -- loss ----------------------------------------------------------------------------------------------------
    def _kl_reference_point(self, model, inputs, ref_kl: torch.Tensor | None) -> torch.Tensor:
        """z = max(0, mean over all processes of (π − π_ref) on the mismatched pairs), detached; 0 without KL."""
        if ref_kl is None:
            return torch.zeros((), device=inputs["input_ids"].device)
        with torch.no_grad():
            kl_scores = score_preference_completions(
                model,
                inputs["KL_input_ids"],
                inputs["KL_attention_mask"],
                inputs["KL_completion_mask"],
                **_model_inputs(inputs, "KL_"),
            )
        local = kto_kl_estimate(kl_scores.sequence_sums(), ref_kl.to(kl_scores.logps.dtype), clamp=False)
        return self.accelerator.gather(local.reshape(1)).mean().clamp(min=0.0).detach()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        args = self.args
        # Reference and KL passes first (no grad): their activations are freed before the policy graph is built.
        ref_logps, ref_kl = self._reference_logps(model, inputs)
        kl = self._kl_reference_point(model, inputs, ref_kl)
        with activation_offloading_context(args.activation_offloading):
            scores = score_preference_completions(
                model,
                inputs["input_ids"],
                inputs["attention_mask"],
                inputs["completion_mask"],
                compute_entropy=True,
                compute_mean_logits=True,
                **_model_inputs(inputs),
            )
        policy_logps = scores.sequence_sums()
        # TRL's collators name the desirability column "label"; "labels" is what older posttrain collators returned
        labels = (inputs["label"] if "label" in inputs else inputs["labels"]).to(torch.bool)
        loss, _, _ = kto_loss(
            policy_logps,
            ref_logps.to(policy_logps.dtype),
            labels,
            kl,
            beta=args.beta,
            loss_type=args.loss_type,
            desirable_weight=args.desirable_weight,
            undesirable_weight=args.undesirable_weight,
        )
        loss = self._add_router_aux_loss(loss, model, scores.aux_loss, mode)
        rewards = (args.beta * (policy_logps - ref_logps.to(policy_logps.dtype))).detach()
        self._log_kto_metrics(mode, inputs, scores, policy_logps.detach(), rewards, labels, kl)
        if return_outputs:
            return loss, {"rewards": rewards, "labels": labels}
        return loss

    def _log_kto_metrics(
        self, mode: str, inputs, scores: PreferenceScores, logps: torch.Tensor, rewards, labels, kl
    ) -> None:
        acc = self.accelerator
        record = functools.partial(self.record_metric, mode=mode)
        self._count_train_tokens(inputs, mode)
        record("kl", kl.item())
        record("entropy", gather_masked_mean(acc, scores.entropy, scores.mask))
        # A class absent from the batch on every process logs nothing for it (TRL: the key is not appended), so the
        # logged value is the mean over the micro-batches that had it, never NaN/None.
        desirable = labels.unsqueeze(1) & scores.mask
        undesirable = (~labels).unsqueeze(1) & scores.mask
        if scores.mean_logits is not None:
            _record_masked_mean(record, "logits/chosen", acc, scores.mean_logits, desirable)
            _record_masked_mean(record, "logits/rejected", acc, scores.mean_logits, undesirable)
        chosen = _record_masked_mean(record, "rewards/chosen", acc, rewards, labels)
        rejected = _record_masked_mean(record, "rewards/rejected", acc, rewards, ~labels)
        if chosen is not None and rejected is not None:
            record("rewards/margins", chosen - rejected)
        _record_masked_mean(record, "logps/chosen", acc, logps, labels)
        _record_masked_mean(record, "logps/rejected", acc, logps, ~labels)

    def _eval_predictions(self, outputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row implied rewards ``(B,)`` and the desirable (1) / undesirable (0) labels."""
        return outputs["rewards"], outputs["labels"].long()


def _record_masked_mean(
    record: Callable[[str, float], None], key: str, accelerator: Any, tensor: torch.Tensor, mask: torch.Tensor
) -> float | None:
    """Record Σ tensor·mask / Σ mask over every process as ``key`` when the mask selects anything on some process
    (else record nothing, so the key is not logged); return the value, or None when nothing was recorded."""
    mean = gather_masked_mean(accelerator, tensor, mask)
    if mean != mean:  # NaN: empty mask on every process
        return None
    record(key, mean)
    return mean


# Raw columns the vision collator reads.
_VISION_COLUMNS = ("prompt", "completion", "image", "images")
# Batch keys the loss reads itself; every other key (pixel_values, image_sizes, token_type_ids, ...) is a model input.
_LOSS_KEYS = frozenset(
    {"input_ids", "attention_mask", "completion_mask", "label", "labels", "ref_logps", "ref_KL_logps"}
)


def _model_inputs(inputs: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Extra model inputs (the vision collator's processor outputs) of the rows (``prefix=""``) or of their KL rows
    (``"KL_"``: the same images, the KL rows' own per-token extras); empty for text batches."""
    extras = {k: v for k, v in inputs.items() if k not in _LOSS_KEYS and not k.startswith("KL_")}
    if prefix:
        extras.update({k[len(prefix) :]: v for k, v in inputs.items() if k.startswith(prefix)})
        for key in _LOSS_KEYS:
            extras.pop(key, None)
    return extras


def _validate_vision(args: KTOConfig) -> None:
    """Options that vision datasets (processed per batch by the vision collator) cannot honour."""
    if args.precompute_ref_log_probs:
        raise ValueError(
            "precompute_ref_log_probs=True is not supported for vision-language datasets (an `image`/`images` "
            "column): the reference is scored on the fly. Set precompute_ref_log_probs=False."
        )
