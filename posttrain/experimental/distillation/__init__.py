"""Deprecated path of ``DistillationConfig`` / ``DistillationTrainer`` (TRL's ``trl.experimental.distillation``).

Both are stable: ``from posttrain import DistillationConfig, DistillationTrainer``. Building them from here works
as from there and warns ``FutureWarning``, as TRL 1.16 does.
"""

from posttrain.experimental._promoted import promoted
from posttrain.trainers.distillation import DistillationConfig as _DistillationConfig
from posttrain.trainers.distillation import DistillationTrainer as _DistillationTrainer

DistillationConfig, DistillationTrainer = promoted(_DistillationConfig, _DistillationTrainer, "distillation")

__all__ = ["DistillationConfig", "DistillationTrainer"]
