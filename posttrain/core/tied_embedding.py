"""One ``(V, H)`` gradient for a tied input-embedding / LM-head weight instead of two (single-process training).

A tied weight ``W`` is used twice: by the input lookup ``E = W[ids]`` and by the LM head ``z = h Wᵀ``. Autograd
gives each use its own dense ``(V, H)`` gradient (the lookup's backward scatters its ``(N, H)`` rows into a fresh
zero ``(V, H)`` tensor) and sums them before ``W.grad`` sees them, so during backward two vocabulary-sized
gradients are alive; with gradient accumulation, a third (``W.grad`` from the previous micro-batch). For a
151,936 × 64 head that is 37 MiB each, the largest transient of a small model's step.

Here both uses add into ``W.grad`` itself: the chunked LM head with ``weight_grad_in_place=True``
(:func:`posttrain.core.logprobs.chunked_logprobs_from_hidden`) and the lookup through
:func:`route_embedding_grad_in_place`, whose backward ``index_add_`` s the rows straight into ``W.grad``. The sum is
the same up to float rounding order (rows of a repeated token are added one at a time rather than pre-summed).

Only where nothing else owns the accumulation: callers check :func:`in_place_tied_grad_supported` (no
``torch.distributed`` process group — DDP, FSDP and DeepSpeed reduce gradients from autograd hooks that this path
does not fire — no hooks on the weight or the embedding, a plain float32 ``torch.nn.Embedding``). Set
``POSTTRAIN_TIED_EMBEDDING_GRAD_IN_PLACE=0`` to always use autograd's own accumulation.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

__all__ = ["ENV_DISABLE", "in_place_tied_grad_supported", "route_embedding_grad_in_place"]

ENV_DISABLE = "POSTTRAIN_TIED_EMBEDDING_GRAD_IN_PLACE"


class _LookupGradInPlace(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose backward adds into ``weight.grad`` and returns nothing for it."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.weight = padding_idx, weight
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        flat_ids = ids.reshape(-1)
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
            keep = flat_ids != ctx.padding_idx
            flat_ids, rows = flat_ids[keep], rows[keep]
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, flat_ids, rows.to(weight.grad.dtype))
        return None, None, None


def in_place_tied_grad_supported(embedding: torch.nn.Module, head_weight: torch.Tensor) -> bool:
    """Whether ``embedding`` and an LM head with ``head_weight`` can both add into the shared ``weight.grad``.

    True only for a plain ``torch.nn.Embedding`` (no ``max_norm``, ``scale_grad_by_freq`` or ``sparse``, no module
    hooks but transformers' gradient-checkpointing ``make_inputs_require_grads``) that shares ``head_weight``, a float32 leaf parameter that requires grad and has no autograd hooks, with
    grad mode on and no ``torch.distributed`` process group, unless the environment variable turns the path off.
    """
    if os.environ.get(ENV_DISABLE, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not torch.is_grad_enabled():
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    if type(embedding) is not torch.nn.Embedding or embedding.weight is not head_weight:
        return False
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return False
    if embedding._forward_pre_hooks or _global_module_hooks():
        return False
    if any(not _is_require_grads_hook(hook) for hook in embedding._forward_hooks.values()):
        return False  # e.g. NEFTune's noise hook: its output must stay the one the model uses
    weight = head_weight
    if not (isinstance(weight, torch.nn.Parameter) and weight.is_leaf and weight.requires_grad):
        return False
    if weight.dtype != torch.float32 or weight.layout != torch.strided or type(weight) is not torch.nn.Parameter:
        return False
    if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return False
    grad = weight.grad
    if grad is not None and (grad.layout != torch.strided or grad.dtype != weight.dtype or grad.requires_grad):
        return False
    return grad is None or grad.shape == weight.shape


def _is_require_grads_hook(hook) -> bool:
    """transformers' ``enable_input_require_grads`` hook (set for gradient checkpointing): it only marks the output
    as requiring grad, which the rerouted lookup's output already does (its weight requires grad)."""
    return getattr(hook, "__qualname__", "").endswith("enable_input_require_grads.<locals>.make_inputs_require_grads")


def _global_module_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


@contextlib.contextmanager
def route_embedding_grad_in_place(embedding: torch.nn.Embedding | None) -> Iterator[None]:
    """While active, ``embedding``'s output is the same lookup, with its gradient added straight into
    ``embedding.weight.grad`` (a forward hook, removed on exit). ``None``: does nothing."""
    if embedding is None:
        yield
        return

    def hook(module, args, output):
        if not args:  # called as embedding(input=ids): keep autograd's lookup (still correct, just not lean)
            return None
        ids = args[0]
        return _LookupGradInPlace.apply(ids, module.weight, module.padding_idx)

    handle = embedding.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
