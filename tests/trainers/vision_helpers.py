"""Shared pieces of the vision-language preference tests: solid-colour images with their names, and a fast config."""

from __future__ import annotations

from typing import Any

from PIL import Image
from trainer_helpers import fast_config

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}


def color_rows(column: str = "images") -> list[tuple[int, str, str, Any]]:
    """``(index, colour name, a wrong colour name, image value)`` per colour; ``column`` "images" wraps the image."""
    names = list(COLORS)
    rows = []
    for i, (name, rgb) in enumerate(COLORS.items()):
        image = Image.new("RGB", (20, 24), rgb)
        rows.append((i, name, names[(i + 1) % len(names)], [image] if column == "images" else image))
    return rows


def vision_config(config_cls: type, tmp_path, **overrides) -> Any:
    """Two steps of batch 2 at a high learning rate, ``max_length=64`` (the tiny VLM's images are 4 tokens)."""
    values = dict(max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, seed=0, max_length=64)
    values.update(overrides)
    return fast_config(config_cls, tmp_path, dataloader_pin_memory=False, **values)
