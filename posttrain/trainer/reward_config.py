"""TRL's ``trl.trainer.reward_config``: ``RewardConfig`` (defined in :mod:`posttrain.trainers.reward`)."""

from posttrain.trainers.reward import RewardConfig

__all__ = ["RewardConfig"]
