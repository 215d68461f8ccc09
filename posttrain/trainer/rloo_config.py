"""TRL's ``trl.trainer.rloo_config``: ``RLOOConfig`` (defined in :mod:`posttrain.trainers.rloo`)."""

from posttrain.trainers.rloo import RLOOConfig

__all__ = ["RLOOConfig"]
