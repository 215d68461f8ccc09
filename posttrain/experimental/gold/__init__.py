"""General Online Logit Distillation (TRL's ``trl.experimental.gold``): distillation across tokenizers."""

from posttrain.experimental.gold.gold_config import GOLDConfig
from posttrain.experimental.gold.gold_trainer import GOLDTrainer

__all__ = ["GOLDConfig", "GOLDTrainer"]
