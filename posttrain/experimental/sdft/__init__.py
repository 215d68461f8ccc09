"""Self-Distilled Fine-Tuning (TRL's ``trl.experimental.sdft``): ``SDFTConfig`` / ``SDFTTrainer``."""

from posttrain.experimental.sdft.sdft_config import SDFTConfig
from posttrain.experimental.sdft.sdft_trainer import SDFTTrainer

__all__ = ["SDFTConfig", "SDFTTrainer"]
