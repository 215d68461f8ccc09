"""PEFT wrapping and the reference policy without a second copy of the weights.

With a LoRA adapter, the reference policy is the same model with adapters disabled (``use_adapter(model, None)``),
so DPO/KTO/GRPO/RLOO need no frozen copy. A model given already wrapped gets a frozen copy of its adapter named
``"ref"`` (TRL's behaviour), so the reference is the adapter the user started from.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from typing import Any

import torch


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def prepare_peft_model(model, peft_config, *, gradient_checkpointing: bool = False):
    """Wrap ``model`` with ``peft_config`` (TRL's rules: PeftConfig type check, no double wrapping)."""
    from peft import PeftConfig, get_peft_model

    if peft_config is None:
        return model
    if not isinstance(peft_config, PeftConfig):
        raise TypeError(
            f"peft_config must be a peft.PeftConfig (e.g. peft.LoraConfig), got {type(peft_config).__name__}."
        )
    if is_peft_model(model):
        raise ValueError(
            "You passed a PeftModel together with a peft_config. Pass either the base model with peft_config, or "
            "the PeftModel alone (its adapter is trained)."
        )
    if gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    return get_peft_model(model, peft_config)


@contextlib.contextmanager
def use_adapter(model, adapter_name: str | None) -> Iterator[None]:
    """Run with ``adapter_name`` active; ``None`` disables all adapters (the base model is the reference)."""
    if not is_peft_model(model):
        yield
        return
    if adapter_name is None:
        with model.disable_adapter():
            yield
        return
    previous = model.active_adapter
    model.set_adapter(adapter_name)
    try:
        yield
    finally:
        model.set_adapter(previous)


def add_reference_adapter(model, name: str = "ref") -> str:
    """Add a frozen copy of the active adapter under ``name`` for reference passes; returns the name."""
    active = model.active_adapter
    if name in model.peft_config:
        return name
    model.add_adapter(name, copy.deepcopy(model.peft_config[active]))
    state = {k: v for k, v in model.state_dict().items() if f".{active}." in k}
    renamed = {k.replace(f".{active}.", f".{name}."): v.clone() for k, v in state.items()}
    model.load_state_dict(renamed, strict=False)
    for pname, param in model.named_parameters():
        if f".{name}." in pname:
            param.requires_grad_(False)
    model.set_adapter(active)
    return name


# Where the decoder layers of common architectures live (``{layer}`` is the layer index), tried in this order.
LAYER_PATTERNS = (
    "transformer.h.{layer}",
    "model.decoder.layers.{layer}",
    "gpt_neox.layers.{layer}",
    "model.layers.{layer}",
)


def create_reference_model(
    model: torch.nn.Module, num_shared_layers: int | None = None, pattern: str | None = None
) -> torch.nn.Module:
    """A frozen, eval-mode copy of ``model`` (used when no PEFT adapter can serve as the reference); TRL's function.

    With ``num_shared_layers=k`` the parameters before decoder layer ``k`` (embeddings and layers ``0..k-1``) are
    not copied: the reference points at the policy's own tensors, and they are frozen in ``model`` too, so the
    reference stays static while taking no extra memory for them.

    Args:
        model: The policy.
        num_shared_layers: How many initial layers to share; ``None``: copy everything.
        pattern: Name of layer ``k`` with ``{layer}`` for the index (e.g. ``"transformer.h.{layer}"``); default: the
            first of ``LAYER_PATTERNS`` found among the parameter names.

    Raises:
        ValueError: Under DeepSpeed ZeRO-3 (load the reference with ``from_pretrained`` instead), or when no
            parameter name matches the layer pattern.
    """
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise ValueError(
            "create_reference_model() cannot copy a ZeRO-3 sharded model; load the reference with "
            "AutoModelForCausalLM.from_pretrained() instead."
        )
    names = [n for n, _ in model.named_parameters()]
    if num_shared_layers is not None:
        candidates = [pattern] if pattern is not None else list(LAYER_PATTERNS)
        layer_prefix = None
        for candidate in candidates:
            prefix = candidate.format(layer=num_shared_layers)
            regex = re.compile(rf"(^|\.){re.escape(prefix)}(\.|$)")
            if any(regex.search(n) for n in names):
                layer_prefix = regex
                break
        if layer_prefix is None:
            tried = ", ".join(repr(c) for c in candidates)
            raise ValueError(
                f"create_reference_model: no parameter name matches layer {num_shared_layers} with the pattern(s) "
                f"{tried}; pass pattern= with '{{layer}}' where the index goes (e.g. 'model.layers.{{layer}}')."
            )
        first_unshared = next(i for i, n in enumerate(names) if layer_prefix.search(n))
        shared = names[:first_unshared]
    else:
        shared = []
    ref = copy.deepcopy(model)
    for pname in shared:
        source = model.get_parameter(pname)
        source.requires_grad_(False)
        ref.get_parameter(pname).data = source.data
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.eval()
