"""SDPO, Self-Distillation Policy Optimization (TRL's ``trl.experimental.sdpo``): GRPO plus self-distillation from
a teacher re-prompted with a successful rollout of the same group (and optional environment feedback)."""

from posttrain.experimental.sdpo.sdpo_config import SDPOConfig
from posttrain.experimental.sdpo.sdpo_trainer import SDPOTrainer
from posttrain.experimental.sdpo.teacher_context import SuccessfulRolloutTeacherContextBuilder

__all__ = ["SDPOConfig", "SDPOTrainer", "SuccessfulRolloutTeacherContextBuilder"]
