"""TRL's ``trl.trainer.sft_trainer``: ``SFTTrainer`` (:mod:`posttrain.trainers.sft`) and its collators (:mod:`posttrain.data`)."""

from posttrain.data.collators import DataCollatorForLanguageModeling
from posttrain.data.vision_collators import DataCollatorForVisionLanguageModeling
from posttrain.trainers.sft import SFTTrainer

__all__ = ["DataCollatorForLanguageModeling", "DataCollatorForVisionLanguageModeling", "SFTTrainer"]
