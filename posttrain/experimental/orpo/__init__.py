"""ORPO: Monolithic Preference Optimization without Reference Model (TRL's ``trl.experimental.orpo``)."""

from posttrain.experimental.orpo.orpo_config import ORPOConfig
from posttrain.experimental.orpo.orpo_trainer import ORPOTrainer

__all__ = ["ORPOConfig", "ORPOTrainer"]
