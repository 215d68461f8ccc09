"""TRL's ``trl.trainer.sft_config``: ``SFTConfig`` (defined in :mod:`posttrain.trainers.sft`)."""

from posttrain.trainers.sft import SFTConfig

__all__ = ["SFTConfig"]
