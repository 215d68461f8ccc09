"""Distillation from a teacher behind a generation server (TRL's ``trl.experimental.server_distillation``)."""

from posttrain.experimental.server_distillation.server_distillation_config import ServerDistillationConfig
from posttrain.experimental.server_distillation.server_distillation_trainer import ServerDistillationTrainer

__all__ = ["ServerDistillationConfig", "ServerDistillationTrainer"]
