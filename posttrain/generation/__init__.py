"""Generation backends behind one small protocol (design §1.6, §3.2).

``SamplingConfig`` + prompt ids in, ``Completions`` out, through any ``GenerationBackend``:

- ``"posttrain"`` (default): ``GroupSampler``, one prefill per unique prompt, KV cache expanded G ways, finished
  rows dropped from the decode batch;
- ``"transformers"``: ``TransformersBackend``, ``model.generate`` as TRL calls it;
- ``"vllm_server"``: ``VLLMServerBackend``, a client of ``posttrain serve`` / ``vllm serve`` (weights pushed to it),
  or ``ServerPoolBackend`` over several servers (``vllm_server_base_urls``);
- ``"vllm_colocate"``: ``VLLMColocateBackend``, vLLM's engine in the trainer (``pip install posttrain[vllm]``, CUDA);
- ``"rollout_func"``: ``RolloutFuncBackend``, the user's ``rollout_func(prompts, trainer)``.

The trainer's side of the generation server's wire lives here too, so that backends, the async rollout worker and
the server (``posttrain.serving``, a layer above) share it: ``client`` (``GenerationClient``) and ``weights`` (what a
weight push sends and how the server loads it).

Backends are imported lazily (``get_backend``), so importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.generation.base import Completions, GenerationBackend, SamplingConfig, truncate_at_eos
from posttrain.generation.registry import BACKENDS, DEFAULT_BACKEND, backend_names, get_backend

if TYPE_CHECKING:
    from posttrain.generation.group_sampler import GroupSampler
    from posttrain.generation.rollout_func import RolloutFuncBackend
    from posttrain.generation.server_pool import ServerPoolBackend
    from posttrain.generation.transformers_backend import TransformersBackend
    from posttrain.generation.vllm_colocate import VLLMColocateBackend
    from posttrain.generation.vllm_server import VLLMServerBackend

_LAZY = {
    "GroupSampler": "posttrain.generation.group_sampler",
    "TransformersBackend": "posttrain.generation.transformers_backend",
    "RolloutFuncBackend": "posttrain.generation.rollout_func",
    "ServerPoolBackend": "posttrain.generation.server_pool",
}

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "Completions",
    "GenerationBackend",
    "GroupSampler",
    "RolloutFuncBackend",
    "SamplingConfig",
    "ServerPoolBackend",
    "TransformersBackend",
    "VLLMColocateBackend",
    "VLLMServerBackend",
    "backend_names",
    "get_backend",
    "truncate_at_eos",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'posttrain.generation' has no attribute {name!r}")
