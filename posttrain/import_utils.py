"""Optional-package probes under TRL's names (``trl.import_utils``): ``is_vllm_available()`` and friends.

Scripts written for TRL check optional backends with these before importing them (TRL's ``trl env`` script, reward
functions that need ``math_verify``, ...). Each answers whether the package can be imported here, without importing
it (``importlib.util.find_spec``); the versioned ones also compare the installed distribution's version.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from packaging.version import Version

__all__ = [
    "LIGER_KERNEL_MIN_VERSION",
    "is_aiohttp_available",
    "is_deepspeed_available",
    "is_harbor_available",
    "is_jmespath_available",
    "is_liger_kernel_available",
    "is_math_verify_available",
    "is_mergekit_available",
    "is_openreward_available",
    "is_requests_available",
    "is_unsloth_available",
    "is_vllm_available",
    "is_weave_available",
]

# The oldest Liger-Kernel release whose fused losses posttrain's `use_liger_kernel` paths call (TRL 1.16's floor).
LIGER_KERNEL_MIN_VERSION = "0.8.2"


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a broken __spec__
        return False


def _installed_version(module: str, distribution: str) -> Version | None:
    """The version of ``distribution`` when ``module`` is importable, else None ("0" when only the module is
    present, e.g. a source checkout on ``sys.path`` without metadata)."""
    if not _available(module):
        return None
    try:
        return Version(importlib.metadata.version(distribution))
    except importlib.metadata.PackageNotFoundError:
        return Version("0")


def is_aiohttp_available() -> bool:
    return _available("aiohttp")


def is_deepspeed_available() -> bool:
    return _available("deepspeed")


def is_harbor_available() -> bool:
    return _available("harbor")


def is_jmespath_available() -> bool:
    return _available("jmespath")


def is_liger_kernel_available(min_version: str = LIGER_KERNEL_MIN_VERSION) -> bool:
    """Liger-Kernel importable and at least ``min_version``."""
    version = _installed_version("liger_kernel", "liger-kernel")
    return version is not None and version >= Version(min_version)


def is_math_verify_available() -> bool:
    return _available("math_verify")


def is_mergekit_available() -> bool:
    return _available("mergekit")


def is_openreward_available() -> bool:
    return _available("openreward")


def is_requests_available() -> bool:
    return _available("requests")


def is_unsloth_available() -> bool:
    return _available("unsloth")


def is_vllm_available(min_version: str | None = None) -> bool:
    """vLLM importable (and, with ``min_version``, at least that release; local tags such as ``+cu129`` ignored)."""
    version = _installed_version("vllm", "vllm")
    if version is None:
        return False
    return min_version is None or Version(version.base_version) >= Version(min_version)


def is_weave_available() -> bool:
    return _available("weave")
