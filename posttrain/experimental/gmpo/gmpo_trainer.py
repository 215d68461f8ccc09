"""``GMPOTrainer`` (arXiv 2507.20673): ``GRPOTrainer`` whose loss is the ``gmpo`` preset.

The rollout, rewards, advantages, KL, logging and checkpoints are GRPO's; the objective is
``core.policy_objectives.gmpo_objective`` (per-token log-ratios clipped in log space by the advantage's sign, then
the geometric mean per sequence), aggregated with a mean over sequences and divided by the gradient-accumulation
steps. As TRL's GMPO: a top-entropy mask (``top_entropy_quantile < 1``) selects the tokens *inside* the geometric
mean, and the sampler-vs-trainer importance-sampling correction is not applied.
"""

from __future__ import annotations

import torch

from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.pipeline import ImportanceSamplingSettings
from posttrain.trainers.grpo import GRPOTrainer

from .gmpo_config import GMPOConfig


class GMPOTrainer(GRPOTrainer):
    """Trainer for Geometric-Mean Policy Optimization; constructor and metrics as :class:`GRPOTrainer`."""

    config_class = GMPOConfig
    _trainer_name = "GMPO"
    _tag_names = ["posttrain", "gmpo"]

    def _importance_sampling(self) -> ImportanceSamplingSettings | None:
        if self.args.loss_type != "gmpo":
            return super()._importance_sampling()
        return None

    def _policy_term(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor,
        inputs: RolloutBatch,
        mask: torch.Tensor,
        entropy_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if entropy_mask is not None and self.args.loss_type == "gmpo":
            mask, entropy_mask = mask * entropy_mask, None  # the geometric mean runs over the kept tokens only
        return super()._policy_term(logps, old_logps, inputs, mask, entropy_mask)
