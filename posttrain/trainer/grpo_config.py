"""TRL's ``trl.trainer.grpo_config``: ``GRPOConfig`` (defined in :mod:`posttrain.trainers.grpo`)."""

from posttrain.trainers.grpo import GRPOConfig

__all__ = ["GRPOConfig"]
