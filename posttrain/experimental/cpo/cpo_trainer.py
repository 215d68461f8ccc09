"""CPOTrainer: Contrastive Preference Optimization (https://huggingface.co/papers/2401.08417) with TRL's API, its
SimPO (https://huggingface.co/papers/2405.14734), CPO-SimPO and AlphaPO (https://huggingface.co/papers/2501.03884)
variants. No reference model.

Recipe per batch: one chunked forward over ``[prompt+chosen; prompt+rejected]`` → per-row completion log-probs
(token means for ``ipo``/``simpo``, sums otherwise, as TRL) → :func:`posttrain.core.reference_free.cpo_loss`
(AlphaPO reward shape when ``alpha != 0``, then the contrastive loss) → ``mean + cpo_alpha · NLL(chosen)`` (token
mean over the chosen completions).

Metrics (TRL's names): ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected``, ``nll_loss`` (+ ``aux_loss`` for
MoE). Differences from TRL: ``logits/*`` are the mean logit over completion tokens (computed as ``h·mean_v(W)``,
TRL averages every position of the full logits), and over-long sequences are cut at their end per sequence
(TRL's legacy tokenizer cuts the prompt first).
"""

from __future__ import annotations

from posttrain.core.reference_free import cpo_loss
from posttrain.distributed import gather_mean
from posttrain.experimental._pairwise import ReferenceFreePairwiseTrainer
from posttrain.experimental.cpo.cpo_config import CPOConfig
from posttrain.trainers.preference import activation_offloading_context

__all__ = ["CPOTrainer"]


class CPOTrainer(ReferenceFreePairwiseTrainer):
    """Trainer for CPO and its variants (TRL's ``trl.experimental.cpo.CPOTrainer`` signature).

    Args:
        model: Hub id / local path (loaded with ``args.model_init_kwargs``), a ``PreTrainedModel`` or a ``PeftModel``.
        args: ``CPOConfig``; a plain ``TrainingArguments`` is converted; None → ``CPOConfig(f"{model_name}-CPO")``.
        data_collator: Defaults to ``DataCollatorForPreference`` (per-sequence truncation to ``max_length``).
        train_dataset: Preference dataset (``prompt``/``chosen``/``rejected``, or implicit prompt; standard or
            conversational), or pre-tokenized ``prompt_ids``/``chosen_ids``/``rejected_ids``.
        eval_dataset: Same format, or a dict of them.
        processing_class: Tokenizer; None loads it from the model's path.
        model_init: Builds the model when ``model`` is None (called once).
        callbacks, optimizers, preprocess_logits_for_metrics: As ``transformers.Trainer``.
        peft_config: A ``peft.PeftConfig`` to wrap ``model`` with.
        compute_metrics: Receives ``EvalPrediction`` whose predictions are the per-pair ``(rewards/chosen,
            rewards/rejected)`` and labels are zeros.
    """

    _tag_names = ["trl", "cpo"]
    _config_class = CPOConfig
    _suffix = "CPO"
    _trainer_name = "CPOTrainer"

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        args = self.args
        with activation_offloading_context(getattr(args, "activation_offloading", False)):
            pair = self._score_pairs(
                model, inputs, average=args.loss_type in ("ipo", "simpo"), nll=args.cpo_alpha != 0
            )
        losses, chosen_rewards, rejected_rewards = cpo_loss(
            pair.chosen_logps,
            pair.rejected_logps,
            args.loss_type,
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            simpo_gamma=args.simpo_gamma,
            alpha=args.alpha,
        )
        loss = losses.mean() + args.cpo_alpha * pair.chosen_nll
        loss = self._add_router_aux_loss(loss, model, pair.scores.aux_loss, mode)
        self._log_pair_metrics(mode, pair, chosen_rewards, rejected_rewards)
        self._metrics[mode]["nll_loss"].append(gather_mean(self.accelerator, pair.chosen_nll))
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss
