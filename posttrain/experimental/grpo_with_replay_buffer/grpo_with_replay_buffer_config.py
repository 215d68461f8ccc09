"""``GRPOWithReplayBufferConfig``: ``GRPOConfig`` plus ``replay_buffer_size`` (TRL's field and default)."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.trainers.grpo import GRPOConfig


@dataclass
class GRPOWithReplayBufferConfig(GRPOConfig):
    """Configuration of :class:`GRPOWithReplayBufferTrainer`: every ``GRPOConfig`` field, plus ``replay_buffer_size``."""

    replay_buffer_size: int = field(
        default=64,
        metadata={
            "help": "A cache that stores the rollouts with the highest advantage scores and variance per group. If a "
            "new group has 0 variance, it is replaced with a group sampled from the replay buffer. 0 = off."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.replay_buffer_size < 0:
            raise ValueError(f"replay_buffer_size must be >= 0, got {self.replay_buffer_size}.")
