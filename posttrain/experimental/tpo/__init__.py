"""TPO: Triple Preference Optimization (TRL's ``trl.experimental.tpo``)."""

from posttrain.experimental.tpo.tpo_config import TPOConfig
from posttrain.experimental.tpo.tpo_trainer import DataCollatorForTriplePreference, TPOTrainer

__all__ = ["DataCollatorForTriplePreference", "TPOConfig", "TPOTrainer"]
