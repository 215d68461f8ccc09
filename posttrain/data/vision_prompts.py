"""Vision-language prompts for online RL (GRPO, RLOO): images into the prompts, the processor's inputs per row.

TRL's GRPO and RLOO take a ``prompt`` column plus ``image`` (one image) or ``images`` (a list) and, for a batch with
images, (1) put each row's images into its conversational prompt (:func:`prepare_multimodal_messages`), (2) render the
prompts with the processor's chat template, (3) run the processor on text and images for the prompt ids (image
placeholders expanded to the model's image tokens) and the vision inputs (``pixel_values``, ``image_grid_thw``,
``image_sizes``, ``pixel_attention_mask``, ``token_type_ids``, ...), which go to generation and to every log-prob
forward.

posttrain keeps those vision inputs *per row* (:func:`encode_vision_prompts`): each distinct prompt is processed once,
its G completions share the result, and a micro-batch's model inputs are assembled from its rows' at forward time
(:func:`collate_vision_inputs`). So the rollout buffer can shuffle and split the batch by rows and the per-token
fields follow the prompt padding whatever the micro-batch, without TRL's per-architecture slicing by image counts.
Rows with different image counts and sizes, and text-only rows, mix freely in one batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.data.multimodal import prepare_multimodal_messages
from posttrain.data.utils import is_conversational

__all__ = [
    "PER_TOKEN_VISION_KEYS",
    "check_vision_rows",
    "check_tool_image_inputs",
    "check_vision_setup",
    "collate_vision_inputs",
    "encode_vision_prompts",
    "has_vision_inputs",
    "row_images",
]

# Processor outputs with one value per prompt token (left-padded with the prompt, extended with 0 over the
# completion); every other non-text output describes the images and is concatenated over rows.
PER_TOKEN_VISION_KEYS = ("token_type_ids", "mm_token_type_ids")
_TEXT_KEYS = ("input_ids", "attention_mask")


def row_images(row: Mapping[str, Any]) -> list[Any] | None:
    """The row's images as TRL reads them: ``images`` (a list; ``None`` or ``[]`` = none) or ``image`` (one image;
    ``None`` = none); None for a text-only row."""
    if "images" in row:
        images = row["images"]
        if images is None:
            return None
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
            images = [images]  # a single image in an `images` column
        return list(images) or None
    if "image" in row:
        return None if row["image"] is None else [row["image"]]
    return None


def has_vision_inputs(vision_inputs: Sequence[Mapping[str, Any]] | None) -> bool:
    """Whether any row of ``vision_inputs`` carries a model input."""
    return bool(vision_inputs) and any(bool(v) for v in vision_inputs)


def _image_processor(processing_class: Any) -> Any:
    return getattr(processing_class, "image_processor", None)


def check_vision_setup(processing_class: Any, model: Any, trainer_name: str, arg_name: str = "train_dataset") -> None:
    """Raise ValueError before training when a dataset with images meets a setup that cannot read them: a text-only
    model (no ``vision_config``), a tokenizer instead of a processor with an image processor, or a processor without
    a chat template (vision-language prompts are conversational and rendered with it)."""
    config = getattr(model, "config", None)
    model_name = type(model).__name__
    if config is not None and getattr(config, "vision_config", None) is None:
        raise ValueError(
            f"{arg_name} has images (an `image`/`images` column) but the model {model_name} is a text-only model (its "
            f"config has no vision_config): {trainer_name} would have nowhere to put them. Train a vision-language "
            "model (e.g. LLaVA, Qwen2-VL, Gemma 3, SmolVLM), or drop the image column to train on the text alone."
        )
    if _image_processor(processing_class) is None:
        raise ValueError(
            f"{arg_name} has images but the processing class is a {type(processing_class).__name__} without an "
            "image processor. Pass the model's processor (AutoProcessor.from_pretrained(...)) as processing_class."
        )
    if not getattr(processing_class, "chat_template", None) and not getattr(
        getattr(processing_class, "tokenizer", None), "chat_template", None
    ):
        raise ValueError(
            f"The processor {type(processing_class).__name__} has no chat template, which {trainer_name} needs to render "
            "vision-language prompts (their image blocks become the model's image placeholders). Set "
            "processor.chat_template (and save it with the processor)."
        )


def check_vision_rows(dataset: Any, arg_name: str = "train_dataset", max_rows: int = 256) -> None:
    """Check the first ``max_rows`` rows of a sized dataset before training: images need a conversational prompt,
    and a prompt's own ``{"type": "image"}`` placeholders must match the row's images (streams are checked as their
    rows arrive)."""
    if not hasattr(dataset, "__len__"):
        return
    for index in range(min(len(dataset), max_rows)):
        row = dataset[index]
        prepare_vision_prompt(row, index, arg_name)


def prepare_vision_prompt(row: Mapping[str, Any], index: int, arg_name: str = "train_dataset") -> Any:
    """The row's prompt with its images placed in it (TRL's :func:`prepare_multimodal_messages`); raises ValueError
    naming the row for an image on a standard (text) prompt or placeholders that do not match the images."""
    prompt = row.get("prompt")
    images = row_images(row)
    if not is_conversational({"prompt": prompt}):
        if images:
            raise ValueError(
                f"{arg_name} row {index} has images but a standard (text) prompt. Multimodal training requires "
                "conversational prompts: give the raw messages ([{'role': 'user', 'content': ...}]) and let the "
                "trainer apply the processor's chat template (which places the image tokens)."
            )
        return prompt
    try:
        return prepare_multimodal_messages(prompt, images=images or [])
    except ValueError as error:
        raise ValueError(f"{arg_name} row {index}: {error}") from None


def _same_row(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two rows have the same prompt and images (a GRPO group: one row read G times)."""
    if a is b:
        return True
    try:
        return bool(a.get("prompt") == b.get("prompt")) and bool(row_images(a) == row_images(b))
    except (TypeError, ValueError):
        return False


