"""GRPO with a replay buffer (TRL's ``trl.experimental.grpo_with_replay_buffer``): groups whose rewards do not vary
are replaced by stored high-variance groups."""

from posttrain.experimental.grpo_with_replay_buffer.grpo_with_replay_buffer_config import GRPOWithReplayBufferConfig
from posttrain.experimental.grpo_with_replay_buffer.grpo_with_replay_buffer_trainer import (
    GRPOWithReplayBufferTrainer,
)
from posttrain.rollout.replay_buffer import ReplayBuffer

__all__ = ["GRPOWithReplayBufferConfig", "GRPOWithReplayBufferTrainer", "ReplayBuffer"]
