"""Images on the generation wire: vLLM's multimodal token prompt, ``{"prompt_token_ids": [...], "multi_modal_data":
{"image": [...]}}``, with each image as a base64 data URL (``data:image/png;base64,...``) so it travels in JSON.

The trainer encodes (:func:`encode_image`: PNG, lossless, so the server's image processor sees the very pixels the
trainer's did and a seeded request samples what in-process generation samples); ``posttrain serve`` decodes
(:func:`decode_image`: a data URL or bare base64 of any format PIL reads). :func:`multimodal_prompt` builds one
prompt entry.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

__all__ = ["decode_image", "encode_image", "multimodal_prompt"]


def encode_image(image: Any) -> str:
    """``image`` (a PIL image, PNG/JPEG bytes, or an existing data URL / base64 string) as a data URL."""
    if isinstance(image, str):
        return image if image.startswith("data:") else f"data:image/png;base64,{image}"
    if isinstance(image, (bytes, bytearray)):
        return "data:image/png;base64," + base64.b64encode(bytes(image)).decode("ascii")
    if isinstance(image, dict) and ("bytes" in image or "path" in image):  # a datasets Image() feature not decoded
        if image.get("bytes") is not None:
            return encode_image(image["bytes"])
        with open(image["path"], "rb") as f:
            return encode_image(f.read())
    save = getattr(image, "save", None)
    if save is None:
        raise TypeError(
            f"Cannot send an image of type {type(image).__name__} to the generation server: give PIL images, image "
            "bytes, or base64 data URLs."
        )
    buffer = io.BytesIO()
    save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(data: Any) -> Any:
    """A PIL image from a data URL (``data:image/<fmt>;base64,<data>``) or bare base64; ValueError saying why not."""
    from PIL import Image

    if not isinstance(data, str):
        raise ValueError(f"expected a base64 data URL string, got {type(data).__name__}")
    payload = data
    if data.startswith("data:"):
        header, sep, payload = data.partition(",")
        if not sep or ";base64" not in header:
            raise ValueError("a data URL must look like data:image/png;base64,<data>")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"not valid base64 ({err})") from None
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except Exception as err:  # PIL raises several types (UnidentifiedImageError, OSError, DecompressionBombError)
        raise ValueError(f"not an image PIL can read ({type(err).__name__}: {err})") from None
    return image


def multimodal_prompt(prompt_ids: list[int], images: list[Any] | None) -> dict[str, Any]:
    """One vLLM token prompt: ``{"prompt_token_ids": ids}`` plus ``multi_modal_data.image`` when there are images."""
    entry: dict[str, Any] = {"prompt_token_ids": [int(t) for t in prompt_ids]}
    if images:
        entry["multi_modal_data"] = {"image": [encode_image(image) for image in images]}
    return entry
