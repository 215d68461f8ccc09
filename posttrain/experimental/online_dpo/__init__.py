"""Online DPO (TRL's ``trl.experimental.online_dpo``): two completions per prompt from the shared rollout, ranked by
reward functions, a reward model or a pairwise judge, trained with the DPO sigmoid / IPO loss."""

from posttrain.experimental.online_dpo.online_dpo_config import OnlineDPOConfig
from posttrain.experimental.online_dpo.online_dpo_trainer import JudgeReward, OnlineDPOTrainer

__all__ = ["JudgeReward", "OnlineDPOConfig", "OnlineDPOTrainer"]
