"""Reusable float32 scratch buffers handed out as contiguous views, so a loop over chunks or decode steps does not
allocate a fresh large tensor per iteration (fresh ones, interleaved with small long-lived tensors, fragment the
C heap on CPU and raise the resident memory)."""

from __future__ import annotations

import torch

__all__ = ["ScratchBuffers"]


class ScratchBuffers:
    """``count`` float32 buffers of ``numel`` elements each; ``view(i, rows, cols)`` is a contiguous ``(rows, cols)``
    view of buffer ``i`` (``rows × cols ≤ numel``)."""

    def __init__(self, count: int, numel: int, device: torch.device):
        self._flat = [torch.empty(numel, dtype=torch.float32, device=device) for _ in range(count)]

    def view(self, i: int, rows: int, cols: int) -> torch.Tensor:
        return self._flat[i][: rows * cols].view(rows, cols)
