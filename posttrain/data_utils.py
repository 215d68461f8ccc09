"""TRL's ``trl.data_utils`` names: ``from posttrain.data_utils import apply_chat_template, ...``.

Implementations live in ``posttrain.data`` (``utils``, ``packing``, ``multimodal``); this module only re-exports them.
"""

from posttrain.data.multimodal import prepare_multimodal_messages, prepare_multimodal_messages_vllm
from posttrain.data.packing import pack_dataset
from posttrain.data.utils import (
    apply_chat_template,
    common_prefix_length,
    extract_prompt,
    get_dataset_column_names,
    is_conversational,
    is_conversational_from_value,
    maybe_apply_chat_template,
    maybe_convert_to_chatml,
    maybe_extract_prompt,
    maybe_unpair_preference_dataset,
    remove_none_values,
    truncate_dataset,
    unpair_preference_dataset,
)

__all__ = [
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
    "pack_dataset",
    "prepare_multimodal_messages",
    "prepare_multimodal_messages_vllm",
    "remove_none_values",
    "truncate_dataset",
    "unpair_preference_dataset",
]
