"""TRL's ``trl.trainer.kto_config``: ``KTOConfig`` (defined in :mod:`posttrain.trainers.kto`)."""

from posttrain.trainers.kto import KTOConfig

__all__ = ["KTOConfig"]
