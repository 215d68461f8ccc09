"""TRL's ``trl.trainer`` import paths: ``from posttrain.trainer import DPOTrainer``,
``from posttrain.trainer.utils import selective_log_softmax``, ``from posttrain.trainer.dpo_trainer import
DataCollatorForPreference``, ``from posttrain.trainer.callbacks import SyncRefModelCallback``, ...

The implementations live in ``posttrain.trainers`` (one module per method), ``posttrain.data`` and
``posttrain.callbacks``; the modules of this package only re-export them under TRL's module names. Names are
resolved lazily, so importing the package costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "BEMACallback": "posttrain.trainer.callbacks",
    "LogCompletionsCallback": "posttrain.trainer.callbacks",
    "RichProgressCallback": "posttrain.trainer.callbacks",
    "SyncRefModelCallback": "posttrain.trainer.callbacks",
    "WeaveCallback": "posttrain.trainer.callbacks",
    "DistillationConfig": "posttrain.trainer.distillation_config",
    "DistillationTrainer": "posttrain.trainer.distillation_trainer",
    "DPOConfig": "posttrain.trainer.dpo_config",
    "DPOTrainer": "posttrain.trainer.dpo_trainer",
    "GRPOConfig": "posttrain.trainer.grpo_config",
    "GRPOTrainer": "posttrain.trainer.grpo_trainer",
    "KTOConfig": "posttrain.trainer.kto_config",
    "KTOTrainer": "posttrain.trainer.kto_trainer",
    "ModelConfig": "posttrain.trainer.model_config",
    "RewardConfig": "posttrain.trainer.reward_config",
    "RewardTrainer": "posttrain.trainer.reward_trainer",
    "RLOOConfig": "posttrain.trainer.rloo_config",
    "RLOOTrainer": "posttrain.trainer.rloo_trainer",
    "SFTConfig": "posttrain.trainer.sft_config",
    "SFTTrainer": "posttrain.trainer.sft_trainer",
    "disable_dropout_in_model": "posttrain.trainer.utils",
    "get_peft_config": "posttrain.trainer.utils",
    "get_quantization_config": "posttrain.trainer.utils",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'posttrain.trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
