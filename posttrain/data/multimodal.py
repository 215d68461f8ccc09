"""TRL's multimodal message helpers: put images into chat messages for vision-language processors and vLLM.

``prepare_multimodal_messages(messages, images)`` turns every string ``content`` into structured blocks
(``[{"type": "text", "text": ...}]``), inserts one ``{"type": "image"}`` placeholder per image before the text of
the first user message whose content is a string, then fills the placeholders that hold no image yet, in order.
``prepare_multimodal_messages_vllm(messages)`` renames filled image blocks to vLLM's ``image_pil`` form.

Both return new containers (dicts and lists are copied all the way down) and never mutate their input; leaf values
such as images are shared, not copied, so a large ``PIL.Image`` is not duplicated per call. A placeholder whose
``image`` is ``None`` counts as unfilled: ``datasets`` stores content blocks as Arrow structs, which give every
block every key (``{"type": "image", "image": None, "text": None}``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

VALID_ROLES = ("system", "user", "assistant", "tool")


def _copy_structure(value: Any) -> Any:
    """Copy dicts and lists recursively, sharing every other value (images, strings, numbers)."""
    if isinstance(value, Mapping):
        return {key: _copy_structure(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy_structure(item) for item in value]
    return value


def _check_message(index: int, message: Any) -> str:
    """The message's role, after checking it is a dict with a valid ``role`` and a ``content`` key."""
    if not isinstance(message, Mapping):
        raise TypeError(f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}.")
    role = message.get("role")
    if role not in VALID_ROLES:
        raise ValueError(
            f"messages[{index}] has invalid role {role!r}; expected one of {', '.join(VALID_ROLES)}. "
            "Convert ShareGPT-style turns first (maybe_convert_to_chatml maps human/gpt to user/assistant)."
        )
    if "content" not in message:
        raise ValueError(f"messages[{index}] (role {role!r}) has no 'content' key; add one (a string or a list).")
    return role


def _is_unfilled_image(block: Any) -> bool:
    return isinstance(block, Mapping) and block.get("type") == "image" and block.get("image") is None


def prepare_multimodal_messages(
    messages: Sequence[Mapping[str, Any]], images: Sequence[Any] | None = None
) -> list[dict[str, Any]]:
    """Structured multimodal copy of ``messages`` with ``images`` placed in the image placeholders (TRL semantics).

    Args:
        messages: Chat messages with ``role`` (``system``, ``user``, ``assistant`` or ``tool``) and ``content``
            (a string, or a list of blocks such as ``{"type": "text", "text": ...}`` / ``{"type": "image"}``).
        images: Images (``PIL.Image`` or any object the processor accepts) for the placeholders, in order.

    Returns:
        New messages whose string contents are ``[{"type": "text", "text": ...}]`` blocks; the first user message
        with string content gets ``len(images)`` ``{"type": "image"}`` blocks before its text, and every unfilled
        image block becomes ``{"type": "image", "image": <image>}``. Other contents (``None``, for an assistant
        turn that only calls tools) are kept as they are.

    Raises:
        ValueError: A message has an invalid role or no ``content``, or the number of unfilled image placeholders
            differs from ``len(images)``.

    Example:
        >>> prepare_multimodal_messages([{"role": "user", "content": "What is this?"}], images=["<img>"])
        [{'role': 'user', 'content': [{'type': 'image', 'image': '<img>'}, {'type': 'text', 'text': 'What is this?'}]}]
    """
    if images is None:
        images = []
    elif isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
        raise TypeError(
            f"images must be a list of images, got {type(images).__name__}; wrap a single image as [image]."
        )
    prepared = []
    placeholders_added = False
    for index, message in enumerate(messages):
        role = _check_message(index, message)
        message = _copy_structure(message)
        if isinstance(message["content"], str):
            blocks = [{"type": "text", "text": message["content"]}]
            if role == "user" and not placeholders_added:
                blocks = [{"type": "image"} for _ in images] + blocks
                placeholders_added = True
            message["content"] = blocks
        prepared.append(message)

    unfilled = [
        block
        for message in prepared
        if isinstance(message["content"], list)
        for block in message["content"]
        if _is_unfilled_image(block)
    ]
    if len(unfilled) != len(images):
        raise ValueError(
            f"Got {len(images)} image(s) but the messages have {len(unfilled)} image placeholder(s) to fill "
            '({"type": "image"} blocks without an image). Pass one image per placeholder, or give the first user '
            "message string content so that placeholders are inserted for you."
        )
    for block, image in zip(unfilled, images):
        block["image"] = image
    return prepared


def prepare_multimodal_messages_vllm(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy of ``messages`` with ``{"type": "image", "image": X}`` blocks turned into vLLM's
    ``{"type": "image_pil", "image_pil": X}`` (vLLM's chat API takes in-memory PIL images under that key).

    Raises:
        ValueError: An image block holds no image yet (call ``prepare_multimodal_messages`` with the images first).

    Example:
        >>> prepare_multimodal_messages_vllm([{"role": "user", "content": [{"type": "image", "image": "<img>"}]}])
        [{'role': 'user', 'content': [{'type': 'image_pil', 'image_pil': '<img>'}]}]
    """
    prepared = _copy_structure(list(messages))
    for index, message in enumerate(prepared):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for position, block in enumerate(content):
            if not (isinstance(block, Mapping) and block.get("type") == "image"):
                continue
            if block.get("image") is None:
                raise ValueError(
                    f"messages[{index}].content[{position}] is an image placeholder without an image; fill it "
                    "first with prepare_multimodal_messages(messages, images)."
                )
            image = block.pop("image")
            block["type"] = "image_pil"
            block["image_pil"] = image
    return prepared
