"""TRL's ``trl.trainer.distillation_trainer``: ``DistillationTrainer`` (:mod:`posttrain.trainers.distillation`)."""

from posttrain.trainers.distillation import DistillationTrainer

__all__ = ["DistillationTrainer"]
