"""Public names of the data layer: lazy ``posttrain.data``, TRL-named re-export modules."""

import subprocess
import sys

import pytest

import posttrain.chat_template_utils as chat_template_utils
import posttrain.data as data
import posttrain.data_utils as data_utils

TRL_DATA_UTILS = [
    "apply_chat_template",
    "extract_prompt",
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
TRL_CHAT_TEMPLATE_UTILS = [
    "add_response_schema",
    "clone_chat_template",
    "get_training_chat_template",
    "has_generation_markers",
    "is_chat_template_prefix_preserving",
    "is_chat_template_stop_token_trained",
    "parse_response",
    "supports_tool_calling",
]


def test_trl_names_are_exported():
    for name in TRL_DATA_UTILS:
        assert callable(getattr(data_utils, name)), name
    for name in TRL_CHAT_TEMPLATE_UTILS:
        assert callable(getattr(chat_template_utils, name)), name


def test_lazy_package_resolves_every_name():
    for name in data.__all__:
        assert getattr(data, name) is not None
    assert data.pack_dataset is data_utils.pack_dataset
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        data.nope  # noqa: B018


def test_import_is_cheap():
    code = (
        "import sys, posttrain.data, posttrain.data.formats, posttrain.data.tokenization;"
        "print(sorted(m for m in ('torch', 'datasets', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
