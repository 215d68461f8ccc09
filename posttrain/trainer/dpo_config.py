"""TRL's ``trl.trainer.dpo_config``: ``DPOConfig`` (defined in :mod:`posttrain.trainers.dpo`)."""

from posttrain.trainers.dpo import DPOConfig

__all__ = ["DPOConfig"]
