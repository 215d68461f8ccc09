"""TRL's ``trl.trainer.reward_trainer``: ``RewardTrainer`` (:mod:`posttrain.trainers.reward`) and its collator.

As in TRL, this module's ``DataCollatorForPreference`` is the reward-model collator (chosen and rejected rows
stacked into one batch, optional ``margin``): :class:`posttrain.data.collators.DataCollatorForRewardPreference`.
``posttrain.trainer.dpo_trainer.DataCollatorForPreference`` is the DPO one.
"""

from posttrain.data.collators import DataCollatorForRewardPreference as DataCollatorForPreference
from posttrain.trainers.reward import RewardTrainer

__all__ = ["DataCollatorForPreference", "RewardTrainer"]
