"""Image-only processors for the vision-language families whose transformers processor insists on a video processor.

In transformers 5, ``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor`` and ``SmolVLMProcessor`` take a ``video_processor``
argument that must be a video processor instance, and every video processor requires torchvision, which PyPI does
not ship for the CPU torch this project pins. For image-only training (all of GRPO/RLOO/SFT/DPO's VLM paths) the
video half is never used, so these subclasses drop it the way transformers itself defines a processor's parts: a
``ProcessorMixin``'s sub-processors are the modality arguments of its ``__init__`` signature
(``ProcessorMixin.get_attributes``). The subclasses keep the parent's ``__call__`` (image placeholders expanded,
``mm_token_type_ids`` returned), save as ``processor_config.json`` with their own ``processor_class`` and load back
through ``AutoProcessor.from_pretrained`` once this module is imported (posttrain's loaders import it), because they
are registered in transformers' processor mapping under a name key of their own, never over a transformers config.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

__all__ = ["ImageOnlyQwen2_5_VLProcessor", "ImageOnlyQwen2VLProcessor"]


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with an image processor and a tokenizer only (no video processor, so no torchvision)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kwargs)

    def __call__(self, images: Any = None, text: Any = None, videos: Any = None, **kwargs: Any):
        _refuse_videos(self, videos)
        return super().__call__(images=images, text=text, **kwargs)


class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` with an image processor and a tokenizer only (no video processor, so no torchvision)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kwargs)

    def __call__(self, images: Any = None, text: Any = None, videos: Any = None, **kwargs: Any):
        _refuse_videos(self, videos)
        return super().__call__(images=images, text=text, **kwargs)


def _refuse_videos(processor: Any, videos: Any) -> None:
    if videos is not None:
        raise ValueError(
            f"{type(processor).__name__} processes images only (videos need a torchvision video processor); pass "
            "images, or use transformers' processor of this model with torchvision installed for videos."
        )


for _cls in (ImageOnlyQwen2VLProcessor, ImageOnlyQwen2_5_VLProcessor):
    # a string key (not a config class): AutoProcessor finds the class by the `processor_class` name saved with it,
    # and no transformers config is remapped
    PROCESSOR_MAPPING.register(f"posttrain-{_cls.__name__}", _cls, exist_ok=True)
