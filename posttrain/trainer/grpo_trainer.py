"""TRL's ``trl.trainer.grpo_trainer``: ``GRPOTrainer`` (:mod:`posttrain.trainers.grpo`)."""

from posttrain.trainers.grpo import GRPOTrainer

__all__ = ["GRPOTrainer"]
