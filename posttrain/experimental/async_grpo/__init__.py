"""Asynchronous GRPO (TRL's ``trl.experimental.async_grpo``): a rollout worker process streams generation rounds
from a server while the trainer trains; see ``async_grpo_trainer`` for the design, staleness and resume rules."""

from posttrain.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
from posttrain.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, RolloutWorkerError

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "RolloutWorkerError"]
