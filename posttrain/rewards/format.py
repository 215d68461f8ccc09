"""Format rewards: ``think_format_reward``."""

from __future__ import annotations

import re
from typing import Any

from posttrain.rewards.text import completion_texts

# Starts with "<think>", contains no second "<think>", and closes the block; anything may follow the block.
_THINK_PATTERN = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion starts with exactly one ``<think>...</think>`` block, else 0.0.

    Args:
        completions: Standard (``str``) or conversational completions (``completion[0]["content"]`` is read).
        **kwargs: Other columns and trainer arguments, ignored.

    Example:
        >>> think_format_reward(["<think>\\nreasoning\\n</think>\\nanswer", "<think>\\nno end\\nanswer"])
        [1.0, 0.0]
    """
    return [1.0 if _THINK_PATTERN.match(text) else 0.0 for text in completion_texts(completions)]
