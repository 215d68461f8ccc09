"""posttrain: post-training for language models with TRL's API.

Public names are imported lazily (PEP 562), so ``import posttrain`` and ``posttrain --help`` stay fast: torch and
transformers load only when a trainer, config or utility is first touched.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from posttrain._version import __version__

# public name -> module that defines it
_LAZY: dict[str, str] = {
    # trainers and configs
    "SFTConfig": "posttrain.trainers.sft",
    "SFTTrainer": "posttrain.trainers.sft",
    "DPOConfig": "posttrain.trainers.dpo",
    "DPOTrainer": "posttrain.trainers.dpo",
    "KTOConfig": "posttrain.trainers.kto",
    "KTOTrainer": "posttrain.trainers.kto",
    "RewardConfig": "posttrain.trainers.reward",
    "RewardTrainer": "posttrain.trainers.reward",
    "GRPOConfig": "posttrain.trainers.grpo",
    "GRPOTrainer": "posttrain.trainers.grpo",
    "RLOOConfig": "posttrain.trainers.rloo",
    "RLOOTrainer": "posttrain.trainers.rloo",
    "DistillationConfig": "posttrain.trainers.distillation",
    "DistillationTrainer": "posttrain.trainers.distillation",
    # stable since TRL 1.18 (still importable from posttrain.experimental.async_grpo)
    "AsyncGRPOConfig": "posttrain.experimental.async_grpo",
    "AsyncGRPOTrainer": "posttrain.experimental.async_grpo",
    # data utilities (TRL's trl.data_utils names)
    "apply_chat_template": "posttrain.data_utils",
    "maybe_apply_chat_template": "posttrain.data_utils",
    "extract_prompt": "posttrain.data_utils",
    "maybe_extract_prompt": "posttrain.data_utils",
    "is_conversational": "posttrain.data_utils",
    "is_conversational_from_value": "posttrain.data_utils",
    "maybe_convert_to_chatml": "posttrain.data_utils",
    "unpair_preference_dataset": "posttrain.data_utils",
    "maybe_unpair_preference_dataset": "posttrain.data_utils",
    "prepare_multimodal_messages": "posttrain.data_utils",
    "prepare_multimodal_messages_vllm": "posttrain.data_utils",
    "pack_dataset": "posttrain.data_utils",
    "truncate_dataset": "posttrain.data_utils",
    "clone_chat_template": "posttrain.chat_template_utils",
    "get_training_chat_template": "posttrain.chat_template_utils",
    "supports_tool_calling": "posttrain.chat_template_utils",
    "add_response_schema": "posttrain.chat_template_utils",
    "parse_response": "posttrain.chat_template_utils",
    # command line / scripts (trl.scripts names)
    "TrlParser": "posttrain.cli.parser",
    "ModelConfig": "posttrain.cli.configs",
    "ScriptArguments": "posttrain.cli.configs",
    "get_peft_config": "posttrain.cli.configs",
    "get_quantization_config": "posttrain.cli.configs",
    "DatasetConfig": "posttrain.data.loading",
    "DatasetMixtureConfig": "posttrain.data.loading",
    "get_dataset": "posttrain.data.loading",
    "init_zero_verbose": "posttrain.scripts.utils",
    # callbacks
    "RichProgressCallback": "posttrain.callbacks",
    "LogCompletionsCallback": "posttrain.callbacks",
    "SyncRefModelCallback": "posttrain.callbacks",
    "BEMACallback": "posttrain.callbacks",
    "WeaveCallback": "posttrain.callbacks",
    # models
    "create_reference_model": "posttrain.models.peft_utils",
    "disable_dropout_in_model": "posttrain.models.loading",
}

# names TRL made stable that posttrain keeps under posttrain.experimental: no experimental warning from here
_STABLE_FROM_EXPERIMENTAL = {"AsyncGRPOConfig", "AsyncGRPOTrainer"}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        if name == "DataCollatorForCompletionOnlyLM":  # TRL <= 0.19's collator, built over posttrain.legacy
            return importlib.import_module("posttrain._legacy_collator").DataCollatorForCompletionOnlyLM
        legacy = importlib.import_module("posttrain.legacy")  # older TRL's names (setup_chat_format, ORPOConfig)
        if name in legacy.TOP_LEVEL:
            return getattr(legacy, name)  # not cached: each first use of an old name warns once
        raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
    if name in _STABLE_FROM_EXPERIMENTAL:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="You are importing from 'posttrain.experimental'")
            value = getattr(importlib.import_module(module_name), name)
    else:
        value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
