"""TRL's ``trl.trainer.kto_trainer``: ``KTOTrainer`` (:mod:`posttrain.trainers.kto`) and its collators (:mod:`posttrain.data`)."""

from posttrain.data.collators import DataCollatorForUnpairedPreference
from posttrain.data.vision_collators import DataCollatorForVisionUnpairedPreference
from posttrain.trainers.kto import KTOTrainer

__all__ = ["DataCollatorForUnpairedPreference", "DataCollatorForVisionUnpairedPreference", "KTOTrainer"]
