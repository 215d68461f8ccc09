"""What the reference-free pairwise trainers (CPO, ORPO, TPO) share: policy loading, dataset preparation, the
chunked ``[chosen; rejected(; ...)]`` scoring forward and TRL's pair metrics.

They sit on :class:`posttrain.trainers.preference.PreferenceTrainer` (signature columns, ``num_tokens``, MoE
``aux_loss``, ``prediction_step``) and read token log-probs through
:func:`posttrain.models.preference_scoring.score_preference_completions` — the chunked path, never ``(B, T, V)`` logits. Unlike DPO
there is no reference policy: no second model, no reference forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain import legacy
from posttrain.core.reference_free import masked_token_mean_nll
from posttrain.data.dataset_ops import (
    PromptFits,
    configure_streaming,
    filter_dataset,
    map_dataset,
    prepare_splits,
    tokenize_dataset,
)
from posttrain.distributed import gather_mean, gather_row_masked_mean, sum_over_processes
from posttrain.experimental._pairwise_config import ReferenceFreePairwiseConfig, check_common_options
from posttrain.models.loading import disable_dropout_in_model, resolve_model, resolve_processing_class
from posttrain.models.preference_scoring import PreferenceScores, score_preference_completions
from posttrain.reliability.validation import check_single_split, check_text_only
from posttrain.trainers.preference import PreferenceTrainer, enable_router_aux_loss, resolve_pad_token

__all__ = ["PairScores", "ReferenceFreePairwiseConfig", "ReferenceFreePairwiseTrainer", "check_common_options"]


class _TruncateCompletions:
    """Picklable map: cut every ``<column>_ids`` completion to ``max_completion_length`` tokens."""

    def __init__(self, columns: Sequence[str], max_completion_length: int):
        self.columns = tuple(columns)
        self.max_completion_length = max_completion_length

    def __call__(self, row: Mapping[str, Any]) -> dict[str, list[int]]:
        return {f"{c}_ids": list(row[f"{c}_ids"])[: self.max_completion_length] for c in self.columns}


@dataclass
class PairScores:
    """One scored ``[chosen; rejected(; extra)]`` batch: per-row log-probs (summed or token means), the chosen
    token-mean NLL and the per-token scores."""

    chosen_logps: torch.Tensor  # (B,)
    rejected_logps: torch.Tensor  # (B,)
    chosen_nll: torch.Tensor  # scalar
    scores: PreferenceScores  # (nB, T) per-token
    batch_size: int  # B

    def branch(self, index: int) -> slice:
        """Rows of branch ``index`` (0 chosen, 1 rejected, 2 extra) in the scored batch."""
        return slice(index * self.batch_size, (index + 1) * self.batch_size)


class ReferenceFreePairwiseTrainer(PreferenceTrainer):
    """Shared ``__init__`` and scoring of CPOTrainer, ORPOTrainer and TPOTrainer.

    Subclasses set ``_config_class`` (a :class:`ReferenceFreePairwiseConfig` subclass: it declares the fields this
    base reads), ``_suffix``, ``_trainer_name`` and ``_completion_columns`` (the completions of each row, in batch
    order), may override :meth:`_default_collator`, and implement ``compute_loss``.
    """

    _config_class: type
    _suffix: str = ""
    _trainer_name: str = ""
    _completion_columns: tuple[str, ...] = ("chosen", "rejected")
    _signature_columns_extra = ("prompt_ids", "chosen_ids", "rejected_ids")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config_class = cls.__dict__.get("_config_class")
        if config_class is not None and not (
            isinstance(config_class, type) and issubclass(config_class, ReferenceFreePairwiseConfig)
        ):
            raise TypeError(
                f"{cls.__name__}._config_class is {getattr(config_class, '__name__', config_class)!r}, which does not "
                "derive from ReferenceFreePairwiseConfig (posttrain.experimental._pairwise_config): the pairwise "
                "trainer base reads the fields that config declares (disable_dropout, max_length, ...). Derive the "
                "config from it."
            )

    def __init__(
        self,
        model: str | torch.nn.Module | None = None,
        args: Any = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable[[], torch.nn.Module] | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        preprocess_logits_for_metrics: Callable | None = None,
        peft_config: Any = None,
        compute_metrics: Callable | None = None,
    ):
        if model is None:
            if model_init is None:
                raise ValueError(f"{self._trainer_name} needs a model (a hub id / path or a model object).")
            model = model_init()  # built once here; hyper-parameter search re-initialisation is not supported
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        args = self.resolve_args(args, model, self._config_class, self._suffix)
        processing_class = resolve_processing_class(model, processing_class)
        policy = resolve_model(model, args, peft_config=peft_config)
        if args.disable_dropout:
            disable_dropout_in_model(policy)
        enable_router_aux_loss(policy)
        configure_streaming(args, train_dataset)
        # ORPO's `padding_value` (an id) overrides the tokenizer's pad token, as in TRL.
        padding_value = getattr(args, "padding_value", None)
        self.pad_token_id = resolve_pad_token(processing_class, None) if padding_value is None else int(padding_value)
        if data_collator is None:
            data_collator = self._default_collator(args)
        check_single_split(train_dataset, "train_dataset")
        check_text_only(train_dataset, self._trainer_name)
        train_dataset = self._prepare_dataset(train_dataset, processing_class, args, "train")

        def prepare_eval(dataset: Any, name: str) -> Any:
            return self._prepare_dataset(dataset, processing_class, args, name)

        self._eval_preparer = prepare_eval  # evaluate(eval_dataset=...) prepares its argument the same way
        eval_dataset = prepare_splits(eval_dataset, prepare_eval, "eval")
        super().__init__(
            model=policy, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, compute_metrics=compute_metrics,
            callbacks=callbacks, optimizers=optimizers, preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )  # fmt: skip

    # -- data ----------------------------------------------------------------------------------------------------
    def _default_collator(self, args: Any) -> Callable:
        from posttrain.data.collators import DataCollatorForPreference

        return DataCollatorForPreference(
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=getattr(args, "pad_to_multiple_of", None),
            max_length=args.max_length,
            truncation_mode=getattr(args, "truncation_mode", "keep_start"),
        )

    def _validate_dataset(self, dataset: Any, name: str) -> Any:
        """Check the dataset type (preference, standard or conversational, or pre-tokenized); returns the format."""
        from posttrain.data.formats import PREFERENCE, TOKENIZED_PREFERENCE, validate_format

        return validate_format(dataset, [PREFERENCE, TOKENIZED_PREFERENCE], trainer=self._trainer_name)

    def _tokenize_fn(self) -> Callable:
        from posttrain.data.tokenization import tokenize_preference

        return tokenize_preference

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, name: str) -> Any:
        """Validate the format, tokenize (extracting implicit prompts; EOS after standard completions), apply an old
        ``max_prompt_length`` as TRL 0.x did (``posttrain.legacy``), cut completions to ``max_completion_length`` and
        drop rows whose prompt alone fills ``max_length``."""
        if dataset is None:
            return None
        fmt = self._validate_dataset(dataset, name)
        if not fmt.type.startswith("tokenized_"):
            dataset = tokenize_dataset(
                dataset, self._tokenize_fn(), processing_class, args, f"{name} dataset", add_eos=not fmt.conversational
            )
        elif fmt.implicit_prompt:
            dataset = map_dataset(dataset, _add_empty_prompt, args, f"Adding empty prompt_ids to {name} dataset")
        dataset = legacy.fit_tokenized_rows(dataset, args, name, self._completion_columns)  # TRL 0.x max_prompt_length
        if getattr(args, "max_completion_length", None) is not None:
            cut = _TruncateCompletions(self._completion_columns, args.max_completion_length)
            dataset = map_dataset(dataset, cut, args, f"Truncating completions ({name})")
        if args.max_length is not None and getattr(args, "truncation_mode", "keep_start") == "keep_start":
            dataset = filter_dataset(dataset, PromptFits(args.max_length), args, f"Dropping long prompts ({name})")
        return dataset

    # -- scoring -------------------------------------------------------------------------------------------------
    def _score_pairs(
        self,
        model: torch.nn.Module,
        inputs: Mapping[str, torch.Tensor],
        *,
        average: bool,
        nll: bool,
        entropy: bool = False,
        accuracy: bool = False,
        n_branches: int = 2,
    ) -> PairScores:
        """Score the batch (``n_branches`` stacked blocks of B rows, chosen first) in one chunked forward; per-row
        log-probs are token means when ``average`` else sums. ``nll``: also the token-mean NLL of the chosen
        completions (else 0). ``entropy`` / ``accuracy``: per-token entropies and top-1 hits on the chosen rows."""
        input_ids = inputs["input_ids"]
        n_rows = input_ids.shape[0]
        batch_size = n_rows // n_branches
        accuracy_rows = None
        if accuracy:
            accuracy_rows = torch.arange(n_rows, device=input_ids.device) < batch_size
        scores = score_preference_completions(
            model,
            input_ids,
            inputs["attention_mask"],
            inputs["completion_mask"],
            compute_entropy=entropy,
            compute_mean_logits=True,
            accuracy_rows=accuracy_rows,
        )
        logps = scores.sequence_sums()
        if average:
            logps = logps / scores.mask.sum(dim=-1).clamp(min=1).to(logps.dtype)
        chosen = slice(0, batch_size)
        chosen_nll = (
            self._token_mean_nll(scores.logps[chosen], scores.mask[chosen])
            if nll
            else torch.zeros((), device=input_ids.device)
        )
        return PairScores(
            chosen_logps=logps[chosen],
            rejected_logps=logps[batch_size : 2 * batch_size],
            chosen_nll=chosen_nll,
            scores=scores,
            batch_size=batch_size,
        )

    def _token_mean_nll(self, logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """NLL of ``(B, T)`` masked tokens as this process's share of the token mean over every process's batch:
        Σ over local tokens / (global token count / processes), which DDP's gradient average turns into the
        global token mean (a per-process mean would weight each process's tokens by its own count)."""
        processes = self.accelerator.num_processes
        if processes == 1:
            return masked_token_mean_nll(logps, mask)
        total = sum_over_processes(self.accelerator, mask.sum().float().reshape(1)).reshape(())
        return masked_token_mean_nll(logps, mask, num_tokens=total / processes)

    # -- metrics -------------------------------------------------------------------------------------------------
    def _log_pair_metrics(
        self, mode: str, pair: PairScores, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor
    ) -> None:
        """TRL's ``rewards/*``, ``logps/*`` and ``logits/*`` metrics of a scored pair batch."""
        acc = self.accelerator
        metrics = self._metrics[mode]
        metrics["rewards/chosen"].append(gather_mean(acc, chosen_rewards))
        metrics["rewards/rejected"].append(gather_mean(acc, rejected_rewards))
        metrics["rewards/accuracies"].append(gather_mean(acc, (chosen_rewards > rejected_rewards).float()))
        metrics["rewards/margins"].append(gather_mean(acc, chosen_rewards - rejected_rewards))
        metrics["logps/chosen"].append(gather_mean(acc, pair.chosen_logps))
        metrics["logps/rejected"].append(gather_mean(acc, pair.rejected_logps))
        scores = pair.scores
        if scores.mean_logits is not None:
            for name, index in (("chosen", 0), ("rejected", 1)):
                rows = pair.branch(index)
                metrics[f"logits/{name}"].append(
                    gather_row_masked_mean(acc, scores.mean_logits[rows], scores.mask[rows])
                )


def _add_empty_prompt(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"prompt_ids": []}
