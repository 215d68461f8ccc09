"""ORPOTrainer: Odds Ratio Preference Optimization (https://huggingface.co/papers/2403.07691) with TRL's API. No
reference model: SFT and preference alignment in one loss.

Recipe per batch: one chunked forward over ``[prompt+chosen; prompt+rejected]`` → token-mean completion log-probs
``l_c``, ``l_r`` and the token-mean NLL of the chosen sequences (prompt and completion, as TRL) →
:func:`posttrain.core.reference_free.orpo_odds_ratio_loss` →
``loss = NLL(chosen) − mean(β · log σ(log-odds(chosen) − log-odds(rejected)))``.

Metrics (TRL's names): ``rewards/chosen`` / ``rewards/rejected`` (β · token-mean log-prob), ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected``, ``nll_loss``,
``log_odds_ratio`` (mean log σ of the log odds ratio) and ``log_odds_chosen`` (mean log odds ratio), as TRL names
them (+ ``aux_loss`` for MoE). ``logits/*`` are the mean logit over completion tokens (TRL: over every position).
"""

from __future__ import annotations

import dataclasses

from posttrain.core.reference_free import orpo_odds_ratio_loss
from posttrain.distributed import gather_mean
from posttrain.experimental._pairwise import ReferenceFreePairwiseTrainer
from posttrain.experimental.orpo.orpo_config import ORPOConfig
from posttrain.trainers.preference import activation_offloading_context

__all__ = ["ORPOTrainer"]


class ORPOTrainer(ReferenceFreePairwiseTrainer):
    """Trainer for ORPO (TRL's ``trl.experimental.orpo.ORPOTrainer`` signature).

    Args:
        model: Hub id / local path (loaded with ``args.model_init_kwargs``), a ``PreTrainedModel`` or a ``PeftModel``.
        args: ``ORPOConfig``; a plain ``TrainingArguments`` is converted; None → ``ORPOConfig(f"{model_name}-ORPO")``.
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

    _tag_names = ["trl", "orpo"]
    _config_class = ORPOConfig
    _suffix = "ORPO"
    _trainer_name = "ORPOTrainer"

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        # TRL (as the ORPO reference code) takes the NLL term over the whole chosen sequence, prompt included, and
        # the odds ratio over the completions: one scoring pass over every attended token, then split.
        full = {**inputs, "completion_mask": inputs["attention_mask"]}
        with activation_offloading_context(getattr(self.args, "activation_offloading", False)):
            pair = self._score_pairs(model, full, average=False, nll=True)
        completion = pair.scores.mask & inputs["completion_mask"].bool()
        logps = (pair.scores.logps * completion).sum(-1) / completion.sum(-1).clamp(min=1).to(pair.scores.logps.dtype)
        pair = dataclasses.replace(
            pair,
            chosen_logps=logps[pair.branch(0)],
            rejected_logps=logps[pair.branch(1)],
            scores=dataclasses.replace(pair.scores, mask=completion),
        )
        odds_term, log_odds_ratio, log_odds = orpo_odds_ratio_loss(
            pair.chosen_logps, pair.rejected_logps, beta=self.args.beta
        )
        loss = pair.chosen_nll - odds_term.mean()
        loss = self._add_router_aux_loss(loss, model, pair.scores.aux_loss, mode)
        beta = self.args.beta
        chosen_rewards, rejected_rewards = beta * pair.chosen_logps.detach(), beta * pair.rejected_logps.detach()
        self._log_pair_metrics(mode, pair, chosen_rewards, rejected_rewards)
        acc = self.accelerator
        self._metrics[mode]["nll_loss"].append(gather_mean(acc, pair.chosen_nll))
        self._metrics[mode]["log_odds_ratio"].append(gather_mean(acc, log_odds_ratio))
        self._metrics[mode]["log_odds_chosen"].append(gather_mean(acc, log_odds))
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss
