"""CPO (Contrastive Preference Optimization) and its SimPO / CPO-SimPO / AlphaPO variants (TRL's
``trl.experimental.cpo``)."""

from posttrain.experimental.cpo.cpo_config import CPOConfig
from posttrain.experimental.cpo.cpo_trainer import CPOTrainer

__all__ = ["CPOConfig", "CPOTrainer"]
