"""Advantage estimators: the one place where GRPO and RLOO differ inside the rollout pipeline.

An estimator turns the rewards of a whole generation batch (gathered over processes) into one advantage per
completion. It is called by ``RolloutPipeline`` after scoring and after the old/reference log-probs were computed,
so an estimator that folds the KL penalty into the reward (RLOO) finds them in the local batch.

- ``GroupRelativeEstimator`` (GRPO): r = Σ_k w_k r_k, then group-mean baseline and ``scale_rewards``
  (``"group"``/``"batch"``/``"none"``); or GDPO's ``normalize_then_sum``.
- ``LeaveOneOutEstimator`` (RLOO): r = Σ_k w_k r_k, optional clip to ``reward_clip_range``, minus
  β·Σ_t(old − ref) (k1 KL summed over the sequence), leave-one-out baseline, optional batch normalisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from posttrain.core.advantages import (
    combine_rewards,
    group_advantages,
    group_mean_std,
    leave_one_out_advantages,
    normalize_advantages,
    normalize_then_sum_advantages,
)
from posttrain.core.masking import masked_sum

Gather = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class AdvantageResult:
    """What an estimator returns for the whole (gathered) generation batch.

    Attributes:
        advantages: ``(N,)`` one per completion (0 for unscorable rows).
        rewards: ``(N,)`` the combined reward logged as ``reward`` (NaN = unscorable).
        std: ``(N,)`` the std behind ``frac_reward_zero_std`` (None to skip that metric).
        metrics: extra scalar metrics (e.g. RLOO's ``kl``).
    """

    advantages: torch.Tensor
    rewards: torch.Tensor
    std: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class AdvantageEstimator(Protocol):
    """``estimator(rewards_per_func, weights, num_generations, batch=..., gather=...) -> AdvantageResult``."""

    needs_old_logps: bool
    needs_ref_logps: bool

    def __call__(
        self,
        rewards_per_func: torch.Tensor,
        weights: torch.Tensor,
        num_generations: int,
        *,
        batch: dict[str, Any],
        gather: Gather,
    ) -> AdvantageResult: ...


@dataclass
class GroupRelativeEstimator:
    """GRPO advantages (DeepSeekMath; Dr. GRPO's ``scale_rewards="none"``; GDPO's ``normalize_then_sum``).

    Args:
        scale_rewards: ``"group"`` (or True), ``"batch"``, ``"none"`` (or False).
        multi_objective_aggregation: ``"sum_then_normalize"`` (TRL default) or ``"normalize_then_sum"`` (GDPO).
    """

    scale_rewards: str | bool = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    needs_old_logps: bool = False
    needs_ref_logps: bool = False

    def __post_init__(self) -> None:
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            raise ValueError(
                f"Invalid multi_objective_aggregation {self.multi_objective_aggregation!r}. Valid values: "
                "'sum_then_normalize', 'normalize_then_sum'."
            )

    def __call__(self, rewards_per_func, weights, num_generations, *, batch=None, gather=None) -> AdvantageResult:
        rewards = combine_rewards(rewards_per_func, weights)
        if self.multi_objective_aggregation == "normalize_then_sum":
            advantages = normalize_then_sum_advantages(rewards_per_func, weights, num_generations)
            std = group_mean_std(rewards, num_generations)[1]
            return AdvantageResult(advantages, rewards, std)
        advantages, std = group_advantages(rewards, num_generations, self.scale_rewards)
        return AdvantageResult(advantages, rewards, std)


@dataclass
class LeaveOneOutEstimator:
    """RLOO advantages (Ahmadian et al. 2024, "Back to Basics"; REINFORCE++ with ``normalize_advantages``).

    r_i = Σ_k w_k r_ik, clamped to ``reward_clip_range``, then r_i ← r_i − β·Σ_t m·(old_t − ref_t) when β ≠ 0;
    A_i = r_i − mean of the other scored completions of its group; optionally A ← (A − mean)/(std + 1e-4).

    Args:
        beta: KL coefficient folded into the reward (RLOO default 0.05).
        reward_clip_range: ``(min, max)`` clamp of the summed reward, or None.
        normalize_advantages: batch z-score of the advantages.
    """

    beta: float = 0.05
    reward_clip_range: tuple[float, float] | None = None
    normalize_advantages: bool = False
    needs_old_logps: bool = True  # RLOO always recomputes π_old (its KL term and the sequence ratio need it)

    @property
    def needs_ref_logps(self) -> bool:
        return self.beta != 0.0

    def __call__(self, rewards_per_func, weights, num_generations, *, batch, gather) -> AdvantageResult:
        raw = combine_rewards(rewards_per_func, weights)
        rewards = raw
        if self.reward_clip_range is not None:
            low, high = self.reward_clip_range
            rewards = torch.clamp(rewards, min=low, max=high)
        metrics: dict[str, float] = {}
        if self.beta != 0.0:
            mask = batch["completion_mask"]
            per_token_kl = batch["old_per_token_logps"] - batch["ref_per_token_logps"]  # k1, may be negative
            sequence_kl = gather(masked_sum(per_token_kl, mask, dim=-1))  # (N,)
            rewards = rewards - self.beta * sequence_kl.to(rewards.device, rewards.dtype)
            token_sum = gather(masked_sum(per_token_kl, mask).reshape(1)).sum()
            token_count = gather(mask.sum().reshape(1).to(per_token_kl.dtype)).sum()
            metrics["kl"] = float(token_sum / token_count.clamp(min=1.0))
        advantages = leave_one_out_advantages(rewards, num_generations)
        if self.normalize_advantages:
            advantages = normalize_advantages(advantages, mask=~torch.isnan(rewards))
        # frac_reward_zero_std: the spread of the rewards the baseline sees (after clipping and the KL penalty), as
        # TRL; the logged reward stays the raw one.
        std = group_mean_std(rewards, num_generations)[1]
        return AdvantageResult(advantages, raw, std, metrics)


@dataclass
class PairwisePreferenceEstimator:
    """Online DPO's ranking (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"): each
    prompt's two completions (a group of G = 2) become a chosen/rejected pair by their scores.

    s_i = Σ_k w_k r_ik − ``missing_eos_penalty`` when completion i did not end with EOS; in each pair the first
    completion is chosen when s_1 ≥ s_2 (TRL's tie rule). The "advantage" is the pair sign: +1 chosen, −1 rejected.
    The result's ``rewards`` are the (gathered) scores, which the trainer reads from the pipeline's ``last_result``
    for ``objective/rlhf_reward``. Metrics (TRL's):
    ``objective/scores`` (mean s), ``objective/scores_margin`` (mean s_chosen − s_rejected),
    ``val/contain_eos_token`` (fraction of completions with EOS).

    Args:
        missing_eos_penalty: Subtracted from the score of a completion without EOS (None = off).
    """

    missing_eos_penalty: float | None = None
    needs_old_logps: bool = False
    needs_ref_logps: bool = True

    def __call__(self, rewards_per_func, weights, num_generations, *, batch, gather) -> AdvantageResult:
        if num_generations != 2:
            raise ValueError(
                f"PairwisePreferenceEstimator ranks pairs: num_generations must be 2, got {num_generations}."
            )
        scores = combine_rewards(rewards_per_func, weights)
        finished = gather(batch["finished"].long()).bool().to(scores.device)
        if self.missing_eos_penalty is not None:
            scores = torch.where(finished, scores, scores - self.missing_eos_penalty)
        pairs = torch.nan_to_num(scores, nan=float("-inf")).reshape(-1, 2)
        first_chosen = pairs[:, 0] >= pairs[:, 1]  # (P,)
        signs = torch.stack([first_chosen, ~first_chosen], dim=1).float() * 2 - 1  # (P, 2): +1 chosen, -1 rejected
        grouped = scores.reshape(-1, 2)
        margin = torch.where(first_chosen, grouped[:, 0] - grouped[:, 1], grouped[:, 1] - grouped[:, 0])
        metrics = {
            "objective/scores": float(scores.nanmean()),
            "objective/scores_margin": float(margin.nanmean()),
            "val/contain_eos_token": float(finished.float().mean()),
        }
        return AdvantageResult(signs.reshape(-1), scores, None, metrics)


@dataclass
class OptimalAdvantageEstimator:
    """A*-PO's stage-2 advantage: A_i = r_i − V*(x_i) with V* estimated before training (``core.optimal_value``).

    The trainer sets ``v_star`` (``(N_local,)``, this process's rows) before each rollout; it is gathered here like
    the rewards. Metric: ``v_star`` (mean, TRL's name).
    """

    v_star: torch.Tensor | None = None
    needs_old_logps: bool = False
    needs_ref_logps: bool = True

    def __call__(self, rewards_per_func, weights, num_generations, *, batch, gather) -> AdvantageResult:
        if self.v_star is None:
            raise RuntimeError("OptimalAdvantageEstimator.v_star must be set before the rollout (stage 1 of A*-PO).")
        rewards = combine_rewards(rewards_per_func, weights)
        v_star = gather(self.v_star.to(rewards.device)).to(rewards.dtype)
        advantages = torch.nan_to_num(rewards - v_star, nan=0.0)
        return AdvantageResult(advantages, rewards, None, {"v_star": float(v_star.mean())})


@dataclass
class GAEEstimator:
    """PPO's per-token advantages (TRL's ``PPOTrainer``): score → per-token rewards with a KL penalty → GAE.

    s_i = Σ_k w_k r_ik (− ``missing_eos_penalty`` without EOS); KL_t = old_t − ref_t (k1) or (e^{ref−old} − 1) −
    (ref − old) (k3), 0 without a reference; r_t = −kl_coef·KL_t, + s_i on the last token (``core.gae``), optionally
    whitened; V_t from ``values_fn`` (the value head, no grad); A = whiten(GAE(r, V; γ, λ)), R = GAE + V.
    The per-token tensors go into the local batch as ``token_advantages``, ``returns``, ``old_values`` ``(B, C)``;
    the returned per-sequence advantages are the scores (for the completions table). Metrics (TRL's):
    ``objective/kl``, ``objective/entropy``, ``objective/non_score_reward``, ``objective/rlhf_reward``,
    ``objective/scores``, ``val/num_eos_tokens``.
    """

    values_fn: Callable[[dict[str, Any]], torch.Tensor]
    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    gamma: float = 1.0
    lam: float = 0.95
    whiten_rewards: bool = False
    missing_eos_penalty: float | None = None
    process_index: int = 0
    # sums a tensor over processes (``distributed.sum_over_processes``): whitening then uses the global moments
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    needs_old_logps: bool = True
    needs_ref_logps: bool = True

    def __call__(self, rewards_per_func, weights, num_generations, *, batch, gather) -> AdvantageResult:
        from posttrain.core.gae import gae, masked_whiten, ppo_token_rewards

        scores_all = torch.nan_to_num(combine_rewards(rewards_per_func, weights), nan=0.0)
        finished_all = gather(batch["finished"].long()).bool().to(scores_all.device)
        if self.missing_eos_penalty is not None:
            scores_all = torch.where(finished_all, scores_all, scores_all - self.missing_eos_penalty)
        n = batch["completion_ids"].shape[0]
        scores = scores_all[self.process_index * n : (self.process_index + 1) * n].cpu()
        mask = batch["completion_mask"].float()
        old = batch["old_per_token_logps"].float()
        ref = batch.get("ref_per_token_logps")
        if ref is None:
            kl = torch.zeros_like(old)
        elif self.kl_estimator == "k3":
            log_ratio = ref.float() - old
            kl = (torch.exp(log_ratio) - 1) - log_ratio
        else:
            kl = old - ref.float()
        kl = kl * mask
        rewards, non_score = ppo_token_rewards(scores, kl, mask, self.kl_coef)
        if self.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False, reduce_sum=self.reduce_sum)
        with torch.no_grad():
            values = self.values_fn(batch).float().cpu() * mask
        advantages, returns = gae(rewards, values, mask, gamma=self.gamma, lam=self.lam)
        batch["token_advantages"] = masked_whiten(advantages, mask, reduce_sum=self.reduce_sum)
        batch["returns"] = returns
        batch["old_values"] = values

        def mean(x: torch.Tensor) -> float:
            return float(gather(x.float().mean().reshape(1)).mean())

        metrics = {
            "objective/kl": mean(kl.sum(1)),
            "objective/entropy": mean((-old * mask).sum(1)),
            "objective/non_score_reward": mean(non_score.sum(1)),
            "objective/rlhf_reward": mean(scores + non_score.sum(1)),
            "objective/scores": float(scores_all.mean()),
            "val/num_eos_tokens": float(finished_all.sum()),
        }
        return AdvantageResult(scores_all, scores_all, None, metrics)
