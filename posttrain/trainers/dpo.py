"""DPOConfig and DPOTrainer: offline preference optimisation with TRL's API, fields, defaults and metric names.

Pipeline (features.md §B4/§C1):

1. Data: preference rows (explicit or implicit prompt, standard or conversational, per-row ``tools`` /
   ``chat_template_kwargs``) are tokenized into ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``
   (:func:`posttrain.data.tokenization.tokenize_preference`; EOS appended to standard completions). Rows whose
   prompt alone fills ``max_length`` are dropped; the rest are truncated per sequence in the collator.
2. One forward pass scores chosen and rejected together: the collator stacks ``[prompt+chosen; prompt+rejected]``
   into ``(2B, L)``. Token log-probs come from :func:`posttrain.models.forward.forward_token_stats` — the chunked
   path, never ``(2B, L, V)`` logits — and are summed over completion tokens (or LD-DPO weighted).
3. The reference log-probs come from :mod:`posttrain.models.reference` (explicit ``ref_model``, PEFT adapters
   disabled, frozen copy, precomputed columns, or a TR-DPO-synced copy).
4. :func:`posttrain.core.preference.dpo_loss` combines the requested ``loss_type`` list with ``loss_weights``.

The batch loss is a mean over the micro-batch's pairs and ``Trainer`` divides it by the number of accumulation
steps, so ``per_device_train_batch_size=1`` × GA 4 equals 4 × GA 1 for every per-pair loss (``aot``/``aot_unpaired``
sort over the batch and ``sft`` is a token mean over the batch, so for those the micro-batch *is* the batch, as in
TRL).

Metrics (TRL's names): ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected`` (mean logit over completion tokens,
computed as ``h · mean_v(W)`` — no vocabulary-sized tensor), ``entropy``, ``num_tokens``, ``mean_token_accuracy``
(chosen tokens), ``aux_loss`` (MoE).

The pieces DPO shares with KTO and the reward trainer (config fields, policy + reference setup,
``PreferenceTrainer``) live in :mod:`posttrain.trainers.preference`; completion scoring in
:mod:`posttrain.models.preference_scoring`.
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
from posttrain.core.preference import (
    DPO_LOSSES,
    F_DIVERGENCES,
    DPOLossInputs,
    dpo_loss,
    ld_weighted_logps,
    validate_dpo_loss_config,
    wpo_pair_weight,
    wpo_sequence_weight,
)
from posttrain.data.dataset_ops import (
    PromptFits,
    check_precompute_supported,
    configure_streaming,
    filter_dataset,
    map_dataset,
    prepare_splits,
    tokenize_dataset,
)
from posttrain.data.formats import is_vision_dataset
from posttrain.distributed import gather_masked_mean, gather_mean
from posttrain.models.loading import load_processor
from posttrain.models.preference_scoring import PreferenceScores, score_preference_completions
from posttrain.models.reference import precompute_reference_columns
from posttrain.reliability.validation import (
    ALLOW_NEGATIVE_BETA_HELP,
    check_beta,
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
    resolve_pad_token,
    shared_field,
)

__all__ = ["DPOConfig", "DPOTrainer"]


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DPOConfig(BaseConfig):
    """Configuration for :class:`DPOTrainer` (TRL's ``DPOConfig`` fields and defaults).

    Only DPO-specific fields are listed; everything else is ``transformers.TrainingArguments`` with TRL's overrides
    (``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` automatic, ``learning_rate=1e-6``).
    """

    # older TRL's `max_prompt_length` (a plain cut to the last tokens) is reproduced for this config: posttrain.legacy
    legacy_truncates_prompts: ClassVar[bool] = True

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})

    # model / data
    disable_dropout: bool = shared_field("disable_dropout")
    trust_remote_code: bool = shared_field("trust_remote_code")
    router_aux_loss_coef: float | None = shared_field("router_aux_loss_coef")
    dataset_num_proc: int | None = shared_field("dataset_num_proc")
    max_length: int | None = field(
        default=1024,
        metadata={
            "help": "Maximum length of prompt+completion per sequence; longer sequences are truncated in the collator "
            "and rows whose prompt alone reaches it are dropped (keep_start). None: no limit."
        },
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata={
            "help": "'keep_start' keeps the first max_length tokens; 'keep_end' (deprecated) keeps the last ones.",
            "choices": ["keep_start", "keep_end"],
        },
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Not supported for DPO yet (as in TRL): a warning is issued and padding is used."},
    )
    pad_to_multiple_of: int | str | None = shared_field("pad_to_multiple_of")
    pad_token: str | None = shared_field("pad_token")
    activation_offloading: bool = shared_field("activation_offloading")

    # reference
    precompute_ref_log_probs: bool = shared_field("precompute_ref_log_probs")
    precompute_ref_batch_size: int | None = shared_field("precompute_ref_batch_size")
    sync_ref_model: bool = shared_field("sync_ref_model")
    ref_model_mixup_alpha: float = shared_field("ref_model_mixup_alpha")
    ref_model_sync_steps: int = shared_field("ref_model_sync_steps")

    # loss
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={
            "help": f"DPO loss type, or a list of them combined with loss_weights: {', '.join(DPO_LOSSES)}.",
            "choices": list(DPO_LOSSES),
        },
    )
    loss_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per loss type (default 1.0 each)."}
    )
    beta: float = field(default=0.1, metadata={"help": "β: strength of the deviation from the reference (τ for IPO)."})
    allow_negative_beta: bool = field(default=False, metadata={"help": ALLOW_NEGATIVE_BETA_HELP})
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "Label-flip probability for robust (in [0, 0.5)), ε for exo_pair (> 0), smoothing for aot."},
    )
    f_divergence_type: str = field(
        default="reverse_kl",
        metadata={
            "help": f"f-divergence of the implicit reward: {', '.join(F_DIVERGENCES)} (reverse_kl: DPO's).",
            "choices": list(F_DIVERGENCES),
        },
    )
    f_alpha_divergence_coef: float = field(default=0.5, metadata={"help": "α of alpha_divergence."})
    ld_alpha: float | None = field(
        default=None,
        metadata={
            "help": "LD-DPO: weight of the completion tokens beyond the shorter completion's length (None: off)."
        },
    )
    use_weighting: bool = field(
        default=False, metadata={"help": "WPO: weight each pair by its (detached) probability under the policy."}
    )
    discopop_tau: float = field(default=0.05, metadata={"help": "τ of the discopop loss."})

    def __post_init__(self):
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        self.loss_type = list(self.loss_type)
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode must be 'keep_start' or 'keep_end', got {self.truncation_mode!r}.")
        if self.truncation_mode == "keep_end":
            warnings.warn(
                "truncation_mode='keep_end' is deprecated (as in TRL) and will be removed; use 'keep_start'.",
                FutureWarning,
                stacklevel=3,
            )
        if self.padding_free:
            self._padding_free_requested = True  # vision datasets refuse it (DPOTrainer); text falls back to padding
            warnings.warn(
                "padding_free=True is not supported by DPOTrainer yet (TRL disables it too); batches are padded.",
                UserWarning,
                stacklevel=3,
            )
            self.padding_free = False
        F_DIVERGENCES.get(self.f_divergence_type)  # unknown names: ValueError listing the valid ones
        validate_dpo_loss_config(
            self.loss_type, self.loss_weights, label_smoothing=self.label_smoothing, use_weighting=self.use_weighting
        )
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha must lie in [0, 1] (or be None), got {self.ld_alpha}.")
        check_reference_options(self)
        check_beta(self, "the DPO loss would then favour the rejected completions over the chosen ones")
        super().__post_init__()


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


class DPOTrainer(PreferenceTrainer):
    """Trainer for Direct Preference Optimization (https://huggingface.co/papers/2305.18290) and its variants.

    Args:
        model: Hub id / local path (loaded with ``args.model_init_kwargs``, float32 by default), a
            ``PreTrainedModel`` or a ``PeftModel``.
        ref_model: Reference policy: a model, a hub id / path, or None (PEFT: the base model with adapters disabled;
            otherwise a frozen copy of ``model``; with ``precompute_ref_log_probs`` no copy at all).
        args: ``DPOConfig``; a plain ``TrainingArguments`` is converted; None → ``DPOConfig(f"{model_name}-DPO")``.
        data_collator: Defaults to ``DataCollatorForPreference`` (per-sequence truncation to ``max_length``), or
            ``DataCollatorForVisionPreference`` with the model's processor when the train dataset has an ``image`` /
            ``images`` column (raw rows processed per batch; no precompute, padding-free or ``keep_end``).
        train_dataset: Preference dataset (``prompt``/``chosen``/``rejected`` or implicit prompt), or pre-tokenized
            ``prompt_ids``/``chosen_ids``/``rejected_ids``.
        eval_dataset: Same format, or a dict of them.
        processing_class: Tokenizer; None loads it from the model's path.
        compute_metrics: Receives ``EvalPrediction`` whose predictions are the per-pair ``(rewards/chosen,
            rewards/rejected)`` and labels are zeros (index of the chosen column).
        callbacks, optimizers, optimizer_cls_and_kwargs, preprocess_logits_for_metrics: As ``transformers.Trainer``.
        quantization_config: A ``transformers`` quantization config (e.g. ``BitsAndBytesConfig``) used when
            ``model`` is a string (merged into ``args.model_init_kwargs``).
        peft_config: A ``peft.PeftConfig`` to wrap ``model`` with.
    """

    _tag_names = ["trl", "dpo"]
    _signature_columns_extra = ("prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps")

    # TRL's attributes copied from the config, which subclasses written for TRL read (``ConfigAttribute``)
    beta = ConfigAttribute()
    label_smoothing = ConfigAttribute()
    ld_alpha = ConfigAttribute()
    f_divergence_type = ConfigAttribute()
    f_alpha_divergence_coef = ConfigAttribute()
    use_weighting = ConfigAttribute()
    padding_free = ConfigAttribute()
    precompute_ref_logps = ConfigAttribute("precompute_ref_log_probs")
    loss_types = ConfigAttribute(
        "loss_type", lambda trainer, value: [value] if isinstance(value, str) else list(value)
    )
    loss_weights = ConfigAttribute(
        read=lambda trainer, value: list(value) if value else [1.0] * len(trainer.loss_types)
    )
    router_aux_loss_coef = ConfigAttribute(read=router_aux_loss_coef_attribute)

    def __init__(
        self,
        model: str | torch.nn.Module,
        ref_model: str | torch.nn.Module | None = None,
        args: DPOConfig | TrainingArguments | None = None,
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
        args = self.resolve_args(args, model, DPOConfig, "DPO")
        require_train_dataset(train_dataset, "DPOTrainer")
        check_datasets(train_dataset, eval_dataset)
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

        self.pad_token_id = resolve_pad_token(processing_class, args.pad_token)
        if data_collator is None and self._vision:
            from posttrain.data.vision_collators import DataCollatorForVisionPreference

            data_collator = DataCollatorForVisionPreference(
                processor=processing_class, pad_to_multiple_of=args.pad_to_multiple_of, max_length=args.max_length
            )
        elif data_collator is None:
            from posttrain.data.collators import DataCollatorForPreference

            data_collator = DataCollatorForPreference(
                pad_token_id=self.pad_token_id,
                pad_to_multiple_of=args.pad_to_multiple_of,
                max_length=args.max_length,
                truncation_mode=args.truncation_mode,
            )
        check_precompute_supported(args, train_dataset, eval_dataset)
        train_dataset = self._prepare_dataset(train_dataset, processing_class, args, "train")

        def prepare_eval(dataset: Any, name: str) -> Any:
            return self._prepare_dataset(dataset, processing_class, args, name)

        self._eval_preparer = prepare_eval  # evaluate(eval_dataset=...) prepares its argument the same way
        eval_dataset = prepare_splits(eval_dataset, prepare_eval, "eval")
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
    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: DPOConfig, name: str) -> Any:
        """Validate the format, tokenize (extracting implicit prompts) and drop rows whose prompt fills max_length.

        Vision datasets keep their raw rows: the vision collator renders, processes and truncates them per batch."""
        if dataset is None:
            return None
        from posttrain.data.formats import PREFERENCE, TOKENIZED_PREFERENCE, validate_format
        from posttrain.data.tokenization import tokenize_preference

        if self._vision:
            if getattr(args, "_legacy_max_prompt_length", None) is not None:
                warnings.warn(  # TRL 0.x ignored it for vision data too: a cut could drop image tokens
                    "max_prompt_length is ignored for vision-language data.", UserWarning, stacklevel=3
                )
            validate_format(dataset, [PREFERENCE], trainer="DPOTrainer")
            check_preference_pairs(dataset, "DPOTrainer", name)
            return dataset
        if is_vision_dataset(dataset):
            raise ValueError(
                f"The {name} dataset has image columns but the train dataset has none: vision-language DPO is chosen "
                "by the train dataset. Give the train dataset its `image`/`images` column too, or drop it here."
            )
        fmt = validate_format(dataset, [PREFERENCE, TOKENIZED_PREFERENCE], trainer="DPOTrainer")
        check_preference_pairs(dataset, "DPOTrainer", name)
        if fmt.type == PREFERENCE:
            dataset = tokenize_dataset(
                dataset, tokenize_preference, processing_class, args, f"{name} dataset", add_eos=not fmt.conversational
            )
        elif fmt.implicit_prompt:
            dataset = map_dataset(dataset, _add_empty_prompt, args, f"Adding empty prompt_ids to {name} dataset")
        dataset = legacy.truncate_prompt_ids(dataset, args, name)  # TRL 0.x's max_prompt_length, if given
        if args.max_length is not None and args.truncation_mode == "keep_start":
            dataset = filter_dataset(dataset, PromptFits(args.max_length), args, f"Dropping long prompts ({name})")
        return dataset

    # -- reference -----------------------------------------------------------------------------------------------
    def _sequence_logps(self, scores: PreferenceScores) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) per-pair log-probs from a ``(2B, T)`` scored batch: sums, or LD-DPO weighted."""
        half = scores.logps.shape[0] // 2
        if self.args.ld_alpha is None:
            sums = scores.sequence_sums()
            return sums[:half], sums[half:]
        m = scores.mask
        return ld_weighted_logps(
            scores.logps[:half], m[:half], scores.logps[half:], m[half:], float(self.args.ld_alpha)
        )

    def _reference_logps(self, model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if "ref_chosen_logps" in inputs and "ref_rejected_logps" in inputs:
            return inputs["ref_chosen_logps"].float(), inputs["ref_rejected_logps"].float()
        if not self.reference.needs_forward:
            raise ValueError(
                "The batch has no ref_chosen_logps / ref_rejected_logps columns but the reference model was freed "
                "after precomputation. Do not pass datasets without the precomputed columns to this trainer."
            )
        with torch.no_grad(), self.reference.activate(model) as ref_model:
            scores = score_preference_completions(
                ref_model,
                inputs["input_ids"],
                inputs["attention_mask"],
                inputs["completion_mask"],
                **_model_inputs(inputs),
            )
        chosen, rejected = self._sequence_logps(scores)
        return chosen.detach(), rejected.detach()

    def compute_ref_log_probs(
        self, model: torch.nn.Module, inputs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """TRL's method: the reference ``(chosen, rejected)`` log-probs of one collated batch. ``model`` is taken for
        TRL's signature; the reference is the trainer's (``ref_model``, or the policy with its adapters off)."""
        with torch.no_grad():
            return self._reference_logps(self.model, self._prepare_inputs(inputs))

    def _reference_columns(self) -> tuple[Callable, tuple[str, ...], str]:
        """(batch → ``ref_chosen_logps`` / ``ref_rejected_logps``, the columns it reads, the marker column)."""

        def compute(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
            chosen, rejected = self._reference_logps(self.model, batch)
            return {"ref_chosen_logps": chosen, "ref_rejected_logps": rejected}

        return compute, self._signature_columns_extra[:3], "ref_chosen_logps"

    def _precompute_reference(self) -> None:
        """Add ``ref_chosen_logps`` / ``ref_rejected_logps`` columns to the datasets, then free the reference."""
        compute, input_columns, marker = self._reference_columns()
        precompute_reference_columns(self, compute, input_columns=input_columns, marker_column=marker)

    # -- loss ----------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        args = self.args
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        completion_mask = inputs["completion_mask"]
        half = input_ids.shape[0] // 2
        # Reference first: its no-grad activations are freed before the policy's autograd graph is built.
        ref_chosen, ref_rejected = self._reference_logps(model, inputs)
        with activation_offloading_context(args.activation_offloading):
            scores = score_preference_completions(
                model,
                input_ids,
                attention_mask,
                completion_mask,
                compute_entropy=True,
                compute_mean_logits=True,
                compute_wpo=args.use_weighting,
                accuracy_rows=torch.arange(input_ids.shape[0], device=input_ids.device) < half,
                **_model_inputs(inputs),
            )
        chosen_logps, rejected_logps = self._sequence_logps(scores)
        lengths = scores.mask.sum(dim=-1).float()
        chosen_nll = None
        if "sft" in args.loss_type:
            chosen_mask = scores.mask[:half]
            chosen_nll = -(scores.logps[:half] * chosen_mask).sum() / chosen_mask.sum().clamp(min=1)
        weights = None
        if args.use_weighting:
            seq_w = wpo_sequence_weight(scores.logps.detach(), scores.wpo_log_normalizer, scores.mask)
            weights = wpo_pair_weight(seq_w[:half], seq_w[half:])
        loss, out = dpo_loss(
            DPOLossInputs(
                chosen_logps=chosen_logps,
                rejected_logps=rejected_logps,
                ref_chosen_logps=ref_chosen.to(chosen_logps.dtype),
                ref_rejected_logps=ref_rejected.to(rejected_logps.dtype),
                chosen_lengths=lengths[:half],
                rejected_lengths=lengths[half:],
                chosen_nll=chosen_nll,
            ),
            args.loss_type,
            args.loss_weights,
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef,
            discopop_tau=args.discopop_tau,
            weights=weights,
        )
        loss = self._add_router_aux_loss(loss, model, scores.aux_loss, mode)
        self._log_dpo_metrics(mode, inputs, scores, chosen_logps, rejected_logps, out)
        if return_outputs:
            return loss, {"chosen_rewards": out["chosen_rewards"], "rejected_rewards": out["rejected_rewards"]}
        return loss

    def _log_dpo_metrics(self, mode, inputs, scores, chosen_logps, rejected_logps, out) -> None:
        acc = self.accelerator
        half = scores.logps.shape[0] // 2
        record = functools.partial(self.record_metric, mode=mode)
        self._count_train_tokens(inputs, mode)
        mask = scores.mask
        record("entropy", gather_masked_mean(acc, scores.entropy, mask))
        record("mean_token_accuracy", gather_masked_mean(acc, scores.correct.float()[:half], mask[:half]))
        if scores.mean_logits is not None:
            record("logits/chosen", gather_masked_mean(acc, scores.mean_logits[:half], mask[:half]))
            record("logits/rejected", gather_masked_mean(acc, scores.mean_logits[half:], mask[half:]))
        chosen_r, rejected_r = out["chosen_rewards"], out["rejected_rewards"]
        record("rewards/chosen", gather_mean(acc, chosen_r))
        record("rewards/rejected", gather_mean(acc, rejected_r))
        record("rewards/accuracies", gather_mean(acc, (chosen_r > rejected_r).float()))
        record("rewards/margins", gather_mean(acc, chosen_r - rejected_r))
        record("logps/chosen", gather_mean(acc, chosen_logps))
        record("logps/rejected", gather_mean(acc, rejected_logps))


# Raw columns the vision collator reads.
_VISION_COLUMNS = ("prompt", "chosen", "rejected", "image", "images")
# Batch keys the loss reads itself; every other key (pixel_values, image_sizes, token_type_ids, ...) is a model input.
_LOSS_KEYS = frozenset({"input_ids", "attention_mask", "completion_mask", "ref_chosen_logps", "ref_rejected_logps"})


def _model_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The extra model inputs of a batch (the vision collator's processor outputs); empty for text batches."""
    return {k: v for k, v in inputs.items() if k not in _LOSS_KEYS}


def _validate_vision(args: DPOConfig) -> None:
    """Options that vision datasets (processed per batch by the vision collator) cannot honour."""
    refused = {
        "precompute_ref_log_probs": (args.precompute_ref_log_probs, "the reference is scored on the fly"),
        "padding_free": (getattr(args, "_padding_free_requested", False), "the batches are padded"),
        "truncation_mode": (args.truncation_mode != "keep_start", "cutting the start would drop image tokens"),
    }
    for option, (bad, why) in refused.items():
        if bad:
            value = "'keep_end'" if option == "truncation_mode" else "True"
            fix = "use 'keep_start'" if option == "truncation_mode" else f"set {option}=False"
            raise ValueError(
                f"{option}={value} is not supported for vision-language datasets (an `image`/`images` column): "
                f"{why}. {fix[0].upper() + fix[1:]}."
            )


def _add_empty_prompt(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"prompt_ids": []}
