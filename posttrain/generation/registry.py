"""Generation backend names → ``"module:attribute"`` entries, imported only when asked for.

``import posttrain`` must not import vLLM (or even torch) for a backend nobody uses, so the table holds strings and
``get_backend`` imports the one it is asked for. ``vllm_colocate`` checks for vLLM and a CUDA device first and fails
with an error that says what to install or where to run; ``vllm_server`` is an HTTP client of ``posttrain serve`` or
``vllm serve`` (it needs the ``serve`` extra).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from posttrain.generation.base import GenerationBackend
from posttrain.registry import Registry

DEFAULT_BACKEND = "posttrain"

BACKENDS: Registry[str] = Registry("generation backend")
BACKENDS.add("posttrain", "posttrain.generation.group_sampler:GroupSampler")
BACKENDS.add("transformers", "posttrain.generation.transformers_backend:TransformersBackend")
BACKENDS.add("vllm_colocate", "posttrain.generation.vllm_colocate:VLLMColocateBackend")
BACKENDS.add("vllm_server", "posttrain.generation.server_pool:make_server_backend")  # one URL or several
BACKENDS.add("rollout_func", "posttrain.generation.rollout_func:RolloutFuncBackend.from_components")

# The server backend is an HTTP client (httpx): it needs vLLM and a GPU only to talk NCCL to a real vLLM server.
_NEEDS_VLLM = {"vllm_colocate"}


def load_entry(entry: str) -> Any:
    """Import ``"package.module:Attr.sub"`` and return the attribute."""
    module_name, _, attr_path = entry.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def _require_vllm(name: str) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            f"The {name!r} generation backend needs vLLM, which is not installed: pip install posttrain[vllm] "
            "(or use generation backend 'posttrain' or 'transformers')."
        )
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"The {name!r} generation backend requires a CUDA GPU and none is visible; use generation backend "
            "'posttrain' or 'transformers' on this machine."
        )


def get_backend(name: Any = DEFAULT_BACKEND, model: Any = None, tokenizer: Any = None, **kwargs: Any) -> Any:
    """Build a generation backend.

    Args:
        name: A registered name (``"posttrain"`` (default, ``GroupSampler``), ``"transformers"``,
            ``"vllm_colocate"``, ``"vllm_server"``, ``"rollout_func"``), a class/factory called as
            ``name(model, tokenizer, **kwargs)``, or an object that already implements ``GenerationBackend``
            (returned as is).
        model: The policy model (the in-process backends sample from it).
        tokenizer: Its tokenizer or processor.
        **kwargs: Backend options, e.g. ``return_logprobs`` / ``max_batch_tokens`` for ``"posttrain"``, or
            ``rollout_func`` and ``trainer`` for ``"rollout_func"``.

    Raises:
        ValueError: Unknown name (the message lists the valid ones).
        ImportError / RuntimeError: ``vllm_colocate`` without vLLM installed / without a CUDA GPU;
            ``vllm_server`` without httpx.
    """
    if not isinstance(name, str) and not isinstance(name, type) and isinstance(name, GenerationBackend):
        return name
    if not isinstance(name, str):
        return BACKENDS.get(name)(model, tokenizer, **kwargs)
    entry = BACKENDS.get(name)
    if name in _NEEDS_VLLM:
        _require_vllm(name)
    try:
        factory = load_entry(entry)
    except ModuleNotFoundError as e:
        if name != "vllm_server" or e.name not in ("httpx", "fastapi", "uvicorn"):
            raise
        raise ImportError(
            f"The 'vllm_server' generation backend needs {e.name}: pip install posttrain[serve]."
        ) from e
    return factory(model, tokenizer, **kwargs)


def backend_names() -> list[str]:
    """The registered backend names."""
    return BACKENDS.names()
