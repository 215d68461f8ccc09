"""TRL's ``trl.trainer.dpo_trainer``: ``DPOTrainer`` (:mod:`posttrain.trainers.dpo`) and its collators (:mod:`posttrain.data`)."""

from posttrain.data.collators import DataCollatorForPreference
from posttrain.data.vision_collators import DataCollatorForVisionPreference
from posttrain.trainers.dpo import DPOTrainer

__all__ = ["DPOTrainer", "DataCollatorForPreference", "DataCollatorForVisionPreference"]
