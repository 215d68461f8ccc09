"""TRL's ``trl.chat_template_utils`` names: ``from posttrain.chat_template_utils import clone_chat_template, ...``.

Implementations live in ``posttrain.data.chat_templates`` and ``posttrain.data.response_parsing``; this module only
re-exports them.
"""

from posttrain.data.chat_templates import (
    CHAT_TEMPLATE_FAMILIES,
    clone_chat_template,
    detect_chat_template_family,
    get_training_chat_template,
    has_generation_markers,
    is_chat_template_prefix_preserving,
    is_chat_template_stop_token_trained,
    supports_tool_calling,
)
from posttrain.data.response_parsing import RESPONSE_TEMPLATES, add_response_schema, parse_response

__all__ = [
    "CHAT_TEMPLATE_FAMILIES",
    "RESPONSE_TEMPLATES",
    "add_response_schema",
    "clone_chat_template",
    "detect_chat_template_family",
    "get_training_chat_template",
    "has_generation_markers",
    "is_chat_template_prefix_preserving",
    "is_chat_template_stop_token_trained",
    "parse_response",
    "supports_tool_calling",
]
