"""The model inside its wrappers, in the two senses trainers need.

- :func:`unwrap_parallel` strips the data-parallel / engine wrappers (DDP, DataParallel, DeepSpeed, FSDP1: anything
  holding the model as ``.module``) and **keeps PEFT adapters**: the model that generates, or whose adapters are
  switched on and off (reference passes, TR-DPO sync).
- :func:`unwrap_base_model` also **strips PEFT** (and ``torch.compile``-style wrappers accelerate knows): the
  transformers ``PreTrainedModel`` whose ``config``, ``forward`` signature and LM head are inspected.

:func:`model_device` says where a (possibly wrapped) model's input ids must live; every generation backend and the
generation server's engine need it, so it sits here rather than in one backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["model_device", "unwrap_base_model", "unwrap_model_for_generation", "unwrap_parallel"]


def unwrap_parallel(model: Any) -> Any:
    """Strip DDP/FSDP-style ``.module`` wrappers (not PEFT: a PEFT model generates with its adapters)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def unwrap_base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP / DeepSpeed / FSDP / ``torch.compile`` / PEFT wrappers."""
    from transformers import PreTrainedModel

    inner = model
    if not isinstance(inner, PreTrainedModel) and not type(inner).__module__.startswith("peft"):
        from accelerate.utils import extract_model_from_parallel  # slow-ish (probes optional packages): only here

        inner = extract_model_from_parallel(inner)
    get_base = getattr(inner, "get_base_model", None)
    if callable(get_base) and type(inner).__module__.startswith("peft"):
        inner = get_base()
    return inner


def model_device(model: Any) -> torch.device:
    """Device of the model's input embeddings (where input ids must live)."""
    try:
        return model.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        return next(model.parameters()).device


@contextlib.contextmanager
def unwrap_model_for_generation(
    model: torch.nn.Module,
    accelerator: Any,
    gather_deepspeed3_params: bool = True,
    generation_kwargs: dict | None = None,
    gradient_checkpointing_kwargs: dict | None = None,
) -> Iterator[torch.nn.Module]:
    """Context manager yielding the model to call ``generate`` on (TRL's ``trl.models.unwrap_model_for_generation``).

    The model comes out of its accelerate wrappers (PEFT adapters kept); gradient checkpointing, which ``generate``'s
    KV cache cannot use, is switched off inside the block and back on afterwards (with
    ``gradient_checkpointing_kwargs``), even when the block raises. Under DeepSpeed ZeRO-3 the partitioned
    parameters are gathered for the block unless ``gather_deepspeed3_params=False`` (then each forward gathers its
    layers, slower but lighter). ``generation_kwargs`` is accepted for TRL's signature; as in TRL under transformers
    5, it does not change the model's ``generation_config`` (pass generation options to ``generate`` itself).
    """
    del generation_kwargs  # TRL overrides generation_config only under transformers 4 (transformers#42762)
    unwrapped = accelerator.unwrap_model(model)
    checkpointing = bool(getattr(unwrapped, "is_gradient_checkpointing", False))
    if checkpointing:
        unwrapped.gradient_checkpointing_disable()
    try:
        params = list(model.parameters())
        if gather_deepspeed3_params and any(hasattr(p, "ds_id") for p in params):
            import deepspeed  # ZeRO-3-partitioned parameters exist only when deepspeed is installed

            with deepspeed.zero.GatheredParameters(params):
                yield unwrapped
        else:
            yield unwrapped
    finally:
        if checkpointing:
            unwrapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)
