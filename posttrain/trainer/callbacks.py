"""TRL's ``trl.trainer.callbacks``: ``SyncRefModelCallback``, ``RichProgressCallback``, ``LogCompletionsCallback``,
``WeaveCallback`` and ``BEMACallback`` (all from :mod:`posttrain.callbacks`)."""

from __future__ import annotations

from typing import Any

from posttrain.callbacks import LogCompletionsCallback, RichProgressCallback, SyncRefModelCallback, WeaveCallback

__all__ = ["LogCompletionsCallback", "RichProgressCallback", "SyncRefModelCallback", "WeaveCallback"]


def __getattr__(name: str) -> Any:
    if name == "BEMACallback":
        import posttrain.callbacks

        return posttrain.callbacks.BEMACallback
    raise AttributeError(f"module 'posttrain.trainer.callbacks' has no attribute {name!r}")
