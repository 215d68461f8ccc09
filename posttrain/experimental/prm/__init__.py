"""Process reward models: a token classifier labelling each reasoning step (TRL's ``trl.experimental.prm``)."""

from posttrain.experimental.prm.prm_config import PRMConfig
from posttrain.experimental.prm.prm_trainer import PRMTrainer, compute_accuracy

__all__ = ["PRMConfig", "PRMTrainer", "compute_accuracy"]
