"""TRL's ``trl.trainer.rloo_trainer``: ``RLOOTrainer`` (:mod:`posttrain.trainers.rloo`)."""

from posttrain.trainers.rloo import RLOOTrainer

__all__ = ["RLOOTrainer"]
