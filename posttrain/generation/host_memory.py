"""Give the C heap's free pages back to the OS after a generation (glibc ``malloc_trim``), lowering the peak RSS.

A decode step's vocabulary-sized buffers (logits, probabilities, log-sum-exp: a few ``(R, V)`` tensors) are freed
every step, but glibc keeps the freed blocks in its heap once its dynamic mmap threshold has grown, so they stay
resident while the training forward and backward allocate on top of them. ``malloc_trim(0)`` releases them; it is
local to this call (no allocator settings change for the user's process) and a no-op off glibc.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys
from collections.abc import Callable

__all__ = ["release_freed_host_memory"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` or None (other C libraries, other systems, no symbol)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_host_memory() -> bool:
    """Return freed heap memory to the OS (``malloc_trim(0)``); True if glibc did it, False where unavailable."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