def encode_vision_prompts(
    rows: Sequence[Mapping[str, Any]],
    processor: Any,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Any] | None = None,
) -> tuple[list[Any], list[str], list[list[int]], list[dict[str, torch.Tensor]]]:
    """Multimodal prompts, their text, prompt ids and per-row vision inputs for a batch of rows with images.

    Each run of identical rows (a group: the same prompt and images, G times) is processed once and its rows share
    the prompt ids' values and the very same vision-input dict. Returns ``(prompts, texts, prompt_ids,
    vision_inputs)``: the prompts with their images placed (what reward functions receive, as in TRL), the chat
    template's rendering (with the generation prompt), the processor's ids (image placeholders expanded) and, per
    row, the processor's other outputs with the batch dimension dropped for per-token keys (``{}`` for a text-only
    row). ``tools`` gives each row's tool schemas (agent training; a row's own ``tools`` column wins).
    """
    kwargs = dict(chat_template_kwargs or {})
    prompts: list[Any] = []
    texts: list[str] = []
    ids: list[list[int]] = []
    inputs: list[dict[str, torch.Tensor]] = []
    for index, row in enumerate(rows):
        row_tools = tools[index] if tools is not None else None
        if index and _same_row(row, rows[index - 1]) and (tools is None or row_tools == tools[index - 1]):
            prompts.append(prompts[-1])
            texts.append(texts[-1])
            ids.append(list(ids[-1]))
            inputs.append(inputs[-1])
            continue
        prompt = prepare_vision_prompt(row, index, "batch")
        text = (
            _render(processor, row, prompt, kwargs, index, row_tools)
            if is_conversational({"prompt": prompt})
            else prompt
        )
        images = row_images(row)
        processed = processor(
            text=[text], images=[images] if images else None, add_special_tokens=False, return_tensors="pt"
        )
        row_inputs = {}
        for key, value in processed.items():
            if key in _TEXT_KEYS or not isinstance(value, torch.Tensor):
                continue
            row_inputs[key] = value[0] if key in PER_TOKEN_VISION_KEYS else value
        if not images:  # a text-only row: only per-token fields (all zero) could be there; none are needed
            row_inputs = {}
        prompts.append(prompt)
        texts.append(text)
        ids.append([int(t) for t in processed["input_ids"][0].tolist()])
        inputs.append(row_inputs)
    return prompts, texts, ids, inputs


