"""TPOTrainer: Triple Preference Optimization (https://huggingface.co/papers/2405.16681) with TRL's API.

Each row has a prompt and three completions: a gold ``reference``, a preferred ``chosen`` and a dispreferred
``rejected``. No reference *model*: the loss is a reference-free contrastive term on (chosen, rejected) plus
``tpo_alpha`` · NLL of the gold response.

Recipe per batch: one chunked forward over ``[prompt+chosen; prompt+rejected; prompt+reference]`` (the reference
block is dropped when ``tpo_alpha == 0``) → per-row completion log-probs (token means for ``ipo``/``tpo-l``, sums
otherwise) → :func:`posttrain.core.reference_free.contrastive_loss` (``gamma = tpo_l_gamma`` for ``tpo-l``) →
``mean + tpo_alpha · NLL(reference)`` (token mean over the gold completions).

Metrics (TRL's names): ``entropy``, ``num_tokens``, ``logits/chosen``, ``logits/rejected``, ``mean_token_accuracy``
(chosen tokens), ``rewards/chosen``, ``rewards/rejected`` (β · log-probs), ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (+ ``aux_loss`` for MoE).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.core.reference_free import contrastive_loss
from posttrain.data.collators import _cat_truncate, _PairedPadding, _to_list
from posttrain.data.formats import DataFormatError, column_names
from posttrain.distributed import gather_row_masked_mean
from posttrain.experimental._pairwise import ReferenceFreePairwiseTrainer
from posttrain.experimental.tpo.tpo_config import TPOConfig

__all__ = ["DataCollatorForTriplePreference", "TPOTrainer", "tokenize_triple_preference"]


@dataclass
class DataCollatorForTriplePreference(_PairedPadding):
    """TPO collator: ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` [, ``reference_ids``] → one right-padded
    ``(3B, L)`` batch ``[prompt+chosen; prompt+rejected; prompt+reference]`` (``(2B, L)`` without the reference
    block when ``include_reference=False``).

    Args:
        pad_token_id: Padding id for ``input_ids``.
        max_length: Truncate each prompt+completion sequence to this many tokens (None: no truncation).
        truncation_mode: ``"keep_start"`` or ``"keep_end"``.
        pad_to_multiple_of: Round the padded length up to a multiple of this.
        include_reference: Whether to add the ``reference_ids`` block (False when ``tpo_alpha == 0``).

    Returns:
        ``input_ids``, ``attention_mask``, ``completion_mask``.
    """

    include_reference: bool = True

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        keys = (
            ("chosen_ids", "rejected_ids", "reference_ids")
            if self.include_reference
            else ("chosen_ids", "rejected_ids")
        )
        seqs, masks = [], []
        for key in keys:
            for ex in examples:
                ids, mask = _cat_truncate(
                    (_to_list(ex.get("prompt_ids", [])), _to_list(ex[key])), self.max_length, self.truncation_mode
                )
                seqs.append(ids)
                masks.append(mask)
        return self._pad_sequences(seqs, masks)


def tokenize_triple_preference(
    example: Mapping[str, Any],
    tokenizer: Any,
    *,
    add_eos: bool = True,
    tools: Any = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    row_index: int | None = None,
) -> dict[str, list[int]]:
    """``{"prompt_ids", "chosen_ids", "rejected_ids", "reference_ids"}`` of a triple-preference row.

    An implicit prompt is extracted from ``chosen``/``rejected`` and stripped from ``reference`` too, which must
    start with it (TRL); standard completions get EOS."""
    from posttrain.data.tokenization import _tokenize_prompt_and_completions
    from posttrain.data_utils import maybe_extract_prompt

    for column in ("chosen", "rejected", "reference"):
        if column not in example:
            raise DataFormatError(
                "the column is missing; TPO rows need 'chosen', 'rejected' and 'reference' (the gold response).",
                row=row_index,
                column=column,
            )
    row = dict(example)
    if "prompt" not in row:
        row.update(maybe_extract_prompt(row))
        prompt, reference = row["prompt"], row["reference"]
        if reference[: len(prompt)] != prompt:
            raise DataFormatError(
                "The `reference` completion does not start with the implicit prompt extracted from `chosen`/"
                "`rejected`. Either provide an explicit `prompt` column, or make sure the `reference` completion "
                "shares the same prompt prefix.",
                row=row_index,
                column="reference",
            )
        row["reference"] = reference[len(prompt) :]
    return _tokenize_prompt_and_completions(
        row,
        tokenizer,
        ("chosen", "rejected", "reference"),
        add_eos=add_eos,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        row_index=row_index,
    )


class TPOTrainer(ReferenceFreePairwiseTrainer):
    """Trainer for TPO (TRL's ``trl.experimental.tpo.TPOTrainer`` arguments).

    Args:
        model: Hub id / local path (loaded with ``args.model_init_kwargs``), a ``PreTrainedModel`` or a ``PeftModel``.
        args: ``TPOConfig``; a plain ``TrainingArguments`` is converted; None → ``TPOConfig(f"{model_name}-TPO")``.
        data_collator: Defaults to :class:`DataCollatorForTriplePreference`.
        train_dataset: Triple-preference dataset: ``prompt`` (or implicit), ``chosen``, ``rejected`` and
            ``reference`` (standard or conversational), or pre-tokenized ``prompt_ids``/``chosen_ids``/
            ``rejected_ids``/``reference_ids``.
        eval_dataset: Same format, or a dict of them.
        processing_class: Tokenizer; None loads it from the model's path.
        compute_metrics: Receives ``EvalPrediction`` whose predictions are the per-pair ``(rewards/chosen,
            rewards/rejected)`` and labels are zeros.
        callbacks, optimizers: As ``transformers.Trainer``.
        peft_config: A ``peft.PeftConfig`` to wrap ``model`` with.
    """

    _tag_names = ["trl", "tpo"]
    _config_class = TPOConfig
    _suffix = "TPO"
    _trainer_name = "TPOTrainer"
    _completion_columns = ("chosen", "rejected", "reference")
    _signature_columns_extra = ("prompt_ids", "chosen_ids", "rejected_ids", "reference_ids")

    def __init__(
        self,
        model: str | torch.nn.Module,
        args: TPOConfig | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
    ):
        super().__init__(
            model, args=args, data_collator=data_collator, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, callbacks=callbacks, optimizers=optimizers, peft_config=peft_config,
            compute_metrics=compute_metrics,
        )  # fmt: skip

    def _default_collator(self, args: TPOConfig) -> DataCollatorForTriplePreference:
        return DataCollatorForTriplePreference(
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=args.pad_to_multiple_of,
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            include_reference=args.tpo_alpha != 0.0,
        )

    def _validate_dataset(self, dataset: Any, name: str) -> Any:
        fmt = super()._validate_dataset(dataset, name)
        needed = "reference_ids" if fmt.type.startswith("tokenized_") else "reference"
        if needed not in column_names(dataset):
            raise DataFormatError(
                f"TPO requires a triple-preference dataset with `chosen`, `rejected` and `reference` columns, but the "
                f"{name} dataset is missing the `{needed}` (gold) column. Got columns: {column_names(dataset)}."
            )
        return fmt

    def _tokenize_fn(self):
        return tokenize_triple_preference

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        args = self.args
        n_branches = 3 if args.tpo_alpha != 0.0 else 2
        pair = self._score_pairs(
            model,
            inputs,
            average=args.loss_type in ("ipo", "tpo-l"),
            nll=False,
            entropy=True,
            accuracy=True,
            n_branches=n_branches,
        )
        losses = contrastive_loss(
            pair.chosen_logps,
            pair.rejected_logps,
            args.loss_type,
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            gamma=args.tpo_l_gamma,
        )
        loss = losses.mean()
        scores = pair.scores
        if n_branches == 3:
            gold = pair.branch(2)
            loss = loss + args.tpo_alpha * self._token_mean_nll(scores.logps[gold], scores.mask[gold])
        loss = self._add_router_aux_loss(loss, model, scores.aux_loss, mode)
        chosen_rewards, rejected_rewards = (
            args.beta * pair.chosen_logps.detach(),
            args.beta * pair.rejected_logps.detach(),
        )
        acc, metrics = self.accelerator, self._metrics[mode]
        # per batch row (its branches side by side), so the rows repeated to even out a last batch are left out
        by_row = lambda x: x.reshape(n_branches, pair.batch_size, -1).transpose(0, 1).flatten(1)  # noqa: E731
        metrics["entropy"].append(gather_row_masked_mean(acc, by_row(scores.entropy), by_row(scores.mask)))
        self._count_train_tokens(inputs, mode)
        chosen = pair.branch(0)
        metrics["mean_token_accuracy"].append(
            gather_row_masked_mean(acc, scores.correct.float()[chosen], scores.mask[chosen])
        )
        self._log_pair_metrics(mode, pair, chosen_rewards, rejected_rewards)
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss
