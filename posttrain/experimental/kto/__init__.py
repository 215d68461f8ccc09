"""Deprecated path of ``KTOConfig`` / ``KTOTrainer`` (TRL's ``trl.experimental.kto``).

Both are stable: ``from posttrain import KTOConfig, KTOTrainer``. Building them from here works as from there and
warns ``FutureWarning``, as TRL 1.16 does.
"""

from posttrain.experimental._promoted import promoted
from posttrain.trainers.kto import KTOConfig as _KTOConfig
from posttrain.trainers.kto import KTOTrainer as _KTOTrainer

KTOConfig, KTOTrainer = promoted(_KTOConfig, _KTOTrainer, "kto")

__all__ = ["KTOConfig", "KTOTrainer"]