def _render(
    processor: Any, row: Mapping[str, Any], prompt: list[dict[str, Any]], kwargs: dict, index: int, tools: Any = None
) -> str:
    """The prompt through the processor's chat template as text prompts are rendered (``tokenize_prompt``): the
    row's own ``tools`` / ``chat_template_kwargs`` columns honoured, a new assistant turn after a user/tool message
    or the final assistant message continued, template errors naming the row."""
    from posttrain.data.chat_templates import prompt_generation_flags
    from posttrain.data.tokenization import _RowContext

    context = _RowContext(row, processor, tools, kwargs, index)
    add_generation_prompt, continue_final = prompt_generation_flags(prompt, row=index)
    text = context.render_text(
        prompt, column="prompt", add_generation_prompt=add_generation_prompt, continue_final_message=continue_final
    )
    return text[0] if isinstance(text, list) else text


def check_tool_image_inputs(vision_inputs: Sequence[Mapping[str, Any]], prompt_ids: Sequence[Sequence[int]]) -> None:
    """Raise ValueError when a tool answered with images for a model whose vision inputs carry per-token types
    (Qwen2-VL's ``mm_token_type_ids``, Gemma 3's ``token_type_ids``): the training forward places per-token values
    over the prompt only, so such completions cannot be scored yet. Image-feature models (LLaVA, LLaVA-NeXT,
    Idefics3/SmolVLM) need only the images in order, which the rollouts' vision inputs hold."""
    for index, (row, ids) in enumerate(zip(vision_inputs, prompt_ids)):
        for key in PER_TOKEN_VISION_KEYS:
            if key in row and row[key].shape[0] > len(ids):
                raise ValueError(
                    f"A tool answered rollout {index} with images, and this model's vision inputs have per-token "
                    f"{key!r} (multimodal RoPE / token types), which posttrain's training forward sets over the "
                    "prompt only: multimodal tool responses train with image-feature models (LLaVA, LLaVA-NeXT, "
                    "Idefics3/SmolVLM) for now. Return text from the tool for this model."
                )


def collate_vision_inputs(
    vision_inputs: Sequence[Mapping[str, torch.Tensor]],
    prompt_width: int,
    completion_width: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Model inputs of a micro-batch from its rows' vision inputs (see :func:`encode_vision_prompts`).

    Image-level outputs (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ``pixel_attention_mask``, ...) are
    concatenated over the rows that have them, in row order (trailing dimensions zero-padded to the largest, as the
    processors pad a batch); per-token outputs become ``(B, prompt_width + completion_width)``: each row's values
    right-aligned in the left-padded prompt, 0 over padding, text-only rows and the completion. Floating-point
    values are cast to ``dtype`` (the model's) when given.
    """
    out: dict[str, torch.Tensor] = {}
    keys = sorted({key for row in vision_inputs for key in row})
    for key in keys:
        if key in PER_TOKEN_VISION_KEYS:
            first = next(row[key] for row in vision_inputs if key in row)
            values = torch.zeros((len(vision_inputs), prompt_width + completion_width), dtype=first.dtype)
            for i, row in enumerate(vision_inputs):
                if key in row:
                    row_values = row[key][-prompt_width:]
                    values[i, prompt_width - row_values.shape[0] : prompt_width] = row_values
            out[key] = values
            continue
        parts = [row[key] for row in vision_inputs if key in row]
        shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
        padded = []
        for part in parts:
            pad = []
            for d in reversed(range(1, part.dim())):
                pad.extend([0, shape[d - 1] - part.shape[d]])
            padded.append(torch.nn.functional.pad(part, pad) if any(pad) else part)
        out[key] = torch.cat(padded, dim=0)
    for key, value in out.items():
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        out[key] = value.to(device) if device is not None else value
    return out
