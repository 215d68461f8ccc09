"""A*-PO, Optimal Advantage Regression (TRL's ``trl.experimental.a2po``): V*(x) from reference samples, then one
on-policy sample per prompt regressed onto r − V*."""

from posttrain.experimental.a2po.a2po_config import A2POConfig
from posttrain.experimental.a2po.a2po_trainer import A2POTrainer

__all__ = ["A2POConfig", "A2POTrainer"]
