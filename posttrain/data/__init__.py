"""The data layer every trainer uses: formats, TRL data utils, chat templates, tokenization, packing, collators,
dataset loading.

Names are imported lazily (PEP 562) so ``import posttrain.data`` stays cheap; ``datasets`` and ``transformers`` are
imported only by the functions that need them.

- ``formats``: dataset types/formats, ``detect_format``, ``validate_format``, ``DataFormatError``.
- ``utils``: TRL's ``trl.data_utils`` (``apply_chat_template``, ``extract_prompt``, ``unpair_preference_dataset``...).
- ``chat_templates``: TRL's ``trl.chat_template_utils`` and rendering helpers.
- ``tokenization``: ``tokenize_lm``/``tokenize_prompt_completion``/``tokenize_preference``/... and ``build_labels``.
- ``packing``: ``pack_dataset`` (bfd, bfd_split, wrapped) and position-id helpers.
- ``collators``: ``DataCollatorFor*`` and ``pad``.
- ``loading``: ``load_dataset_from_spec``, ``DatasetConfig``, ``DatasetMixtureConfig``, ``get_dataset``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "formats": [
        "ALL_TYPES",
        "DataFormatError",
        "DatasetFormat",
        "LANGUAGE_MODELING",
        "PREFERENCE",
        "PROMPT_COMPLETION",
        "PROMPT_ONLY",
        "STEPWISE_SUPERVISION",
        "TOKENIZED_LANGUAGE_MODELING",
        "TOKENIZED_PREFERENCE",
        "TOKENIZED_UNPAIRED_PREFERENCE",
        "UNPAIRED_PREFERENCE",
        "check_row",
        "detect_format",
        "example_rows",
        "validate_format",
    ],
    "utils": [
        "apply_chat_template",
        "common_prefix_length",
        "extract_prompt",
        "get_dataset_column_names",
        "is_conversational",
        "is_conversational_from_value",
        "maybe_apply_chat_template",
        "maybe_convert_to_chatml",
        "maybe_extract_prompt",
        "maybe_unpair_preference_dataset",
        "remove_none_values",
        "truncate_dataset",
        "unpair_preference_dataset",
    ],
    "vision_collators": [
        "DataCollatorForVisionLanguageModeling",
        "DataCollatorForVisionPreference",
        "DataCollatorForVisionUnpairedPreference",
    ],
    "multimodal": ["prepare_multimodal_messages", "prepare_multimodal_messages_vllm"],
    "response_parsing": ["RESPONSE_TEMPLATES", "add_response_schema", "parse_response"],
    "chat_templates": [
        "CHAT_TEMPLATE_FAMILIES",
        "apply_chat_template_path",
        "clone_chat_template",
        "detect_chat_template_family",
        "get_training_chat_template",
        "has_generation_markers",
        "is_chat_template_prefix_preserving",
        "is_chat_template_stop_token_trained",
        "render_chat",
        "supports_tool_calling",
        "validate_assistant_only_loss_template",
    ],
    "tokenization": [
        "IGNORE_INDEX",
        "build_labels",
        "map_with_row_index",
        "prompt_overflows",
        "tokenize_lm",
        "tokenize_preference",
        "tokenize_prompt",
        "tokenize_prompt_completion",
        "tokenize_reward_pair",
        "tokenize_unpaired",
        "truncate_sequence",
    ],
    "packing": [
        "PACKING_STRATEGIES",
        "best_fit_decreasing",
        "pack_dataset",
        "position_ids_from_seq_lengths",
        "seq_lengths_from_position_ids",
    ],
    "collators": [
        "DataCollatorForLanguageModeling",
        "DataCollatorForPreference",
        "DataCollatorForRewardPreference",
        "DataCollatorForUnpairedPreference",
        "block_diagonal_causal_mask",
        "pad",
    ],
    "loading": [
        "DatasetConfig",
        "DatasetMixtureConfig",
        "DatasetNotFoundError",
        "get_dataset",
        "load_dataset_from_spec",
    ],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'posttrain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"posttrain.data.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
