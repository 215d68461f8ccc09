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

from typing import Any

import torch

__all__ = ["model_device", "unwrap_base_model", "unwrap_parallel"]


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
