"""PPO with a value head (TRL's ``trl.experimental.ppo``; TRL 1.16 removed PPO from its stable API)."""

from posttrain.experimental.ppo.modeling_value_head import AutoModelForCausalLMWithValueHead, ValueHead
from posttrain.experimental.ppo.ppo_config import PPOConfig
from posttrain.experimental.ppo.ppo_trainer import PPOTrainer

__all__ = ["AutoModelForCausalLMWithValueHead", "PPOConfig", "PPOTrainer", "ValueHead"]
