"""TRL's ``trl.trainer.distillation_config``: ``DistillationConfig`` (defined in :mod:`posttrain.trainers.distillation`)."""

from posttrain.trainers.distillation import DistillationConfig

__all__ = ["DistillationConfig"]
