"""``OnlineDPOTrainer`` (Guo et al. 2024, arXiv 2402.04792) on the shared online-RL rollout.

One micro-step = one rollout of ``per_device_train_batch_size`` prompts × 2 completions by the shared
``RolloutPipeline`` (sampler, reward scorer, π_ref log-probs). What Online DPO adds:

- an estimator, ``rollout.estimators.PairwisePreferenceEstimator``: scores (reward functions, a reward model, or a
  pairwise judge through :class:`JudgeReward`) minus ``missing_eos_penalty``, then chosen/rejected per pair;
- a loss: the DPO ``sigmoid`` / ``ipo`` loss of ``core.preference`` on the pairs' summed completion log-ratios
  (IPO on sums, as TRL's Online DPO: unit lengths are passed), β of the current epoch (``beta`` may be a list),
  averaged over pairs and divided by the gradient-accumulation steps (``_finish_loss``).

Before the policy's and the reference's forward, a pair's prompt is cut from the left so prompt + completion fit
``max_length`` (TRL truncates both the same way); both score under the raw logits, not logits / ``temperature``
(TRL). Metrics are TRL's: ``objective/kl``, ``objective/entropy``,
``objective/non_score_reward``, ``objective/rlhf_reward``, ``objective/scores``, ``objective/scores_margin``,
``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected``, ``val/contain_eos_token``, ``beta`` (plus the rollout's ``reward``, ``completions/*``,
``timing/*``).
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.core.masking import masked_sum
from posttrain.core.preference import DPO_LOSSES, DPOLossInputs
from posttrain.experimental._online import reward_sources
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.estimators import PairwisePreferenceEstimator
from posttrain.trainers.online import OnlineTrainerBase

from .online_dpo_config import OnlineDPOConfig


def _text(completion: Any) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)


class JudgeReward:
    """A pairwise judge as a reward function: each consecutive pair of completions (the two samples of one prompt)
    gets 1.0 for the completion the judge prefers and 0.0 for the other.

    ``judge`` is an object with TRL's ``BasePairwiseJudge`` method ``judge(prompts, completions, shuffle_order=...)
    -> list[int]`` (index 0 or 1 of the preferred completion per prompt, -1 for a tie) or a plain callable with the
    same ``(prompts, completion_pairs)`` arguments.
    """

    def __init__(self, judge: Any):
        self.judge = judge
        self.__name__ = type(judge).__name__ if hasattr(judge, "judge") else getattr(judge, "__name__", "judge")

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        if len(completions) % 2:
            raise ValueError("JudgeReward needs the completions as consecutive pairs (two per prompt).")
        pair_prompts = [_text(p) if isinstance(p, list) else p for p in prompts[::2]]
        pairs = [[_text(completions[i]), _text(completions[i + 1])] for i in range(0, len(completions), 2)]
        if hasattr(self.judge, "judge"):
            choices = self.judge.judge(pair_prompts, pairs)
        else:
            choices = self.judge(pair_prompts, pairs)
        rewards: list[float] = []
        for choice in choices:
            if int(choice) not in (-1, 0, 1):
                raise ValueError(f"A pairwise judge returns 0, 1 (the preferred index) or -1 (tie), got {choice!r}.")
            rewards += {0: [1.0, 0.0], 1: [0.0, 1.0], -1: [0.5, 0.5]}[int(choice)]
        return rewards


class OnlineDPOTrainer(OnlineTrainerBase):
    """Trainer for Online DPO with TRL's constructor, config and metrics.

    Args:
        model: Hub id / local path, or a causal LM (optionally a ``PeftModel``).
        ref_model: The reference policy; None = a frozen copy of ``model`` (or the base with adapters disabled
            under PEFT). Must not be ``model`` itself.
        reward_funcs: Reward functions (TRL's keyword contract), reward-model ids/paths or sequence classifiers,
            registered names. As in TRL, ``args.reward_model_path`` is not read here: pass that model (or its path)
            in ``reward_funcs``, as TRL's ``online_dpo.py`` example does.
        args: :class:`OnlineDPOConfig`.
        train_dataset: Prompt-only dataset (``"prompt"``: text or messages).
        processing_class / reward_processing_classes / peft_config / callbacks / optimizers: as ``GRPOTrainer``.
        judge: A pairwise judge (see :class:`JudgeReward`), used as a reward source (posttrain; TRL's earlier API).
        data_collator / compute_metrics / preprocess_logits_for_metrics: accepted for TRL compatibility and unused
            (the rollout batches prompts itself; there are no eval predictions).
    """

    config_class = OnlineDPOConfig
    keeps_short_last_round = True  # TRL's plain Trainer dataloader keeps an epoch's short last batch
    shuffles_generation_batch = False  # TRL's Online DPO trains its dataloader's batches in order
    _trainer_name = "OnlineDPO"
    _tag_names = ["posttrain", "online-dpo"]
    scores_at_sampling_temperature = False  # TRL: log-probs of the raw logits, not logits / temperature

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        reward_funcs: Any = None,
        args: OnlineDPOConfig | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        peft_config: Any = None,
        compute_metrics: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        preprocess_logits_for_metrics: Any = None,
        judge: Any = None,
    ):
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        if ref_model is not None and ref_model is model:
            raise ValueError(
                "`model` and `ref_model` cannot be the same object. If you want `ref_model` to be the same as "
                "`model`, either omit the `ref_model` argument or pass `None`."
            )
        self._ref_model_arg = ref_model
        # As TRL 1.16, the trainer never reads `args.reward_model_path`: TRL's online_dpo.py example loads that model
        # itself and passes it in `reward_funcs`, so adding it here too would score it twice.
        funcs = reward_sources(reward_funcs, last=(JudgeReward(judge) if judge is not None else None,))
        if not funcs:
            raise ValueError(
                "`reward_funcs` must be provided. (`args.reward_model_path` is not read by the trainer, as in TRL: "
                "pass the path or the loaded model as `reward_funcs`, or give a `judge`.)"
            )
        super().__init__(
            model,
            funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )

    # -- construction hooks ------------------------------------------------------------------------------------
    def _setup_loss(self) -> None:
        self._loss_fn = DPO_LOSSES.get(self.args.loss_type)
        # The dataloader yields the prompts' rows twice each (RepeatSampler): 2 × per_device_train_batch_size rows.
        self._train_batch_size = self.args.generation_batch_size // self.accelerator.num_processes

    def _make_estimator(self) -> PairwisePreferenceEstimator:
        return PairwisePreferenceEstimator(self.args.missing_eos_penalty)

    @property
    def beta(self) -> float:
        """β of the current epoch: ``beta[epoch]``, the last entry after the list runs out (TRL)."""
        beta = self.args.beta
        if isinstance(beta, list):
            epoch = int(self.state.epoch or 0)
            return beta[epoch] if epoch < len(beta) else beta[-1]
        return beta

    # -- the rollout step: pair bookkeeping and max_length -----------------------------------------------------
    def _generate_and_score(self, rows: list[dict[str, Any]], mode: str) -> RolloutBatch:
        batch = super()._generate_and_score(rows, mode)
        n = batch["completion_ids"].shape[0]
        device = batch["completion_ids"].device
        first = self.accelerator.process_index * n
        batch["scores"] = self.pipeline.last_result.rewards[first : first + n].to(device)  # the pair scores
        batch["pair_index"] = torch.arange(n, device=device) // 2  # pairs are consecutive rows before the shuffle
        return self._fit_max_length(batch)

    def _fit_max_length(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Cut the prompt columns from the left so prompt + completion fit ``max_length`` (in place; returned)."""
        keep = self.args.max_length - batch["completion_ids"].shape[1]
        if batch["prompt_ids"].shape[1] > keep:
            keep = max(keep, 1)
            batch["prompt_ids"] = batch["prompt_ids"][:, -keep:]
            batch["prompt_mask"] = batch["prompt_mask"][:, -keep:]
        return batch

    def _ref_logps(self, batch: RolloutBatch) -> torch.Tensor:
        """π_ref log-probs on the same ``max_length`` cut as the policy's (TRL truncates both forwards)."""
        return super()._ref_logps(self._fit_max_length(dict(batch)))

    # -- loss --------------------------------------------------------------------------------------------------
    def _compute_loss(self, model: torch.nn.Module, inputs: RolloutBatch) -> torch.Tensor:
        mode = self._mode()
        beta = self.beta
        stats = self._token_stats(model, inputs)
        mask = inputs["completion_mask"].to(stats.logps.dtype)
        logps = masked_sum(stats.logps, mask, dim=-1)  # (B,) summed completion log-probs
        ref_logps = masked_sum(inputs["ref_per_token_logps"].to(stats.logps.dtype), mask, dim=-1)
        chosen, rejected = self._pair_rows(inputs["advantages"], inputs["pair_index"])
        ones = torch.ones_like(logps[chosen])
        pairs = DPOLossInputs(logps[chosen], logps[rejected], ref_logps[chosen], ref_logps[rejected], ones, ones)
        loss = self._loss_fn(pairs, beta=beta).mean()
        self._record_pair_metrics(pairs, logps, ref_logps, inputs["scores"], beta, mode)
        return self._finish_loss(loss, stats.aux_loss)

    @staticmethod
    def _pair_rows(signs: torch.Tensor, pair_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row indices of the chosen and the rejected completion of each pair, in pair order."""
        chosen = torch.nonzero(signs > 0).flatten()
        rejected = torch.nonzero(signs < 0).flatten()
        chosen = chosen[pair_index[chosen].argsort()]
        rejected = rejected[pair_index[rejected].argsort()]
        if chosen.numel() != rejected.numel() or not torch.equal(pair_index[chosen], pair_index[rejected]):
            raise RuntimeError("An Online DPO micro-batch must hold both completions of every pair.")
        return chosen, rejected

    def _record_pair_metrics(
        self,
        pairs: DPOLossInputs,
        logps: torch.Tensor,
        ref_logps: torch.Tensor,
        scores: torch.Tensor,
        beta: float,
        mode: str,
    ) -> None:
        mean = self._gather_mean
        with torch.no_grad():
            kl = (logps - ref_logps).detach()  # (B,) Σ_t (log π − log π_ref)
            non_score_reward = -beta * kl
            chosen_rewards = beta * pairs.chosen_logratios.detach()
            rejected_rewards = beta * pairs.rejected_logratios.detach()
            margins = chosen_rewards - rejected_rewards
            for name, value in (
                ("objective/kl", kl.mean()),
                ("objective/entropy", -logps.detach().mean()),
                ("objective/non_score_reward", non_score_reward.mean()),
                ("objective/rlhf_reward", (scores.to(kl.dtype) + non_score_reward).mean()),
                ("rewards/chosen", chosen_rewards.mean()),
                ("rewards/rejected", rejected_rewards.mean()),
                ("rewards/margins", margins.mean()),
                ("rewards/accuracies", (margins > 0).float().mean()),
                ("logps/chosen", pairs.chosen_logps.detach().mean()),
                ("logps/rejected", pairs.rejected_logps.detach().mean()),
            ):
                self.record_metric(name, mean(value), mode=mode)
        self.record_metric("beta", beta, mode=mode)
