"""GMPO, Geometric-Mean Policy Optimization (TRL's ``trl.experimental.gmpo``): GRPO with the geometric mean of
the log-space-clipped token ratios per sequence."""

from posttrain.experimental.gmpo.gmpo_config import GMPOConfig
from posttrain.experimental.gmpo.gmpo_trainer import GMPOTrainer

__all__ = ["GMPOConfig", "GMPOTrainer"]
