"""Generalized Knowledge Distillation (TRL's ``trl.experimental.gkd``): ``GKDConfig`` / ``GKDTrainer``."""

from posttrain.experimental.gkd.gkd_config import GKDConfig
from posttrain.experimental.gkd.gkd_trainer import GKDTrainer

__all__ = ["GKDConfig", "GKDTrainer"]
