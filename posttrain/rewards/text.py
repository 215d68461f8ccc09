"""Reading the text out of a completion, whatever its dataset format.

Reward functions receive standard completions (``str``) or conversational ones (a list of message dicts, normally
``[{"role": "assistant", "content": ...}]``; with tools, the list also holds tool messages and later assistant
turns). Message ``content`` may be ``None`` (a pure tool call) or a list of content blocks
(``[{"type": "text", "text": ...}]``).
"""

from __future__ import annotations

from typing import Any, Literal


def message_content(message: Any) -> str:
    """The text of one message dict: ``content`` as a string, text blocks joined, ``None`` as ``""``."""
    if not isinstance(message, dict):
        raise TypeError(
            f"Expected a message dict like {{'role': 'assistant', 'content': '...'}}, got {type(message).__name__}: "
            f"{message!r:.200}."
        )
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            block.get("text", "") if isinstance(block, dict) else str(block)
            for block in content
            if not isinstance(block, dict) or block.get("type", "text") == "text"
        )
    return str(content)


def completion_text(completion: Any, *, which: Literal["first", "last_assistant"] = "first") -> str:
    """The text of one completion.

    Args:
        completion: A string (standard format), a message dict, or a list of messages (conversational format).
        which: For a list of messages: ``"first"`` reads ``completion[0]["content"]`` exactly as TRL's built-in
            rewards do; ``"last_assistant"`` reads the last assistant message (the final answer after tool calls).

    Raises:
        TypeError: for anything that is not a string, a message dict, or a list of message dicts.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return message_content(completion)
    if isinstance(completion, (list, tuple)):
        if not completion:
            return ""
        if which == "last_assistant":
            for message in reversed(completion):
                if isinstance(message, dict) and message.get("role", "assistant") == "assistant":
                    return message_content(message)
            return ""
        return message_content(completion[0])
    raise TypeError(
        f"A completion must be a string (standard format) or a list of messages (conversational format), got "
        f"{type(completion).__name__}: {completion!r:.200}."
    )


def completion_texts(completions: list, *, which: Literal["first", "last_assistant"] = "first") -> list[str]:
    """:func:`completion_text` for every completion of a batch."""
    return [completion_text(c, which=which) for c in completions]
