"""Asynchronous on-policy distillation (TRL's ``trl.experimental.async_distillation``): a rollout worker process
streams student samples from a generation server, scored by teacher servers, while the trainer trains; see
``async_distillation_trainer`` for the design, the loss, staleness and resume rules."""

from posttrain.experimental.async_distillation.async_distillation_config import AsyncDistillationConfig
from posttrain.experimental.async_distillation.async_distillation_trainer import (
    AsyncDistillationTrainer,
    RolloutWorkerError,
)

__all__ = ["AsyncDistillationConfig", "AsyncDistillationTrainer", "RolloutWorkerError"]
