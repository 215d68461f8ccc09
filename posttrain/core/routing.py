"""Mixture-of-experts routing math for routing replay (``keep_routing``): the gate weights of given experts.

A top-k router scores ``E`` experts per token, ``p = softmax(z)`` over its logits ``z`` ``(N, E)``, keeps the ``k``
most probable ``S = topk(p)`` and mixes the kept experts' outputs with weights ``w_j = p_{S_j}`` (Qwen2-MoE /
Qwen3-MoE with ``norm_topk_prob=False``) or ``w_j = p_{S_j} / Σ_{i∈S} p_i`` (Mixtral, Qwen3-MoE's default).
Routing replay keeps the *set* ``S`` the sampler chose and recomputes only the weights from the current logits:
:func:`routing_weights` is that recomputation. The weights stay a differentiable function of ``z``, so the router
still learns (its gradient flows through the weights of the replayed experts, as it does through the weights of
its own choice without replay); only the discrete choice is taken from the record.

Indices are stored compactly between sampling and training as ``expert + 1`` in the smallest unsigned/signed integer
type that holds ``E`` (:func:`routing_storage_dtype`), with 0 meaning "not recorded: let the router choose".
"""

from __future__ import annotations

import torch

__all__ = ["decode_routing", "encode_routing", "routing_storage_dtype", "routing_weights"]


def routing_weights(
    router_logits: torch.Tensor, experts: torch.Tensor, normalize: bool, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Gate weights ``(N, k)`` of the experts ``experts`` ``(N, k)`` (int64) under ``router_logits`` ``(N, E)``.

    ``w = softmax(z)[experts]`` computed in float32, divided by its row sum when ``normalize``, then cast to
    ``dtype`` (default: the logits' dtype). For ``experts = topk(softmax(z), k).indices`` this is exactly what the
    Qwen2-MoE / Qwen3-MoE / Mixtral routers of transformers return (same operations, same order), so rows routed by
    the router's own choice are bit-for-bit unchanged.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (N, E)
    weights = probs.gather(-1, experts)  # (N, k)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype if dtype is None else dtype)


def routing_storage_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype holding ``expert + 1`` for ``num_experts`` experts (0 is "not recorded")."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be positive, got {num_experts}.")
    if num_experts <= 255:
        return torch.uint8
    if num_experts <= 32766:
        return torch.int16
    return torch.int32


def encode_routing(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``experts`` (int64 expert ids, any shape) → ``expert + 1`` in :func:`routing_storage_dtype`."""
    return (experts + 1).to(routing_storage_dtype(num_experts))


def decode_routing(stored: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_routing`: int64 expert ids, ``-1`` where nothing was recorded (stored 0)."""
    return stored.long() - 1
